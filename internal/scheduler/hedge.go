package scheduler

import "slices"

// HedgeCopy gives a copy of t to the fastest idle worker that may serve
// it, or reports nil when t should not get one now: jobs wait, a drain is
// on, or copies
// already run on a tenth of the workers (at least two). t's own attempt
// may be over: it failed while copies of it still run.
func (p *Pool) HedgeCopy(t *Ticket) *Ticket {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.queue.n > 0 || p.fleet.holding || p.hedging >= max(2, len(p.workers)/10) {
		return nil
	}
	now := p.now().UnixNano()
	var idle *worker
	for _, w := range p.workers {
		if w != t.worker && w.load.inflight == 0 && p.mayTakeLocked(t, w, now, question{asks: takesNow}) &&
			(idle == nil || p.speedOfLocked(w) > p.speedOfLocked(idle)) {
			idle = w
		}
	}
	if idle == nil {
		return nil
	}
	c := &Ticket{Request: t.Request, pool: p, cfg: t.cfg, claim: claim{seq: t.seq, key: t.key, arrived: t.arrived, tenant: t.tenant, policy: t.policy}}
	p.assignLocked(c, idle)
	p.hedging++
	return c
}

// EndHedge notes that a copy's attempt is over.
func (p *Pool) EndHedge() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.hedging--
}

// Avoid keeps t's job off the worker at workerURL while another may serve
// it: a copy of it failed there.
func (p *Pool) Avoid(t *Ticket, workerURL string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if w := p.findLocked(workerURL); w != nil && !slices.Contains(t.tried, w) {
		t.tried = append(t.tried, w)
	}
}
