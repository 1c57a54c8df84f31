package scheduler

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/workerurl"
)

// waiter is a job waiting in the pool's queue.
type waiter struct {
	t     *Ticket
	ready chan struct{} // closed once t.worker is set
	given func()        // called once t.worker is set, when its caller does not wait on ready: see Admit
	since int64         // when it joined the queue, Unix nanoseconds
	gone  bool          // it left the queue: see arrivals
	line  *line         // the line it waits in (see queueindex.go)
	at    int           // its place's index in the line's heap
}

// Acquire gives t a worker. A job that finds every fitting worker full
// waits in the pool's queue until one frees up (late binding), the client
// leaves, or the queue timeout passes.
func (p *Pool) Acquire(ctx context.Context, t *Ticket) error {
	p.mu.Lock()
	wt, err := p.admitLocked(t)
	p.mu.Unlock()
	if wt == nil {
		return err
	}
	return p.wait(ctx, t, wt)
}

// Admit is Acquire for a caller that does not wait: it gives t a worker
// now or a place in the queue, and calls given once t has its worker,
// under the pool's lock and before Admit returns if a worker is free. It
// reports why t may not wait, as Acquire does. t waits with no timeout,
// until it gets a worker. The scheduler's simulation (cmd/bench --mode
// schedule) runs thousands of jobs this way on one goroutine.
func (p *Pool) Admit(t *Ticket, given func()) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	wt, err := p.admitLocked(t)
	switch {
	case err != nil:
		return err
	case wt == nil:
		given()
	case wt.gone: // given a worker as it joined the queue
		given()
	default:
		wt.given = given
	}
	return nil
}

// admitLocked gives t a worker now, or a place in the queue, or the reason
// it may not wait.
func (p *Pool) admitLocked(t *Ticket) (*waiter, error) {
	if t.aborted != nil {
		return nil, t.aborted
	}
	if t.seq == 0 {
		p.seq++
		t.seq = p.seq
		t.arrived = p.now().UnixNano()
		p.noteQueueLengthLocked(t)
		t.key = t.cfg.order().Key(p.orderedLocked(t))
	}
	if t.Job && (t.Tenant != "" || p.tenancy.on) && (t.tenant == nil || t.tenant.evicted) {
		p.joinTenantLocked(t)
	}
	if p.placement.on && t.policy == nil {
		t.policy = &p.placement.base // adapters were declared after t was resolved
	}
	if !t.Job || p.queue.n == 0 || p.goesFirstLocked(t) { // a job never overtakes waiting ones
		if w, _ := p.chooseLocked(t); w != nil {
			p.assignLocked(t, w)
			return nil, nil
		}
	}
	if err := p.waitErrorLocked(t); err != nil {
		return nil, err
	}
	if p.queue.n >= t.cfg.MaxQueue && !t.again { // a job running again was admitted already
		return nil, ErrQueueFull
	}
	if tenantQueueFullLocked(t) {
		return nil, ErrTenantQueueFull
	}
	wt := p.enqueueLocked(t)
	p.jobMovedLocked(nil) // a prefetch slot may be free for the queue's head
	return wt, nil
}

// orderedLocked is t's job as a queue order sees it now.
func (p *Pool) orderedLocked(t *Ticket) Job {
	return Job{
		Cost: t.Cost, Seq: t.seq,
		Arrived: float64(t.arrived) / float64(time.Second),
		Runs:    t.Cost / p.defaultSpeed,
		Long:    p.long,
	}
}

// longQueue is how many of the largest jobs that came since the queue was
// last empty, per worker, the queue holds when it becomes long (see
// Adaptive). An open stream of jobs at 70% of the fleet's capacity makes
// it so too rarely to change its waits by 1%, and a rollout step of 64
// heavy-mix jobs per worker at once about a sixth of the way in (cmd/bench
// --mode schedule; docs/benchmarks.md).
const longQueue = 4

// noteQueueLengthLocked notes whether the queue is long, as t arrives
// (see Adaptive): the jobs waiting already take a new place in an order
// that reads it.
func (p *Pool) noteQueueLengthLocked(t *Ticket) {
	p.largest = max(p.largest, t.Cost)
	if p.long || !(p.queuedCost > longQueue*p.largest*float64(len(p.workers))) {
		return
	}
	p.long = true
	p.queue.rekey(func(t *Ticket) float64 { return t.cfg.order().Key(p.orderedLocked(t)) })
}

// goesFirstLocked reports whether t, a job, goes ahead of every waiting
// one. With tenants, only a higher priority is sure to: among jobs of one
// priority the tenants' counters decide, so t waits and dispatch decides.
func (d *dispatchState) goesFirstLocked(t *Ticket) bool {
	if d.tenancy.on {
		return t.Priority > d.queue.top()
	}
	return t.before(d.queue.first().wt.t)
}

// wait waits for wt's ticket to be given a worker.
func (p *Pool) wait(ctx context.Context, t *Ticket, wt *waiter) error {
	var expired chan struct{}
	if t.cfg.Timeout > 0 {
		expired = make(chan struct{})
		timer := p.clock.AfterFunc(t.cfg.Timeout, func() { close(expired) })
		defer timer.Stop()
	}
	var err error
	select {
	case <-wt.ready:
		return nil
	case <-ctx.Done():
		err = cmp.Or(CancelledBy(ctx), ctx.Err())
	case <-expired:
		err = ErrQueueTimeout
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.dequeueLocked(wt) {
		p.releaseLocked(t, End{Worker: Abandoned}) // a worker came as we gave up: hand it on
	}
	return err
}

// Release ends t's claim on its worker, which its attempt ended as e
// says. It reports how long the worker is ejected for if this failure
// ejected it. A worker that failed t, or that t leaves to run again
// (e.Rerun; copies of it may still run, and Retry may follow), is one t
// tried, as for Retry: an answer that broke while its worker's slot was
// held (on probation) may run again, and not there.
func (p *Pool) Release(t *Ticket, e End) time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	if w := t.worker; w != nil && e.leaves() {
		t.tried = append(t.tried, w)
	}
	return p.releaseLocked(t, e)
}

// Why a request gets no worker.
var (
	ErrNoWorker      = errors.New("No healthy workers available in the pool")
	ErrQueueFull     = errors.New("queue full")
	ErrQueueTimeout  = errors.New("queue timeout")
	ErrNoVersion     = errors.New("no worker is or will be on the weight version asked for")
	ErrAsleep        = errors.New("every worker that could serve it is asleep")
	ErrNoOtherWorker = errors.New("no worker it was not sent to may serve it")
)

// waitErrorLocked says why t may not wait in the queue for a worker, or
// nil when it may: it is a job and some worker that may serve it could
// take it later. A job is not held for workers that are all asleep: a
// trainer that put the fleet to sleep is training, and a generation then
// is a mistake to report, not to hold. A worker t was sent to counts as
// asleep, never as awake: a job found it asleep by being sent there.
func (p *Pool) waitErrorLocked(t *Ticket) error {
	awake, sleeper := false, false
	now := p.now().UnixNano()
	for _, w := range p.workers {
		if !p.mayTakeLocked(t, w, now, question{asks: couldServe, upcoming: p.fleet.target()}) {
			continue
		}
		s := w.life.state == Sleeping || w.stateAt(now) == Sleeping
		sleeper = sleeper || s
		awake = awake || !s && p.mayTakeLocked(t, w, now, question{asks: untried})
		if awake && t.Job {
			return nil // the rest of the fleet can only tell why a job may not wait
		}
	}
	switch {
	case sleeper && !awake:
		return ErrAsleep
	case t.WantVersion != "":
		return ErrNoVersion
	}
	return ErrNoWorker
}

func (p *Pool) assignLocked(t *Ticket, w *worker) {
	t.worker, t.servedBy, t.servedVersion = w, w.url, t.versionOn(w.life.version)
	t.probation = t.Job && w.health.probation
	if !t.Job {
		return
	}
	if t.tenant != nil {
		p.chargeLocked(t.tenant, t)
	}
	if w.load.inflight == 0 {
		p.startLocked(w, t, p.now().UnixNano())
	}
	w.load.inflight++
	w.load.jobs = append(w.load.jobs, t)
	w.load.work += t.Cost
	t.predicted = p.timeForLocked(w, t.Cost)
	p.updateEndsLocked(w)
	t.dueWork = p.workLeftLocked(w, p.now().UnixNano())
}

// startLocked notes that t has reached the head of w's jobs: a worker runs
// its jobs one at a time, in arrival order.
func (p *Pool) startLocked(w *worker, t *Ticket, now int64) {
	t.started = now
	w.load.headCost, w.load.headSince = t.Cost, now
}

func (p *Pool) releaseLocked(t *Ticket, e End) (ejected time.Duration) {
	w := t.worker
	ejected = p.freeLocked(t, e)
	if e.leaves() || e.Worker == Asleep {
		p.dispatchLocked() // news of the worker
	} else {
		p.jobMovedLocked(w)
	}
	return ejected
}

// freeLocked is releaseLocked but for handing the slot it frees to a
// waiting job.
func (p *Pool) freeLocked(t *Ticket, e End) (ejected time.Duration) {
	w := t.worker
	if w == nil {
		return 0
	}
	if e.Worker == Abandoned && t.Job && t.sent && !t.held && !t.ghost {
		p.keepGhostLocked(t)
		return 0
	}
	t.worker = nil
	p.wakeWaitersLocked()
	switch {
	case e.Worker == Succeeded:
		w.stats.served++
		w.evidence.consecFails = 0
	case e.Worker == Refused:
		w.stats.served++
	case e.Worker.failed():
		w.stats.failures++
		w.evidence.consecFails++
		p.forgetAdapterLocked(w) // it may have restarted: read its adapter back before its next job
	}
	ejected = p.noteEvidenceLocked(w, t, e.Worker)
	if !t.Job {
		return ejected
	}
	if t.tenant != nil {
		t.tenant.running--
	}
	now := p.now().UnixNano()
	w.load.lastFinish = now
	if e.Worker == Succeeded {
		// An answer released before the head's (two arriving together)
		// never started on this clock: it has no run time to learn from.
		if t.started != 0 {
			w.load.speed.Observe(t.Cost, time.Duration(now-t.started), t.predicted)
		}
		w.stats.jobsDone++
		w.stats.costDone += t.Cost
		p.completions++
		// The median changes when a worker learns its first speed, and
		// slowly otherwise.
		if w.load.speed.Samples() == 1 || p.completions%256 == 0 {
			p.refreshDefaultSpeedLocked()
		}
	}
	wasHead := len(w.load.jobs) > 0 && w.load.jobs[0] == t
	w.load.inflight--
	w.load.jobs = slices.DeleteFunc(w.load.jobs, func(x *Ticket) bool { return x == t })
	w.load.work -= t.Cost
	switch {
	case len(w.load.jobs) == 0:
		w.load.work = 0 // no float drift on an idle worker
	case wasHead:
		p.startLocked(w, w.load.jobs[0], now)
	}
	switch {
	case e.Worker == Overtaken:
		w.health.suspect = true // until a probe finds nothing overrunning
	case wasHead:
		w.health.suspect = false // the stalled job, if it was one, has ended
	}
	if w.life.removed && w.load.inflight == 0 {
		delete(p.departing, workerurl.AddressKey(w.dial))
	}
	p.updateEndsLocked(w)
	p.rearmGhostsLocked()
	return ejected
}

// dispatchLocked hands free slots to waiting jobs, in queue order; a job
// that no free worker may serve lets the ones behind it pass.
func (p *Pool) dispatchLocked() {
	p.dispatchJobsLocked()
	if p.placement.on {
		p.placeLocked()
	}
}

// jobMovedLocked is dispatchLocked after a job arrived or ended, freeing
// freed (nil: none): placement looks again only when the job calls for it
// (see placementDueLocked).
func (p *Pool) jobMovedLocked(freed *worker) {
	p.dispatchJobsLocked()
	if p.placement.on && p.placementDueLocked(freed, p.now().UnixNano()) {
		p.placeLocked()
	}
}

// dispatchJobsLocked is dispatchLocked without placement: one pass, of
// the jobs passed over for too long, then of the queue.
func (p *Pool) dispatchJobsLocked() {
	p.queue.pass++
	p.dispatchPassedOverLocked()
	p.dispatchQueueLocked()
}

// dispatchQueueLocked hands free slots to waiting jobs, one at a time,
// each to the job nextLocked picks.
func (p *Pool) dispatchQueueLocked() {
	for {
		wt, w := p.nextLocked()
		if w == nil {
			return
		}
		p.dequeueLocked(wt)
		p.handOutLocked(wt, w)
	}
}

// nextLocked picks the waiting job that gets a free worker next in a
// dispatch pass, and the worker; nil when no free worker may take any
// waiting job. A job that no free worker may serve lets the ones behind
// it pass, and so does the rest of its class for the rest of the pass:
// they break the same constraints, and a worker given a job in the pass
// can only have fewer slots free.
func (p *Pool) nextLocked() (*waiter, *worker) {
	for {
		l := p.queue.next()
		if l == nil {
			return nil, nil
		}
		wt := l.head().wt
		open, held := p.openLocked(wt.t.cfg.MaxInflight)
		w, anyFree := p.chooseAmongLocked(wt.t, open)
		switch {
		case w != nil:
			return wt, w
		case !anyFree && !held:
			return nil, nil
		}
		l.class.blocked = p.queue.pass
	}
}

// handOutLocked gives wt's job, taken out of the queue, worker w.
func (p *Pool) handOutLocked(wt *waiter, w *worker) {
	p.assignLocked(wt.t, w)
	close(wt.ready)
	if wt.given != nil {
		wt.given()
	}
}

func (p *Pool) enqueueLocked(t *Ticket) *waiter {
	wt := &waiter{t: t, ready: make(chan struct{}), since: p.now().UnixNano()}
	if p.queue.n == 0 {
		p.queuedCost = 0 // no float drift carried into an empty queue
		p.long, p.largest = false, t.Cost
	}
	if tn := t.tenant; tn != nil {
		if tn.idle() {
			p.activateLocked(tn)
		}
		tn.waiting++
	}
	p.queue.add(wt)
	t.waiter = wt
	p.queuedCost += t.Cost
	p.arriveLocked(wt)
	return wt
}

// compare orders waiting jobs: by priority, then by the queue order, then
// by arrival. A job running again keeps its arrival, so its place.
func (t *Ticket) compare(u *Ticket) int {
	return cmp.Or(cmp.Compare(u.Priority, t.Priority), cmp.Compare(t.key, u.key), cmp.Compare(t.seq, u.seq))
}

// before reports whether t goes ahead of u in the queue.
func (t *Ticket) before(u *Ticket) bool { return t.compare(u) < 0 }

// dequeueLocked takes a waiter out of the queue; false means it had already
// been given a worker.
func (d *dispatchState) dequeueLocked(wt *waiter) bool {
	if wt.gone {
		return false
	}
	d.queue.remove(wt)
	if tn := wt.t.tenant; tn != nil {
		tn.waiting--
	}
	wt.gone, wt.t.waiter = true, nil
	d.queuedCost -= wt.t.Cost
	return true
}
