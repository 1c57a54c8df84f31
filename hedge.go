package diffusionrouter

import (
	"bytes"
	"context"
	"io"
	"maps"
	"net/http"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.opentelemetry.io/otel/attribute"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// A job still unanswered after hedge_after times its predicted time (and
// at least health_timeout), while
// a worker that may serve it is idle and no job waits, gets a second copy
// on that worker. The first answer the client may get wins; the other copy
// is cancelled. A copy that fails is followed by another, on another idle
// worker, while max_attempts leaves room: the attempt it was to overtake
// may hang for good. A hung worker whose /health still answers then costs a
// step one job's time, not the client's timeout, from the router's start:
// its first job, predicted at the speed assumed before anything was
// learned, is predicted anew once other workers complete theirs.

// hedge is one job's race between its attempt and, once launched, a copy.
// Its mutex orders the claims of the two answers, so exactly one reaches
// the client.
type hedge struct {
	h     *Handler
	rec   *recorder // the client's
	r     *http.Request
	next  caddyhttp.Handler
	vars  map[string]any // a copy of the request's variables, for the copy's reverse_proxy
	timer *time.Timer
	start time.Time // when the attempt began

	mu         sync.Mutex // taken before the pool's lock, never after (see pool)
	primary    *scheduler.Ticket
	copy       *scheduler.Ticket  // the copy launched last
	cancelPrim context.CancelFunc // ends the primary attempt
	cancelCopy context.CancelFunc
	winner     *scheduler.Ticket
	ended      bool          // the attempt is over: no copy may start
	copies     int           // copies launched, one at a time
	budget     int           // copies the job's max_attempts leave room for
	copyEnded  chan struct{} // closed when the last copy's attempt is over
	copyRec    *recorder
	copyPanic  any // an answer of the copy that broke off, to abort the client's with
}

// hedges reports whether t's attempt may get a copy: a job whose answer
// comes when it is done, as the endpoint table says (not a stream, not a
// video job answered at once), with room left in its budget of
// max_attempts GPU jobs for both the attempt and a copy. One client
// request never costs the fleet more, however its jobs overrun and fail.
func (h *Handler) hedges(t *scheduler.Ticket) bool {
	return t.Config().HedgeAfter > 0 && t.Job && t.Route.Hedged && t.Attempts+2 <= t.Config().MaxAttempts
}

// sendHedged is send with a copy of the job launched on an idle worker if
// the attempt overruns. judge is the attempt's own rule for answers (nil:
// every answer is the client's), rerun whether the job may run again
// after it.
func (h *Handler) sendHedged(rec *recorder, r *http.Request, t *scheduler.Ticket, next caddyhttp.Handler, judge func(int) verdict, rerun bool) error {
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	vars, _ := r.Context().Value(caddyhttp.VarsCtxKey).(map[string]any)
	hd := &hedge{h: h, rec: rec, r: r, next: next, vars: maps.Clone(vars), start: time.Now(), primary: t, cancelPrim: cancel,
		budget: t.Config().MaxAttempts - t.Attempts - 1}
	rec.hold(judge, rerun).claim = func() bool { return hd.claim(t) }
	hd.mu.Lock()
	hd.timer = time.AfterFunc(hd.wait(), hd.fire)
	hd.mu.Unlock()

	err := h.send(rec, r, ctx, t, next, hd)

	hd.mu.Lock()
	hd.ended = true
	hd.timer.Stop()
	copyEnded, copies := hd.copyEnded, hd.copies
	hd.mu.Unlock()
	if copyEnded == nil {
		return err
	}
	t.Attempts += copies // they ran on GPUs too
	<-copyEnded          // the last one's answer may be the client's, being written now
	if hd.copyPanic != nil {
		panic(hd.copyPanic)
	}
	traceEvent(r.Context(), rec.tracer, "diffusion_router.hedge", attribute.String("diffusion.copy_on", hd.copy.ServedBy()),
		attribute.Bool("diffusion.copy_won", hd.winner == hd.copy))
	switch hd.winner {
	case hd.copy:
		h.metrics.hedges.WithLabelValues("won").Inc()
		rec.dropHeld()
		rec.status = hd.copyRec.status
		t.AnsweredBy(hd.copy)
		return nil
	case t:
		h.metrics.hedges.WithLabelValues("cancelled").Inc()
	}
	return err
}

// wait is how long the primary attempt still runs before a copy is
// considered: until it has run hedge_after times its predicted time until
// its worker finishes it, and at least the probe timeout, as for the stall
// rule (a job of milliseconds that runs slow on a busy machine is late,
// not hung). The prediction is the pool's of now and may shrink meanwhile:
// the first jobs completed anywhere set the speed of a worker that has
// completed none. So the attempt looks again at least every probe
// timeout, the earliest a copy can ever be due.
func (hd *hedge) wait() time.Duration {
	t := hd.primary
	floor := t.Config().Health.Timeout
	due := max(time.Duration(float64(t.Due())*t.Config().HedgeAfter), floor)
	return min(due-time.Since(hd.start), floor)
}

// claim makes t's answer the client's unless the other copy's already
// is, and cancels the other copy.
func (hd *hedge) claim(t *scheduler.Ticket) bool {
	hd.mu.Lock()
	defer hd.mu.Unlock()
	if hd.winner != nil {
		return hd.winner == t
	}
	hd.winner = t
	if t == hd.primary {
		if hd.cancelCopy != nil {
			hd.cancelCopy()
		}
	} else {
		hd.cancelPrim()
	}
	return true
}

// outcome is what t's attempt says of its worker: a copy that lost the
// race says nothing (its worker may still be computing it); an attempt the
// copy overtook overran its prediction many times over.
func (hd *hedge) outcome(t *scheduler.Ticket, o scheduler.Outcome) scheduler.Outcome {
	hd.mu.Lock()
	defer hd.mu.Unlock()
	switch {
	case hd.winner == nil || hd.winner == t:
		return o
	case t == hd.primary:
		return scheduler.Overtaken
	}
	return scheduler.Abandoned
}

// fire launches the copy once the attempt is overdue, if the pool has an
// idle worker for it then, and otherwise looks again after a while.
func (hd *hedge) fire() {
	hd.mu.Lock()
	defer hd.mu.Unlock()
	if hd.ended || hd.winner != nil {
		return
	}
	if wait := hd.wait(); wait > 0 {
		hd.timer.Reset(wait)
		return
	}
	c := hd.h.pool.HedgeCopy(hd.primary)
	if c == nil {
		hd.timer.Reset(min(max(hd.primary.Predicted()/4, 10*time.Millisecond), time.Second))
		return
	}
	ctx, cancel := context.WithCancel(context.WithValue(hd.r.Context(), caddyhttp.VarsCtxKey, hd.vars))
	hd.copy, hd.cancelCopy = c, cancel
	hd.copies++
	hd.copyEnded = make(chan struct{})
	hd.h.metrics.hedges.WithLabelValues("launched").Inc()
	go hd.runCopy(ctx, c, hd.copyEnded)
}

// runCopy sends the copy c of the job to its worker and closes ended when
// it is over. Its answer reaches the client only if it wins the race. A
// copy that failed while the attempt still runs makes way for another, on
// another worker, while the budget lasts.
func (hd *hedge) runCopy(ctx context.Context, c *scheduler.Ticket, ended chan struct{}) {
	rec := &recorder{ResponseWriterWrapper: hd.rec.ResponseWriterWrapper, tracer: hd.rec.tracer}
	defer func() {
		v := recover() // an answer that broke off after it began
		hd.mu.Lock()
		hd.copyRec, hd.copyPanic = rec, v
		hd.cancelCopy()
		if hd.winner == nil && hd.r.Context().Err() == nil { // it failed
			hd.h.pool.Avoid(hd.primary, c.ServedBy())
			if !hd.ended && hd.copies < hd.budget {
				hd.timer.Reset(0)
			}
		}
		hd.mu.Unlock()
		hd.h.pool.EndHedge()
		close(ended)
	}()
	// A copy's failure is no answer, and never runs the job again: the
	// attempt goes on.
	judge := hd.h.judge(c)
	rec.hold(func(status int) verdict {
		if judge(status) != pass {
			return lost
		}
		return pass
	}, false).claim = func() bool { return hd.claim(c) }
	r := *hd.r // reverse_proxy copies what it changes of a request
	r.Body = io.NopCloser(bytes.NewReader(c.Body))
	hd.h.send(rec, &r, ctx, c, hd.next, hd)
}
