package scheduler

import "time"

// chooseLocked picks the worker for t by its strategy among the workers that
// may serve it and have a free slot. It also reports whether any serving
// worker had a free slot at all, so a dispatch pass can stop early.
func (p *Pool) chooseLocked(t *Ticket) (*worker, bool) { return p.chooseAmongLocked(t, p.workers) }

// chooseAmongLocked is chooseLocked among workers, which holds every
// worker of the pool that has a slot free for t.
func (p *Pool) chooseAmongLocked(t *Ticket, workers []*worker) (*worker, bool) {
	now := p.now().UnixNano()
	if t.Pin != "" {
		return p.choosePinnedLocked(t, now)
	}
	if p.fleet.holding && t.Job {
		return nil, false
	}
	cands, views := p.cands[:0], p.views[:0]
	anyFree, stale := false, false
	job, limit := t.Job, t.cfg.MaxInflight
	for _, w := range workers { // the hot loop
		// The chain's first constraint, inline: on a busy fleet it turns
		// most workers away, and calling the chain for each of them made
		// the decision half as slow again. The chain checks it again.
		if !fits(job, limit, w, now) {
			continue
		}
		broken := p.brokenLocked(t, w, now, question{asks: takesNow})
		// The chain checks serving right after the slot: any other
		// answer is from a free worker.
		anyFree = anyFree || broken != isServing
		stale = stale || broken == freshEnough
		if broken == 0 {
			cands = append(cands, w)
			views = append(views, p.viewLocked(w, now))
		}
	}
	p.cands, p.views = cands, views
	if len(cands) == 0 {
		if stale {
			p.noteHeldLocked(t)
		}
		return nil, anyFree
	}
	return cands[t.cfg.Strategy.Pick(Job{Cost: t.Cost, Seq: t.seq}, views)], true
}

// choosePinnedLocked is chooseLocked for t pinned to a worker: it goes
// there or nowhere. Whether that worker has a free slot is asked only of
// a job that may go to it. It looks at no other worker, so it cannot say
// that none is free: a dispatch pass goes on past a job pinned to a busy
// worker.
func (p *Pool) choosePinnedLocked(t *Ticket, now int64) (*worker, bool) {
	w := p.findLocked(t.Pin)
	switch {
	case w == nil || !p.mayTakeLocked(t, w, now, question{asks: mayServe}):
		return nil, true
	case !t.Job: // a poll or delete of a job the worker holds goes there, whatever its health
		return w, true
	}
	if p.brokenLocked(t, w, now, question{asks: takesNow}) != 0 {
		return nil, true
	}
	return w, true
}

// viewLocked is w as a strategy sees it at now (Unix nanoseconds).
func (d *dispatchState) viewLocked(w *worker, now int64) Candidate {
	return Candidate{URL: w.url, Inflight: w.load.inflight, WorkLeft: d.workLeftLocked(w, now), Speed: d.speedOfLocked(w)}
}

// prefetchWindow: a worker whose jobs are predicted to end within it gets
// its next job already, beyond max_inflight, so that the round trip of
// handing it over does not leave the worker idle. Against jobs of seconds
// that is one job more, at the end of the last, and the wait it can add
// behind a job is negligible; jobs that take almost no time go on to their
// workers, up to maxPrefetch beyond max_inflight, instead of each waiting
// in the queue for the one before it.
const (
	prefetchWindow = 5 * time.Millisecond
	maxPrefetch    = 8
)

// fits reports whether w has a slot at now for a request (a job, or not)
// under a limit of jobs per worker (0: none); only jobs take slots. A
// worker whose jobs are overdue by more than the window may be stalled: it
// is given one job beyond the limit at most.
//
// A full worker's load is read first: a scan of a busy fleet then reads
// of most workers that alone.
func fits(job bool, limit int, w *worker, now int64) bool {
	if !job {
		return true
	}
	n := w.load.inflight
	if limit == 0 || n < limit {
		return n == 0 || !w.health.probation
	}
	left := w.load.endsAt - now
	switch {
	case left < -int64(prefetchWindow):
		return n == limit && !w.health.probation
	case left < int64(prefetchWindow):
		return n < limit+maxPrefetch && !w.health.probation
	}
	return false
}

// updateEndsLocked predicts when w's jobs will be done, from when the
// running one started: what fits checks for every full worker.
func (d *dispatchState) updateEndsLocked(w *worker) {
	w.load.endsAt = w.load.headSince + int64(d.timeForLocked(w, w.load.work))
}

// openLocked is the workers that had a slot free for jobs under a limit
// of limit jobs per worker when they were first asked for in this pass:
// no worker frees up during a pass, so its jobs need look at no other.
// The pass reads the workers once, not once for each job it asks about.
// A worker whose adapter is not ready (switching, unknown, or a call to it
// under way) takes no job, and placement can keep hundreds of them so for
// seconds: they are left out, and held reports whether one of them is
// serving with a slot free, which counts as a free worker (see nextLocked).
func (p *Pool) openLocked(limit int) (open []*worker, held bool) {
	if p.openFor != (openFor{p.queue.pass, limit}) {
		now := p.now().UnixNano()
		open, held = p.open[:0], false
		placing := p.placement.on
		for _, w := range p.workers {
			switch {
			case !fits(true, limit, w, now):
			case !placing || w.adapter.ready():
				open = append(open, w)
			default:
				held = held || w.serving(now)
			}
		}
		p.open, p.openHeld, p.openFor = open, held, openFor{p.queue.pass, limit}
	}
	return p.open, p.openHeld
}
