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

	"github.com/miles-rollout/miles-diffusion-router/internal/clock"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/spans"
)

// A job still unanswered after hedge_after times its predicted time (and
// at least health_timeout), while a worker that may serve it is idle and
// no job waits, gets a second copy on that worker. The first answer the client may get wins; the others
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
	timer clock.Timer

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
func (run *Runner) hedges(rec *Recorder, t *scheduler.Ticket) bool {
	return t.Config().HedgeAfter > 0 && t.Job && t.Route.Hedged && rec.tries.attempts+2 <= t.Config().MaxAttempts
}

// sendHedged is send with copies of the job launched on idle workers
// while the attempt, and then each copy, overruns. j is the attempt's
// own rule for answers, rerun whether the job may run again after it.
func (run *Runner) sendHedged(rec *Recorder, r *http.Request, t *scheduler.Ticket, next Next, j judge, rerun bool) error {
	rc := &race{run: run, rec: rec, r: r, next: next, vars: maps.Clone(run.Proxy.Vars(r.Context())), primary: t, last: t,
		lastSince: run.clock().Now(), budget: t.Config().MaxAttempts - rec.tries.attempts - 1}
	// Every job that may be hedged sets a race up: none of it is
	// allocated apart from the race until a copy is launched.
	rc.live = append(rc.liveBuf[:0], liveAttempt{t: t})
	rc.copyOver.L = &rc.mu
	rc.enter(rec.hold(j, rerun), t)
	rc.mu.Lock()
	rc.timer = run.clock().AfterFunc(rc.wait(), rc.fire)
	rc.mu.Unlock()

	err := run.send(rec, r, r.Context(), t, next, rc)

	copies := rc.finish(rec, t)
	if copies == 0 {
		return err
	}
	rec.tries.attempts += copies // they ran on GPUs too
	if rc.copyPanic != nil {
		panic(rc.copyPanic)
	}
	copyOn := rc.last // the copy launched last, unless another won
	if rc.winner != nil && rc.winner != t {
		copyOn = rc.winner
	}
	spans.Event(r.Context(), rec.Tracer, "diffusion_router.hedge", attribute.String("diffusion.copy_on", copyOn.ServedBy()),
		attribute.Bool("diffusion.copy_won", copyOn == rc.winner), attribute.Int("diffusion.copies", copies))
	switch rc.winner {
	case nil:
		return err
	case t:
		run.Metrics.Hedges.WithLabelValues("cancelled").Inc()
		return err
	}
	run.Metrics.Hedges.WithLabelValues("won").Inc()
	rec.dropHeld()
	rec.status = rc.copyRec.status
	t.AnsweredBy(rc.winner)
	return nil
}

// finish waits, once the attempt is over, until no copy runs, the race
// going on meanwhile if none has won (see the top of this file), and
// returns the number of copies launched. An attempt that failed in a way
// the job may run again after kept its worker for that re-run to free
// (see send); once copies ran, frees it now: the copies may answer, or
// use up max_attempts, and then no re-run comes.
func (rc *race) finish(rec *Recorder, t *scheduler.Ticket) int {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	rc.endAttempt(t)
	if rc.copies > 0 && rc.winner != t && rec.slot.kept {
		rc.run.Pool.Release(t, rec.slot.end)
		rec.slot.kept = false // free now; a re-run that follows gets a worker of its own
	}
	if rc.running > 0 && rc.run.AwaitCopies != nil {
		defer rc.run.AwaitCopies(t)()
	}
	for rc.running > 0 {
		rc.copyOver.Wait()
	}
	rc.ended = true
	rc.timer.Stop()
	return rc.copies
}

// wait is how long the attempt or copy launched last still runs before
// the next copy is considered: until it has run hedge_after times its
// predicted time until its worker finishes it, and at least the probe
// timeout, as for the stall rule (a job of milliseconds that runs slow on
// a busy machine is late, not hung). The prediction is the pool's of now
// and may shrink meanwhile: the first jobs completed anywhere set the
// speed of a worker that has completed none. So the race looks again at
// least every probe timeout, the earliest a copy can ever be due.
func (rc *race) wait() time.Duration {
	t := rc.last
	floor := t.Config().Health.Timeout
	due := max(time.Duration(float64(t.Due())*t.Config().HedgeAfter), floor)
	return min(due-rc.run.clock().Now().Sub(rc.lastSince), floor)
}

// enter enters a, the answer held for t's attempt, in the race.
func (rc *race) enter(a *heldAnswer, t *scheduler.Ticket) {
	a.race, a.racer = rc, t
}

// claim makes t's answer the client's unless another's already is, and
// cancels the others.
func (rc *race) claim(t *scheduler.Ticket) bool {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	if rc.winner != nil {
		return rc.winner == t
	}
	rc.winner = t
	for _, other := range rc.live {
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
func (rc *race) endAttempt(t *scheduler.Ticket) {
	rc.live = slices.DeleteFunc(rc.live, func(a liveAttempt) bool {
		if a.t == t && a.cancel != nil {
			a.cancel()
		}
		return a.t == t
	})
}

// evidence is what t's attempt, which ended telling ev of its worker,
// tells of it in the race: a copy that lost the race tells nothing (its
// worker may still be computing it); an attempt a copy overtook overran
// its prediction many times over.
func (rc *race) evidence(t *scheduler.Ticket, ev scheduler.Evidence) scheduler.Evidence {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	switch {
	case rc.winner == nil || rc.winner == t:
		return ev
	case t == rc.primary:
		return scheduler.Overtaken
	}
	return scheduler.Abandoned
}

// fire launches a copy once the attempt or copy launched last is overdue,
// if the budget has room and the pool has an idle worker for it then, and
// otherwise looks again after a while.
func (rc *race) fire() {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	if rc.ended || rc.winner != nil || rc.copies >= rc.budget {
		return
	}
	if wait := rc.wait(); wait > 0 {
		rc.timer.Reset(wait)
		return
	}
	c := rc.run.Pool.HedgeCopy(rc.primary)
	if c == nil {
		rc.timer.Reset(min(max(rc.primary.Predicted()/4, 10*time.Millisecond), time.Second))
		return
	}
	ctx, cancel := rc.primary.CopyContext()
	ctx = rc.run.Proxy.WithVars(ctx, maps.Clone(rc.vars))
	rc.live = append(rc.live, liveAttempt{c, cancel})
	rc.last, rc.lastSince = c, rc.run.clock().Now()
	rc.copies++
	rc.running++
	rc.run.Metrics.Hedges.WithLabelValues("launched").Inc()
	go rc.runCopy(ctx, c)
	rc.timer.Reset(rc.wait())
}

// runCopy sends the copy c of the job to its worker. Its answer reaches
// the client only if it wins the race. A copy that failed makes way for
// another, on another worker, while the budget lasts.
func (rc *race) runCopy(ctx context.Context, c *scheduler.Ticket) {
	rec := &Recorder{ResponseWriter: rc.rec.ResponseWriter, Tracer: rc.rec.Tracer}
	defer func() {
		v := recover() // an answer that broke off after it began
		rc.mu.Lock()
		if rc.winner == c || v != nil {
			rc.copyRec, rc.copyPanic = rec, v
		}
		rc.endAttempt(c)
		if rc.winner == nil && rc.r.Context().Err() == nil { // it failed
			rc.run.Pool.Avoid(rc.primary, c.ServedBy())
			if rc.copies < rc.budget {
				rc.timer.Reset(0)
			}
		}
		rc.running--
		rc.copyOver.Broadcast()
		rc.mu.Unlock()
		rc.run.Pool.EndHedge()
	}()
	// A copy's failure is no answer, and never runs the job again: the
	// attempt goes on.
	rc.enter(rec.hold(judge{run: rc.run, t: c, copy: true}, false), c)
	r := rc.r.WithContext(ctx) // reverse_proxy copies what it changes of a request
	r.Body = io.NopCloser(bytes.NewReader(c.Body))
	rc.run.send(rec, r, ctx, c, rc.next, rc)
}
