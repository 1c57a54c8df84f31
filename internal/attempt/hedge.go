package attempt

import (
	"bytes"
	"context"
	"io"
	"maps"
	"net/http"
	"slices"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// A job still unanswered after hedge_after times its predicted time (and
// at least health_timeout), while
// a worker that may serve it is idle and no job waits, gets a second copy
// on that worker. The first answer the client may get wins; the others
// are cancelled. A hung worker whose /health still answers then costs a
// step one job's time, not the client's timeout, from the router's start:
// its first job, predicted at the speed assumed before anything was
// learned, is predicted anew once other workers complete theirs.
//
// Any worker may hang, the copy's too: the race goes on while
// max_attempts leaves room. A copy that overruns in turn gets a copy of
// its own, and one that fails is followed by another on a worker that has
// not failed the job. An attempt that fails while copies run frees its
// worker at once and leaves the race to them.

// race is one job's race between its attempt and the copies launched
// when the last one overran. Its mutex orders the claims of the answers,
// so exactly one reaches the client.
type race struct {
	run   *Runner
	rec   *Recorder // the client's
	r     *http.Request
	next  Next
	vars  map[string]any // a copy of the request's variables as the race began, cloned for each copy
	timer Timer

	mu      sync.Mutex // taken before the pool's lock, never after (see pool)
	primary *scheduler.Ticket
	// last is the attempt or copy launched last, since lastSince: the one
	// whose overrun launches the next copy.
	last      *scheduler.Ticket
	lastSince time.Time
	live      []liveAttempt // the attempt and each copy still running
	liveBuf   [2]liveAttempt
	winner    *scheduler.Ticket
	ended     bool      // the race is over: no copy may start
	copies    int       // copies launched
	budget    int       // copies the job's max_attempts leave room for
	running   int       // copies not yet over
	copyOver  sync.Cond // on mu: signalled as each copy ends
	copyRec   *Recorder // the winning copy's
	copyPanic any       // an answer of a copy that broke off, to abort the client's with
}

// hedges reports whether t's attempt may get a copy: a job whose answer
// comes when it is done, as the endpoint table says (not a stream, not a
// video job answered at once), with room left in its budget of
// max_attempts GPU jobs for both the attempt and a copy. One client
// request never costs the fleet more, however its jobs overrun and fail.
func (run *Runner) hedges(t *scheduler.Ticket) bool {
	return t.Config().HedgeAfter > 0 && t.Job && t.Route.Hedged && t.Attempts+2 <= t.Config().MaxAttempts
}

// sendHedged is send with copies of the job launched on idle workers
// while the attempt, and then each copy, overruns. j is the attempt's
// own rule for answers, rerun whether
// the job may run again after it.
func (run *Runner) sendHedged(rec *Recorder, r *http.Request, t *scheduler.Ticket, next Next, j judge, rerun bool) error {
	hd := &race{run: run, rec: rec, r: r, next: next, vars: maps.Clone(run.Proxy.Vars(r.Context())), primary: t, last: t,
		lastSince: run.clock().Now(), budget: t.Config().MaxAttempts - t.Attempts - 1}
	// Every job that may be hedged sets a race up: none of it is
	// allocated apart from the race until a copy is launched.
	hd.live = append(hd.liveBuf[:0], liveAttempt{t: t})
	hd.copyOver.L = &hd.mu
	hd.enter(rec.hold(j, rerun), t)
	hd.mu.Lock()
	hd.timer = run.clock().AfterFunc(hd.wait(), hd.fire)
	hd.mu.Unlock()

	err := run.send(rec, r, r.Context(), t, next, hd)

	copies := hd.finish(rec, t)
	if copies == 0 {
		return err
	}
	t.Attempts += copies // they ran on GPUs too
	if hd.copyPanic != nil {
		panic(hd.copyPanic)
	}
	copyOn := hd.last // the copy launched last, unless another won
	if hd.winner != nil && hd.winner != t {
		copyOn = hd.winner
	}
	event(r.Context(), rec.Tracer, "diffusion_router.hedge", attribute.String("diffusion.copy_on", copyOn.ServedBy()),
		attribute.Bool("diffusion.copy_won", copyOn == hd.winner), attribute.Int("diffusion.copies", copies))
	switch hd.winner {
	case nil:
		return err
	case t:
		run.Metrics.Hedges.WithLabelValues("cancelled").Inc()
		return err
	}
	run.Metrics.Hedges.WithLabelValues("won").Inc()
	rec.dropHeld()
	rec.status = hd.copyRec.status
	t.AnsweredBy(hd.winner)
	return nil
}

// finish waits, once the attempt is over, until no copy runs, the race
// going on meanwhile if none has won (see the top of this file), and
// returns the number of copies launched. An attempt that failed in a way
// the job may run again after kept its worker for that re-run to free
// (see send); once copies ran, frees it now: the copies may answer, or
// use up max_attempts, and then no re-run comes.
func (hd *race) finish(rec *Recorder, t *scheduler.Ticket) int {
	hd.mu.Lock()
	defer hd.mu.Unlock()
	hd.endAttempt(t)
	if hd.copies > 0 && hd.winner != t && rec.slot.kept {
		hd.run.Pool.Leave(t, rec.slot.keptAs)
		rec.slot.kept = false // free now; a re-run that follows gets a worker of its own
	}
	for hd.running > 0 {
		hd.copyOver.Wait()
	}
	hd.ended = true
	hd.timer.Stop()
	return hd.copies
}

// wait is how long the attempt or copy launched last still runs before
// the next copy is considered: until it has run hedge_after times its
// predicted time until its worker finishes it, and at least the probe
// timeout, as for the stall rule (a job of milliseconds that runs slow on
// a busy machine is late, not hung). The prediction is the pool's of now
// and may shrink meanwhile: the first jobs completed anywhere set the
// speed of a worker that has completed none. So the race looks again at
// least every probe timeout, the earliest a copy can ever be due.
func (hd *race) wait() time.Duration {
	t := hd.last
	floor := t.Config().Health.Timeout
	due := max(time.Duration(float64(t.Due())*t.Config().HedgeAfter), floor)
	return min(due-hd.run.clock().Now().Sub(hd.lastSince), floor)
}

// enter enters a, the answer held for t's attempt, in the race.
func (hd *race) enter(a *heldAnswer, t *scheduler.Ticket) {
	a.race, a.racer = hd, t
}

// claim makes t's answer the client's unless another's already is, and
// cancels the others.
func (hd *race) claim(t *scheduler.Ticket) bool {
	hd.mu.Lock()
	defer hd.mu.Unlock()
	if hd.winner != nil {
		return hd.winner == t
	}
	hd.winner = t
	for _, other := range hd.live {
		if other.t != t {
			other.stop()
		}
	}
	return true
}

// liveAttempt is the attempt or a copy of a hedged job while it runs,
// with what ends a copy. The attempt runs in its job's context, which
// goes on after it, and which Overtake ends.
type liveAttempt struct {
	t      *scheduler.Ticket
	cancel context.CancelFunc // nil for the attempt
}

// stop ends a, whose job another attempt or copy answered.
func (a liveAttempt) stop() {
	if a.cancel == nil {
		a.t.Overtake()
		return
	}
	a.cancel()
}

// endAttempt forgets t, which runs no more, and ends its context if it
// is a copy's.
func (hd *race) endAttempt(t *scheduler.Ticket) {
	hd.live = slices.DeleteFunc(hd.live, func(a liveAttempt) bool {
		if a.t == t && a.cancel != nil {
			a.cancel()
		}
		return a.t == t
	})
}

// outcome is what t's attempt says of its worker: a copy that lost the
// race says nothing (its worker may still be computing it); an attempt a
// copy overtook overran its prediction many times over.
func (hd *race) outcome(t *scheduler.Ticket, o scheduler.Outcome) scheduler.Outcome {
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

// fire launches a copy once the attempt or copy launched last is overdue,
// if the budget has room and the pool has an idle worker for it then, and
// otherwise looks again after a while.
func (hd *race) fire() {
	hd.mu.Lock()
	defer hd.mu.Unlock()
	if hd.ended || hd.winner != nil || hd.copies >= hd.budget {
		return
	}
	if wait := hd.wait(); wait > 0 {
		hd.timer.Reset(wait)
		return
	}
	c := hd.run.Pool.HedgeCopy(hd.primary)
	if c == nil {
		hd.timer.Reset(min(max(hd.primary.Predicted()/4, 10*time.Millisecond), time.Second))
		return
	}
	ctx, cancel := hd.primary.CopyContext()
	ctx = hd.run.Proxy.WithVars(ctx, maps.Clone(hd.vars))
	hd.live = append(hd.live, liveAttempt{c, cancel})
	hd.last, hd.lastSince = c, hd.run.clock().Now()
	hd.copies++
	hd.running++
	hd.run.Metrics.Hedges.WithLabelValues("launched").Inc()
	go hd.runCopy(ctx, c)
	hd.timer.Reset(hd.wait())
}

// runCopy sends the copy c of the job to its worker. Its answer reaches
// the client only if it wins the race. A copy that failed makes way for
// another, on another worker, while the budget lasts.
func (hd *race) runCopy(ctx context.Context, c *scheduler.Ticket) {
	rec := &Recorder{ResponseWriter: hd.rec.ResponseWriter, Tracer: hd.rec.Tracer}
	defer func() {
		v := recover() // an answer that broke off after it began
		hd.mu.Lock()
		if hd.winner == c || v != nil {
			hd.copyRec, hd.copyPanic = rec, v
		}
		hd.endAttempt(c)
		if hd.winner == nil && hd.r.Context().Err() == nil { // it failed
			hd.run.Pool.Avoid(hd.primary, c.ServedBy())
			if hd.copies < hd.budget {
				hd.timer.Reset(0)
			}
		}
		hd.running--
		hd.copyOver.Broadcast()
		hd.mu.Unlock()
		hd.run.Pool.EndHedge()
	}()
	// A copy's failure is no answer, and never runs the job again: the
	// attempt goes on.
	hd.enter(rec.hold(judge{run: hd.run, t: c, copy: true}, false), c)
	r := hd.r.WithContext(ctx) // reverse_proxy copies what it changes of a request
	r.Body = io.NopCloser(bytes.NewReader(c.Body))
	hd.run.send(rec, r, ctx, c, hd.next, hd)
}
