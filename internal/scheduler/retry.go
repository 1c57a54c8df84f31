package scheduler

import (
	"context"
	"slices"
)

// Retry moves t off a worker that failed it, which its attempt ended as
// e says, onto another one, waiting for it in its old place in the queue:
// the worker it leaves goes to the queue only once t is back in it. A job
// whose worker stalled on it (RerunStalled) never goes back to that
// worker, and when no other serving worker may serve it, it leaves its
// worker and gets ErrNoOtherWorker rather than wait. Retry reports an
// error when t got no worker.
func (p *Pool) Retry(ctx context.Context, t *Ticket, e End) error {
	p.mu.Lock()
	stalled := e.Rerun == RerunStalled
	if stalled {
		p.shunLocked(t)
	}
	p.offWorkerLocked(t, e)
	switch {
	case p.untriedServingLocked(t):
	case stalled:
		p.dispatchLocked()
		p.mu.Unlock()
		return ErrNoOtherWorker
	default:
		p.forgetTriedLocked(t)
	}
	return p.retryLocked(ctx, t)
}

// shunLocked keeps t off the worker that stalled on it for good: the one
// holding it or, once the answer's start freed that worker's slot, the
// one that served it last.
func (p *Pool) shunLocked(t *Ticket) {
	w := t.worker
	if w == nil {
		if w = p.findLocked(t.servedBy); w == nil {
			return // it left the pool
		}
		if !slices.Contains(t.tried, w) {
			t.tried = append(t.tried, w)
		}
	}
	t.shunned = append(t.shunned, w)
}

// forgetTriedLocked lets t go back to the workers it tried: better a
// worker that failed once than waiting for ones that are out, which may
// stay out for minutes. The one that failed it last stays off while
// another serving worker may serve t: a worker that breaks its answers at
// once is the least loaded, and would take t straight back.
func (p *Pool) forgetTriedLocked(t *Ticket) {
	var last *worker
	if n := len(t.tried); n > 0 {
		last = t.tried[n-1]
	}
	t.tried = append(t.tried[:0], t.shunned...)
	if last == nil || slices.Contains(t.tried, last) {
		return
	}
	t.tried = append(t.tried, last)
	if !p.untriedServingLocked(t) {
		t.tried = t.tried[:len(t.tried)-1]
	}
}

// retryLocked puts t back in the queue in its old place and waits for
// its next worker; it unlocks p.mu.
func (p *Pool) retryLocked(ctx context.Context, t *Ticket) error {
	t.again = true
	wt, err := p.admitLocked(t)
	p.dispatchLocked()
	p.mu.Unlock()
	if wt == nil {
		return err
	}
	return p.wait(ctx, t, wt)
}

// offWorkerLocked frees the worker holding t, if one does, and keeps t off it.
func (p *Pool) offWorkerLocked(t *Ticket, e End) {
	if w := t.worker; w != nil {
		t.tried = append(t.tried, w)
		p.freeLocked(t, e)
	}
}

// untriedServingLocked reports whether a serving worker that t has not
// been sent to may serve it.
func (p *Pool) untriedServingLocked(t *Ticket) bool {
	now := p.now().UnixNano()
	return slices.ContainsFunc(p.workers, func(w *worker) bool {
		return p.mayTakeLocked(t, w, now, question{asks: wouldServe})
	})
}
