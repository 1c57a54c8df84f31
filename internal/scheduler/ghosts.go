package scheduler

import "time"

// keepGhostLocked keeps a job whose client left on its worker until the
// worker would have finished it: the GPU goes on computing it, and the
// next job is placed knowing that.
func (p *Pool) keepGhostLocked(t *Ticket) {
	t.ghost = true
	p.ghosts[t] = p.clock.AfterFunc(p.untilGhostEndsLocked(t), func() { p.endGhost(t) })
}

// untilGhostEndsLocked is how long from now t, a job whose client left,
// is predicted to run on: at the speed the pool knows for its worker now,
// as the stall check reckons, not at the one it knew when t started. One
// not yet started runs no later than its worker's last job.
func (p *Pool) untilGhostEndsLocked(t *Ticket) time.Duration {
	w := t.worker
	end := w.load.endsAt
	if t.started > 0 {
		end = t.started + int64(p.timeForLocked(w, t.Cost))
	}
	return max(time.Duration(end-p.now().UnixNano()), 0)
}

// rearmGhostsLocked moves the ends of the jobs whose clients left to what
// the pool knows after a job ended: a speed learned (in a cold pool, the
// first answer turns a guess of minutes into seconds), or a job that
// started. A timer that has fired may fire again; endGhost lets go once.
func (p *Pool) rearmGhostsLocked() {
	for t, timer := range p.ghosts {
		timer.Reset(p.untilGhostEndsLocked(t))
	}
}

// endGhost lets go of a job whose client left, at its predicted end.
func (p *Pool) endGhost(t *Ticket) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.ghosts[t]; ok {
		delete(p.ghosts, t)
		p.releaseLocked(t, End{Worker: Abandoned})
	}
}
