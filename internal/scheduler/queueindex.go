package scheduler

import (
	"cmp"
	"container/heap"
	"iter"
	"slices"
)

// The queue is indexed by what the eligibility chain reads of a job
// (classOf): jobs alike in it are served by the same workers, so a
// dispatch pass asks the chain about the first job of each class, not
// about every job, and a class whose first job no free worker may take
// waits out the pass whole. A class's jobs wait in lines, one for each
// tenant while tenants are on and one in all while they are off, each a
// heap in compare order, and a class's lines are a heap in the order
// their heads go in: a job joins or leaves the queue in O(log n), and
// the job a free worker goes to next is the first of the first line of
// some class. With 100,000 jobs waiting, of 64 tenants and 8 adapters, a
// pass that finds nothing a free worker may take asks the chain about 8
// jobs, not 100,000.

// waitingJobs is the pool's queue: the jobs waiting for a worker.
type waitingJobs struct {
	classes map[classKey]*class
	all     []*class // the classes, in no order
	recent  *class   // the class of the job that came last: the jobs of a batch come alike
	levels  []level  // the priorities of the jobs waiting, highest first
	n       int      // jobs waiting
	shape   uint64   // classes and priorities that came or went, and classes whose first job's priority rose: placement looks again when it changes
	pass    uint64   // dispatch passes so far: see class.blocked
}

// class is the waiting jobs of one classKey.
type class struct {
	key     classKey
	lines   lineHeap // one for each tenant, or one while tenants are off
	waiting int      // its jobs
	cost    float64  // their costs summed
	at      int      // its index in waitingJobs.all
	blocked uint64   // the pass that found no free worker may take its jobs: they wait out the rest of it
	// unheld are its jobs of a bounded version policy that it has not
	// held back yet, and some that left: when the chain holds one back,
	// it holds back them all (see noteHeldLocked).
	unheld []*waiter
}

// line is the waiting jobs of one class and one tenant: a heap of their
// places in compare order, the first at its head.
type line struct {
	class  *class
	tenant *tenant // nil while tenants are off
	places []place
	at     int // its index in its class's lineHeap
}

// place is a waiting job's place in its line.
type place struct {
	queuedJob
	wt *waiter
}

// queuedJob is what the queue keeps of a waiting job beside its ticket:
// what orders it, and what a backlog plays out of it. It holds no
// pointer, so that a backlog copies 100,000 of them under the pool's lock
// in a fraction of a millisecond, reading no ticket.
type queuedJob struct {
	priority int
	key      float64
	seq      uint64
	cost     float64
	charge   float64 // what its tenant's counter gains when it gets a worker (see chargeOf)
}

// level is how many jobs of one priority wait.
type level struct{ priority, waiting int }

// compare orders waiting jobs as Ticket.compare does.
func (a *queuedJob) compare(b *queuedJob) int {
	return cmp.Or(cmp.Compare(b.priority, a.priority), cmp.Compare(a.key, b.key), cmp.Compare(a.seq, b.seq))
}

// before reports whether a's job goes ahead of b's.
func (a *place) before(b *place) bool { return a.compare(&b.queuedJob) < 0 }

// goesBefore reports whether l's head goes to a worker before m's: the
// higher priority first; then, of two tenants, the one with the lower
// counter, then the one whose first job came first; then compare order.
func (l *line) goesBefore(m *line) bool {
	a, b := l.head(), m.head()
	if a.priority != b.priority || l.tenant == m.tenant {
		return a.before(b)
	}
	return cmp.Or(cmp.Compare(l.tenant.served, m.tenant.served), cmp.Compare(l.tenant.first.head().seq, m.tenant.first.head().seq)) < 0
}

// chargeOf is what t's tenant's counter gains when t's job gets a worker:
// its cost over the tenant's weight; 0 for a job charged already (see
// chargeLocked) or of no tenant.
func chargeOf(t *Ticket) float64 {
	if t.tenant == nil || t.charged {
		return 0
	}
	return t.Cost / t.cfg.weight(t.tenant.name)
}

// add puts wt's job at its place in its line.
func (q *waitingJobs) add(wt *waiter) {
	t := wt.t
	l := q.lineOf(t)
	if c := l.class; len(c.lines) > 0 && t.Priority > c.lines[0].head().priority {
		q.shape++ // placement ranks adapters by their first jobs' priorities
	}
	wt.line = l
	switch at := l.push(placeOf(wt)); {
	case len(l.places) == 1:
		q.open(l)
	case at == 0:
		q.moved(l)
	}
	c := l.class
	c.waiting++
	c.cost += t.Cost
	if t.Staleness.Bounded() && !t.heldBack {
		c.unheld = append(dropGone(c.unheld, c.waiting), wt)
	}
	q.n++
	q.count(t.Priority, 1)
}

// lineOf is the line of t's job, made, and its class, when t's job is
// the first of it to wait.
func (q *waitingJobs) lineOf(t *Ticket) *line {
	if q.classes == nil {
		q.classes = make(map[classKey]*class)
	}
	key := classOf(t)
	c := q.recent
	if c == nil || c.key != key {
		c = q.classes[key]
	}
	if c == nil {
		c = &class{key: key, at: len(q.all)}
		q.classes[key] = c
		q.all = append(q.all, c)
		q.shape++
	}
	q.recent = c
	for _, l := range c.lines { // one, or one for each tenant
		if l.tenant == t.tenant {
			return l
		}
	}
	return &line{class: c, tenant: t.tenant}
}

// placeOf is wt's place.
func placeOf(wt *waiter) place {
	t := wt.t
	return place{queuedJob{priority: t.Priority, key: t.key, seq: t.seq, cost: t.Cost, charge: chargeOf(t)}, wt}
}

// open lets l, with its first job, join its class and its tenant.
func (q *waitingJobs) open(l *line) {
	tn := l.tenant
	if tn != nil {
		tn.lines = append(tn.lines, l)
		tn.first = firstOf(tn.lines)
	}
	heap.Push(&l.class.lines, l)
	if tn != nil {
		q.rerank(tn) // its first job may be l's
	}
}

// moved puts l, whose head changed, at its place in its class; of a
// tenant, whose first job may have changed with it, the tenant's other
// lines too.
func (q *waitingJobs) moved(l *line) {
	tn := l.tenant
	if tn == nil {
		heap.Fix(&l.class.lines, l.at)
		return
	}
	tn.first = firstOf(tn.lines)
	q.rerank(tn)
}

// rerank puts tn's lines at their places in their classes, once its
// counter or its first job changed. A class has one line of each tenant,
// so a line is all that moves in its class.
func (q *waitingJobs) rerank(tn *tenant) {
	for _, l := range tn.lines {
		heap.Fix(&l.class.lines, l.at)
	}
}

// firstOf is the line whose head goes first in compare order.
func firstOf(lines []*line) *line {
	var first *line
	for _, l := range lines {
		if first == nil || l.head().before(first.head()) {
			first = l
		}
	}
	return first
}

// remove takes wt's job out of its line.
func (q *waitingJobs) remove(wt *waiter) {
	l, at := wt.line, wt.at
	l.removeAt(at)
	wt.line = nil
	l.class.waiting--
	l.class.cost -= wt.t.Cost
	q.n--
	q.count(wt.t.Priority, -1)
	switch {
	case len(l.places) == 0:
		q.close(l)
	case at == 0:
		q.moved(l)
	}
}

// close lets go of l, which has no job left: it leaves its class, which
// goes once it has no line, and its tenant, whose first job may have
// been l's.
func (q *waitingJobs) close(l *line) {
	c := l.class
	heap.Remove(&c.lines, l.at)
	if len(c.lines) == 0 {
		last := q.all[len(q.all)-1]
		q.all[c.at], last.at = last, c.at
		q.all[len(q.all)-1] = nil
		q.all = q.all[:len(q.all)-1]
		delete(q.classes, c.key)
		q.shape++
		if q.recent == c {
			q.recent = nil
		}
	}
	if tn := l.tenant; tn != nil {
		i := slices.Index(tn.lines, l)
		tn.lines[i] = tn.lines[len(tn.lines)-1]
		tn.lines[len(tn.lines)-1] = nil
		tn.lines = tn.lines[:len(tn.lines)-1]
		tn.first = firstOf(tn.lines)
		q.rerank(tn)
	}
}

// count adds by to the jobs waiting at priority.
func (q *waitingJobs) count(priority, by int) {
	i, found := slices.BinarySearchFunc(q.levels, priority, func(l level, p int) int { return cmp.Compare(p, l.priority) })
	if !found {
		q.levels = slices.Insert(q.levels, i, level{priority: priority})
		q.shape++
	}
	if q.levels[i].waiting += by; q.levels[i].waiting == 0 {
		q.levels = slices.Delete(q.levels, i, i+1)
		q.shape++
	}
}

// top is the highest priority of a waiting job; the queue must not be
// empty.
func (q *waitingJobs) top() int { return q.levels[0].priority }

// bottom is the lowest priority of a waiting job; the queue must not be
// empty.
func (q *waitingJobs) bottom() int { return q.levels[len(q.levels)-1].priority }

// next is the line whose head a free worker goes to next: of the classes
// not blocked in this pass, the first line of the one whose first line
// goes first; nil when every class waits out the pass.
func (q *waitingJobs) next() *line {
	var best *line
	for _, c := range q.all {
		if c.blocked != q.pass && (best == nil || c.lines[0].goesBefore(best)) {
			best = c.lines[0]
		}
	}
	return best
}

// first is the waiting job that goes first in compare order, tenants
// aside; the queue must not be empty.
func (q *waitingJobs) first() *place {
	var first *place
	for l := range q.eachLine() {
		if first == nil || l.head().before(first) {
			first = l.head()
		}
	}
	return first
}

// lineCount is how many lines there are.
func (q *waitingJobs) lineCount() int {
	n := 0
	for _, c := range q.all {
		n += len(c.lines)
	}
	return n
}

// eachLine is the lines, in no order. The queue must not change while
// they are read.
func (q *waitingJobs) eachLine() iter.Seq[*line] {
	return func(yield func(*line) bool) {
		for _, c := range q.all {
			for _, l := range c.lines {
				if !yield(l) {
					return
				}
			}
		}
	}
}

// jobs are the waiting jobs, in no order. The queue must not change while
// they are read.
func (q *waitingJobs) jobs() iter.Seq[*waiter] {
	return func(yield func(*waiter) bool) {
		for l := range q.eachLine() {
			for i := range l.places {
				if !yield(l.places[i].wt) {
					return
				}
			}
		}
	}
}

// rekey gives every waiting job the key key returns for it, and puts it
// at its new place: the whole queue takes a new order at once.
func (q *waitingJobs) rekey(key func(*Ticket) float64) {
	for l := range q.eachLine() {
		for i := range l.places {
			pl := &l.places[i]
			pl.wt.t.key = key(pl.wt.t)
			pl.key = pl.wt.t.key
		}
		for i := len(l.places)/2 - 1; i >= 0; i-- {
			l.down(i)
		}
	}
	for l := range q.eachLine() {
		if tn := l.tenant; tn != nil {
			tn.first = firstOf(tn.lines)
		}
	}
	for _, c := range q.all {
		heap.Init(&c.lines)
	}
}

// moveTo makes every waiting job, of no tenant so far, a job of tn, which
// has none: each class's one line becomes tn's.
func (q *waitingJobs) moveTo(tn *tenant) {
	for _, c := range q.all {
		l := c.lines[0]
		l.tenant = tn
		tn.lines = append(tn.lines, l)
		for i := range l.places {
			pl := &l.places[i]
			pl.wt.t.tenant = tn
			pl.charge = chargeOf(pl.wt.t)
		}
	}
	tn.first = firstOf(tn.lines)
}

// dropGone drops the waiters that left the queue from ws once they are
// most of it, so that ws stays within twice the live ones it holds.
func dropGone(ws []*waiter, live int) []*waiter {
	if len(ws) <= 2*live+64 {
		return ws
	}
	kept := ws[:0]
	for _, wt := range ws {
		if !wt.gone {
			kept = append(kept, wt)
		}
	}
	clear(ws[len(kept):])
	return kept
}

// head is l's first job's place.
func (l *line) head() *place { return &l.places[0] }

// push adds pl to l's heap, and returns its index there.
func (l *line) push(pl place) int {
	l.places = append(l.places, pl)
	l.up(len(l.places)-1, pl)
	return pl.wt.at
}

// removeAt takes the place at i out of l's heap.
func (l *line) removeAt(i int) {
	last := len(l.places) - 1
	moved := l.places[last]
	l.places[last] = place{}
	l.places = l.places[:last]
	if i == last {
		return
	}
	l.put(i, moved)
	l.down(i)
	l.up(moved.wt.at, moved)
}

// put sets the place at i, and tells its waiter where it is.
func (l *line) put(i int, pl place) {
	l.places[i] = pl
	pl.wt.at = i
}

// up moves pl, at i, towards the head past the places it goes before.
func (l *line) up(i int, pl place) {
	for i > 0 {
		parent := (i - 1) / 2
		if !pl.before(&l.places[parent]) {
			break
		}
		l.put(i, l.places[parent])
		i = parent
	}
	l.put(i, pl)
}

// down moves the place at i away from the head past the places that go
// before it.
func (l *line) down(i int) {
	pl, n := l.places[i], len(l.places)
	for {
		c := 2*i + 1
		if c >= n {
			break
		}
		if c+1 < n && l.places[c+1].before(&l.places[c]) {
			c++
		}
		if !l.places[c].before(&pl) {
			break
		}
		l.put(i, l.places[c])
		i = c
	}
	l.put(i, pl)
}

// lineHeap is a class's lines, a heap by the order their heads go in
// (goesBefore).
type lineHeap []*line

func (h lineHeap) Len() int           { return len(h) }
func (h lineHeap) Less(i, j int) bool { return h[i].goesBefore(h[j]) }
func (h lineHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].at, h[j].at = i, j
}
func (h *lineHeap) Push(x any) {
	l := x.(*line)
	l.at = len(*h)
	*h = append(*h, l)
}
func (h *lineHeap) Pop() any {
	old := *h
	l := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return l
}
