package scheduler

// Among waiting jobs a higher priority goes first, whatever the queue
// order says, and a running job is never preempted. So that a stream of
// urgent jobs cannot keep a lower priority waiting for ever, a job passed
// over for MaxPassedOver (it waited that long while the queue's head was
// of a higher priority) goes to the next worker that frees up and may
// serve it, ahead of every priority. Such jobs go in the order they came.

// arriveLocked notes that wt joined the queue. Jobs that left are taken
// off the front as they are met, and all at once when they are most of
// the list, so it stays within twice the queue.
func (d *dispatchState) arriveLocked(wt *waiter) {
	d.arrivals = append(dropGone(d.arrivals, d.queue.n), wt)
}

// dispatchPassedOverLocked hands free workers to the jobs passed over for
// too long, in the order they came, before the queue's order has its turn.
func (p *Pool) dispatchPassedOverLocked() {
	for len(p.arrivals) > 0 && p.arrivals[0].gone {
		p.arrivals[0] = nil
		p.arrivals = p.arrivals[1:]
	}
	if p.queue.n == 0 || p.queue.bottom() == p.queue.top() {
		return // every waiting job is of the head's priority: none is passed over
	}
	now := p.now().UnixNano()
	blocked := 0 // classes found blocked in this pass
	for _, wt := range p.arrivals {
		if p.queue.n == 0 || !waitedTooLong(wt, now) {
			return // the ones after it came later
		}
		if wt.gone || wt.t.Priority >= p.queue.top() || wt.line.class.blocked == p.queue.pass {
			continue
		}
		w, anyFree := p.chooseLocked(wt.t)
		switch {
		case !anyFree:
			return
		case w == nil:
			// The rest of its class breaks the same constraints: the pass
			// asks about none of them again, here or in the queue's turn.
			wt.line.class.blocked = p.queue.pass
			if blocked++; blocked == len(p.queue.all) {
				return // no waiting job may have a free worker
			}
		default:
			p.dequeueLocked(wt)
			p.handOutLocked(wt, w)
		}
	}
}

// waitedTooLong reports whether wt has waited as long as a job may be
// passed over.
func waitedTooLong(wt *waiter, now int64) bool {
	limit := wt.t.cfg.MaxPassedOver
	return limit > 0 && now-wt.since >= int64(limit)
}
