package scheduler

import (
	"container/heap"
	"time"
)

// Backlog is the time the pool's workers are predicted to need to finish
// every job they run and every job waiting, at their learned speeds: the
// figure an autoscaler scales the fleet on, since sglang-diffusion serves
// no load metric of its own.
//
// The queue is played out as the pool dispatches it: in queue order, each
// waiting job goes to the serving worker that may serve it and frees up
// first (late binding), and runs there after the work that worker has. A
// worker that is not serving (ejected, draining, asleep) still finishes
// the jobs it runs but takes none of the waiting ones. A job no serving
// worker may serve adds nothing: it waits for a worker the pool lacks.
func (p *Pool) Backlog() time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	return time.Duration(p.backlogLocked(nil) * float64(time.Second))
}

// backlogLocked is Backlog in seconds. With byTenant, it also notes there
// how long each tenant's jobs, running and waiting, are predicted to take
// to finish, the queue played out in the order the tenants' shares give.
func (p *Pool) backlogLocked(byTenant map[*tenant]float64) float64 {
	now := p.now().UnixNano()
	var free freeTimes
	longest := 0.0
	for _, w := range p.workers {
		speed := p.speedOfLocked(w)
		left := p.workLeftLocked(w, now)/speed + p.switchLeftLocked(w, now) // a switch pending is time too
		longest = max(longest, left)
		if w.serving(now) {
			free = append(free, freeAt{w, left})
		}
		if byTenant != nil && len(w.load.jobs) > 0 {
			end := left - (w.load.work-w.load.headCost)/speed // the running job's
			for i, t := range w.load.jobs {
				if i > 0 {
					end += t.Cost / speed
				}
				if t.tenant != nil {
					byTenant[t.tenant] = max(byTenant[t.tenant], end)
				}
			}
		}
	}
	heap.Init(&free)
	queue := p.queue
	if p.tenancy.on {
		queue = p.playOrderLocked()
	}
	for _, wt := range queue {
		if end, ok := free.take(p, wt.t, now); ok {
			longest = max(longest, end)
			if byTenant != nil && wt.t.tenant != nil {
				byTenant[wt.t.tenant] = max(byTenant[wt.t.tenant], end)
			}
		}
	}
	return longest
}

// playOrderLocked is the queue in the order the tenants' shares would
// dispatch it, were every job servable by the next free worker: among the
// heads of the highest priority, the tenant with the lowest counter,
// charged as it goes. It runs under the lock at each scrape: a scan of the
// tenants with jobs waiting (at most max_tenants + 1) per job, no map.
func (d *dispatchState) playOrderLocked() []*waiter {
	type share struct {
		tn     *tenant
		served float64
		next   int
	}
	out := make([]*waiter, 0, len(d.queue))
	var active []share
	for _, tn := range d.tenancy.list {
		if len(tn.queue) > 0 {
			active = append(active, share{tn, tn.served, 0})
		}
	}
	for len(active) > 0 {
		best := 0
		for i := 1; i < len(active); i++ {
			a, b := active[i].tn.queue[active[i].next].t, active[best].tn.queue[active[best].next].t
			if a.Priority > b.Priority || a.Priority == b.Priority &&
				(active[i].served < active[best].served || active[i].served == active[best].served && a.seq < b.seq) {
				best = i
			}
		}
		sh := &active[best]
		wt := sh.tn.queue[sh.next]
		sh.next++
		if !wt.t.charged {
			sh.served += wt.t.Cost / wt.t.cfg.weight(sh.tn.name)
		}
		out = append(out, wt)
		if sh.next == len(sh.tn.queue) {
			active[best] = active[len(active)-1]
			active = active[:len(active)-1]
		}
	}
	return out
}

// freeAt is when a worker, in seconds from now, is done with the work it
// has been given so far.
type freeAt struct {
	w       *worker
	seconds float64
}

// freeTimes is a min-heap of workers by when they free up.
type freeTimes []freeAt

func (f freeTimes) Len() int           { return len(f) }
func (f freeTimes) Less(i, j int) bool { return f[i].seconds < f[j].seconds }
func (f freeTimes) Swap(i, j int)      { f[i], f[j] = f[j], f[i] }
func (f *freeTimes) Push(x any)        { *f = append(*f, x.(freeAt)) }
func (f *freeTimes) Pop() any {
	old := *f
	last := old[len(old)-1]
	*f = old[:len(old)-1]
	return last
}

// take gives t's job to the first worker of p to free up that would
// serve it, once an update under way ends, and returns when that worker
// will have done it. Workers passed over for t keep their places.
func (f *freeTimes) take(p *Pool, t *Ticket, now int64) (float64, bool) {
	q := question{asks: wouldServe, upcoming: p.fleet.target()}
	var passed []freeAt
	defer func() {
		for _, fa := range passed {
			heap.Push(f, fa)
		}
	}()
	for f.Len() > 0 {
		fa := heap.Pop(f).(freeAt)
		if !p.mayTakeLocked(t, fa.w, now, q) {
			passed = append(passed, fa)
			continue
		}
		fa.seconds += t.Cost / p.speedOfLocked(fa.w)
		heap.Push(f, fa)
		return fa.seconds, true
	}
	return 0, false
}
