package scheduler

import (
	"container/heap"
	"maps"
	"slices"
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
	v := p.newBacklogView(false)
	p.mu.Lock()
	p.copyBacklogLocked(v)
	p.mu.Unlock()
	return time.Duration(v.playOut(nil) * float64(time.Second))
}

// backlogView is what a backlog plays out, copied under the pool's lock,
// so that the play-out, a step for each waiting job, runs without it:
// with 100,000 jobs waiting, a scrape holds the lock for a copy of their
// places, not for their play-out.
type backlogView struct {
	free    freeTimes // the serving workers, by when they are done with the work they have
	longest float64   // when the last worker is done with the jobs it has, in seconds from now
	jobs    []queuedJob
	lines   []lineView          // the lines, each with its jobs among jobs
	shares  bool                // tenants are on: the queue plays out by their shares
	ends    map[*tenant]float64 // while they are, when each tenant's running jobs end
}

// newBacklogView is a backlogView with room for a copy of the pool as it
// is, made with the lock held but to read how much: with 100,000 jobs
// waiting the copy takes megabytes, which the lock is not to be held to
// clear. It is nil when asked for the tenants' backlogs (ofTenants) while
// no job has named a tenant.
func (p *Pool) newBacklogView(ofTenants bool) *backlogView {
	p.mu.Lock()
	jobs, lines, workers, on := p.queue.n, p.queue.lineCount(), len(p.workers), p.tenancy.on
	p.mu.Unlock()
	if ofTenants && !on {
		return nil // and they stay off: tenants, once on, never turn off
	}
	return &backlogView{free: make(freeTimes, 0, workers), jobs: make([]queuedJob, 0, jobs+jobs/8), lines: make([]lineView, 0, lines+lines/8)}
}

// lineView is a line as a backlog plays it out. Its tenant only names
// the tenant: nothing reads it without the lock.
type lineView struct {
	tenant *tenant
	served float64 // the tenant's counter
	jobs   []queuedJob
	serves []bool // whether each of the view's free workers would serve the line's class, by freeAt.i
}

// copyBacklogLocked copies into v what Backlog plays out: the workers,
// and the waiting jobs with, for each class, the serving workers that
// would serve it once an update under way ends. It returns v.
func (p *Pool) copyBacklogLocked(v *backlogView) *backlogView {
	now := p.now().UnixNano()
	v.shares = p.tenancy.on
	if v.shares {
		v.ends = make(map[*tenant]float64)
	}
	serving := make([]*worker, 0, len(p.workers))
	for _, w := range p.workers {
		speed := p.speedOfLocked(w)
		left := p.workLeftLocked(w, now)/speed + p.switchLeftLocked(w, now) // a switch pending is time too
		v.longest = max(v.longest, left)
		if w.serving(now) {
			v.free = append(v.free, freeAt{i: len(serving), speed: speed, seconds: left})
			serving = append(serving, w)
		}
		if v.shares && len(w.load.jobs) > 0 {
			end := left - (w.load.work-w.load.headCost)/speed // the running job's
			for i, t := range w.load.jobs {
				if i > 0 {
					end += t.Cost / speed
				}
				if t.tenant != nil {
					v.ends[t.tenant] = max(v.ends[t.tenant], end)
				}
			}
		}
	}
	q := question{asks: wouldServe, upcoming: p.fleet.target()}
	for _, c := range p.queue.all {
		serves := make([]bool, len(serving)) // a class's jobs are served by the same workers
		for i, w := range serving {
			serves[i] = p.mayTakeLocked(c.lines[0].head().wt.t, w, now, q)
		}
		for _, l := range c.lines {
			from := len(v.jobs)
			v.jobs = slices.Grow(v.jobs, len(l.places))[:from+len(l.places)]
			jobs := v.jobs[from:len(v.jobs):len(v.jobs)]
			for i := range l.places { // by index, not append: five times faster
				jobs[i] = l.places[i].queuedJob
			}
			lv := lineView{tenant: l.tenant, jobs: jobs, serves: serves}
			if l.tenant != nil {
				lv.served = l.tenant.served
			}
			v.lines = append(v.lines, lv)
		}
	}
	return v
}

// playOut plays v's queue out as Backlog tells, and returns when the last
// worker is done, in seconds from when v was copied; with byTenant, it
// notes there when each tenant's jobs, running and waiting, are done.
func (v *backlogView) playOut(byTenant map[*tenant]float64) float64 {
	if byTenant != nil {
		maps.Copy(byTenant, v.ends)
	}
	longest := v.longest
	heap.Init(&v.free)
	for _, j := range v.order() {
		if end, ok := v.free.take(j.line.serves, j.cost); ok {
			longest = max(longest, end)
			if byTenant != nil && j.line.tenant != nil {
				byTenant[j.line.tenant] = max(byTenant[j.line.tenant], end)
			}
		}
	}
	return longest
}

// backlogJob is a waiting job of a backlogView.
type backlogJob struct {
	*queuedJob
	line *lineView
}

// order is v's waiting jobs in the order the pool would dispatch them,
// were every job servable by the next free worker: compare order, or,
// while tenants are on, the order of their shares.
func (v *backlogView) order() []backlogJob {
	if v.shares {
		return v.sharedOrder()
	}
	var jobs []backlogJob
	for i := range v.lines {
		jobs = v.lines[i].appendJobs(jobs)
	}
	slices.SortFunc(jobs, func(a, b backlogJob) int { return a.compare(b.queuedJob) })
	return jobs
}

// appendJobs appends l's jobs to js.
func (l *lineView) appendJobs(js []backlogJob) []backlogJob {
	for i := range l.jobs {
		js = append(js, backlogJob{&l.jobs[i], l})
	}
	return js
}

// sharedOrder is order while tenants are on: among the tenants' next
// jobs of the highest priority, the tenant with the lowest counter
// first, charged as it goes.
func (v *backlogView) sharedOrder() []backlogJob {
	type share struct {
		jobs   []backlogJob // the tenant's, in compare order
		served float64
		next   int
	}
	shares := make(map[*tenant]*share)
	var active []*share
	n := 0
	for i := range v.lines {
		l := &v.lines[i]
		sh := shares[l.tenant]
		if sh == nil {
			sh = &share{served: l.served}
			shares[l.tenant] = sh
			active = append(active, sh)
		}
		sh.jobs = l.appendJobs(sh.jobs)
		n += len(l.jobs)
	}
	for _, sh := range active {
		slices.SortFunc(sh.jobs, func(a, b backlogJob) int { return a.compare(b.queuedJob) })
	}
	out := make([]backlogJob, 0, n)
	for len(active) > 0 {
		best := 0
		for i := 1; i < len(active); i++ {
			a, b := active[i].jobs[active[i].next], active[best].jobs[active[best].next]
			if a.priority > b.priority || a.priority == b.priority &&
				(active[i].served < active[best].served || active[i].served == active[best].served && a.seq < b.seq) {
				best = i
			}
		}
		sh := active[best]
		j := sh.jobs[sh.next]
		sh.next++
		sh.served += j.charge
		out = append(out, j)
		if sh.next == len(sh.jobs) {
			active[best] = active[len(active)-1]
			active = active[:len(active)-1]
		}
	}
	return out
}

// freeAt is when a worker of a backlogView, the i'th serving one, is done
// with the work it has been given so far, in seconds from now.
type freeAt struct {
	i       int
	speed   float64
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

// take gives a job of cost to the first worker to free up that serves
// says would serve it, and returns when that worker will have done it.
// Workers passed over for it keep their places.
func (f *freeTimes) take(serves []bool, cost float64) (float64, bool) {
	var passed []freeAt
	defer func() {
		for _, fa := range passed {
			heap.Push(f, fa)
		}
	}()
	for f.Len() > 0 {
		fa := heap.Pop(f).(freeAt)
		if !serves[fa.i] {
			passed = append(passed, fa)
			continue
		}
		fa.seconds += cost / fa.speed
		heap.Push(f, fa)
		return fa.seconds, true
	}
	return 0, false
}
