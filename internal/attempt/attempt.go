// Package attempt runs one job's way over the workers once the pool gave
// it one: each attempt's answer held back until it is known to be the
// client's, the verdict on it (whole, broken, one to run again after),
// the re-runs and hedged copies its max_attempts leaves room for, and the
// release of each worker's slot, once, by the attempt that holds it.
//
// A job that a worker fails before any byte of its answer reached the
// client runs again on another worker, from the body the router holds,
// until max_attempts workers have had it. The client sees one answer.
//
// The package knows nothing of Caddy: the proxy that sends an attempt is
// a Next, what its errors mean is its Proxy's to say, and what a kind of
// job reads from its answers is its Kinds'.
package attempt

import (
	"bytes"
	"context"
	"errors"
	"io"
	"maps"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/answer"
	"github.com/miles-rollout/miles-diffusion-router/internal/clock"
	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/spans"
)

// Next sends an attempt's request to the worker its ticket holds and
// writes the worker's answer to w: Caddy's reverse_proxy, behind the
// router's handler.
type Next interface {
	ServeHTTP(w http.ResponseWriter, r *http.Request) error
}

// Pool is the pool as a job's attempts use it: re-runs, hedged copies,
// the release of a worker with what its attempt says of it, and its
// workers by URL (a redirect to one becomes a path on the router). Each
// method is the scheduler pool's of that name.
type Pool interface {
	Retry(ctx context.Context, t *scheduler.Ticket, e scheduler.End) error
	Release(t *scheduler.Ticket, e scheduler.End) time.Duration
	NoteCutShort(t *scheduler.Ticket) (ejected time.Duration)
	Forgive(url string)
	HedgeCopy(t *scheduler.Ticket) *scheduler.Ticket
	Avoid(t *scheduler.Ticket, workerURL string)
	EndHedge()
	Worker(url string) (scheduler.WorkerInfo, bool)
}

// Proxy is what only the proxy that sends the attempts knows.
type Proxy struct {
	// NeverSent reports whether err ended an attempt before its request
	// reached the worker: no connection could be made.
	NeverSent func(err error) bool
	// ClientLeft reports whether err is the proxy's word that the client
	// went away.
	ClientLeft func(err error) bool
	// Vars are the variables of ctx's request that the proxy writes to
	// as it prepares a request (Caddy's), and WithVars gives ctx vars of
	// its own. An attempt that runs after another, or beside it, gets a
	// copy: the connection the last attempt was dialling may still read
	// what that attempt saw.
	Vars     func(ctx context.Context) map[string]any
	WithVars func(ctx context.Context, vars map[string]any) context.Context
}

// Watch is what a kind of job reads of an attempt's answer.
type Watch struct {
	Peek   int  // how many of the answer's first bytes to keep; 0: none
	Learns bool // Kinds.Learn reads them as they come, before they go out
	// Holds says Kinds.Ended may keep the worker's slot: it must not go
	// free as the answer begins.
	Holds bool
}

// Ending is how an attempt ended, as a kind of job reads it: its End
// (see Runner.ended), and the error and answer it ended with.
type Ending struct {
	scheduler.End
	Err    error
	Status int    // of the answer the client gets or will get; 0: none
	Sent   int    // the status the client got; 0: none yet
	Peek   []byte // the first bytes of the answer, as Watch asked
}

// Kinds is what the kinds of job learn from their answers: which worker
// made a job the client will ask about again, and when one ended.
type Kinds interface {
	// Watch is what the kind of t's job reads of the answer to its
	// attempt r.
	Watch(r *http.Request, t *scheduler.Ticket) Watch
	// Learn reads peek, the start of a 2xx answer to t's attempt r, as
	// it grows and before it goes out, and reports whether it had all it
	// needed.
	Learn(r *http.Request, t *scheduler.Ticket, peek []byte) bool
	// Ended reads how t's attempt r ended, and reports whether t keeps
	// its worker's slot: a job that runs on after its answer.
	Ended(r *http.Request, t *scheduler.Ticket, e Ending) bool
}

// Metrics count what becomes of attempts, each by one label.
type Metrics struct {
	Reruns   *prometheus.CounterVec // jobs run again, by cause
	Broken   *prometheus.CounterVec // 2xx answers broken off or cut short, by delivery: held, streamed
	Streamed *prometheus.CounterVec // 2xx answers streamed rather than held whole, by reason: size, budget
	Hedges   *prometheus.CounterVec // copies, by outcome: launched, won, cancelled
}

// Runner runs the attempts of one handler's jobs, by its rules.
type Runner struct {
	// Pool is the pool whose workers the attempts run on.
	Pool Pool
	// Proxy says what the proxy's errors mean, and forks its variables.
	Proxy Proxy
	// Kinds read what the jobs of each kind learn from their answers.
	Kinds Kinds
	// Budget bounds the 2xx answers held whole until they are checked.
	Budget *answer.Budget
	// StallTimeout ends an attempt whose held answer stops coming.
	StallTimeout time.Duration
	// UpstreamTimeout ends an attempt that outlives it; 0: none.
	UpstreamTimeout time.Duration
	// RetryOn lists the statuses, besides 5xx, that run a job again.
	RetryOn []int
	// Metrics count re-runs, broken and streamed answers, and hedges.
	Metrics Metrics
	// Logger logs re-runs, answers cut short and ejections.
	Logger *zap.Logger
	// Clock runs the timers of hedges and stall watches; nil: the wall
	// clock.
	Clock clock.Clock
	// AwaitCopies, when set, is told as a job's goroutine, its attempt
	// over, begins to wait for copies of t's job that still run, and the
	// function it returns is called once they all ended, before the
	// goroutine goes on. The scheduler's simulation (cmd/bench --mode
	// schedule) moves its virtual clock only while every goroutine of its
	// jobs waits on something it controls, and this wait, on the copies'
	// goroutines, is the one it cannot otherwise see.
	AwaitCopies func(t *scheduler.Ticket) (over func())
}

// ErrUpstreamTimeout ends an attempt that outlived the Runner's
// UpstreamTimeout.
var ErrUpstreamTimeout = errors.New("worker did not answer within upstream_timeout")

// Run sends r, whose ticket t holds a worker, through next, and to other
// workers in turn while the answers are ones the job may run again
// after, keeping each answer from the client until it is known to be the
// one the client gets. An error it returns with nothing written to rec
// (rec.Status() is 0) is for the caller to answer with: the proxy's,
// ErrUpstreamTimeout, or scheduler.ErrAsleep when every worker that could
// run the job again is asleep; a job cancelled meanwhile gets no answer
// here, whatever error its attempt ended with, and the caller answers
// with its cause (t.Cancelled()). One returned once the answer began is
// only to be logged: the client's answer was cut off.
func (run *Runner) Run(rec *Recorder, r *http.Request, t *scheduler.Ticket, next Next) error {
	for {
		var j judge // the zero judge: every answer is the client's
		rerun := rec.tries.mayRunAgain(r, t)
		if rerun {
			j = judge{run: run, t: t}
		}
		var err error
		if run.hedges(rec, t) {
			err = run.sendHedged(rec, r, t, next, j, rerun)
		} else {
			rec.hold(j, rerun)
			err = run.send(rec, r, r.Context(), t, next, nil)
		}
		e := run.ended(r, rec, t, err)
		if e.Rerun == scheduler.NoRerun {
			rec.slot.releaseKept() // the client left, or a copy answered, after the attempt kept its worker
			if rec.tries.jobsFault(t, heldStatus(rec)) {
				run.Pool.Forgive(rec.tries.blamed) // its 5xx was the job's fault too
			}
			if werr := rec.passHeld(); werr != nil {
				return werr
			}
			return err
		}
		from := t.ServedBy()
		if e.Rerun == scheduler.RerunStatus && mayBeTheJobs(rec.held.status) {
			rec.tries.blamed = from
		}
		if retryErr := run.Pool.Retry(r.Context(), t, e); retryErr != nil {
			return lastAnswer(rec, t, e.Rerun, err, retryErr)
		}
		run.Metrics.Reruns.WithLabelValues(e.Rerun.String()).Inc()
		spans.Event(r.Context(), rec.Tracer, "diffusion_router.rerun", attribute.String("diffusion.cause", e.Rerun.String()),
			attribute.String("diffusion.from", from), attribute.String("diffusion.to", t.ServedBy()))
		run.Logger.Info("job runs again on another worker", zap.String("request_id", r.Header.Get(request.IDHeader)),
			zap.String("from", from), zap.String("to", t.ServedBy()), zap.Stringer("cause", e.Rerun), zap.Int("attempt", rec.tries.attempts+1))
		rec.dropHeld()
		r = r.WithContext(run.Proxy.WithVars(r.Context(), maps.Clone(run.Proxy.Vars(r.Context()))))
		r.Body = io.NopCloser(bytes.NewReader(t.Body))
	}
}

// lastAnswer answers a job that found no worker to run again on: with its
// last answer, or error; when every worker is asleep, with the error that
// says so. A job cancelled while it waited to run again gets nothing.
func lastAnswer(rec *Recorder, t *scheduler.Ticket, cause scheduler.Rerun, err, retryErr error) error {
	switch {
	case t.Cancelled() != nil:
		rec.dropHeld()
		return nil
	case cause == scheduler.RerunAsleep && errors.Is(retryErr, scheduler.ErrAsleep):
		rec.dropHeld()
		return retryErr
	case rec.held.status != 0:
		return rec.passHeld()
	}
	rec.dropHeld()
	return err
}

// clock is the clock the Runner's timers run on.
func (run *Runner) clock() clock.Clock {
	if run.Clock == nil {
		return clock.Real
	}
	return run.Clock
}
