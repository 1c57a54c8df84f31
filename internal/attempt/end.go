package attempt

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"slices"
	"syscall"

	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// asleepMessage is how sglang-diffusion's scheduler refuses a generation
// while its memory is released (release_memory_occupation).
var asleepMessage = []byte("Server is sleeping. Call resume_memory_occupation first.")

// judge says which of a worker's answers to t the client must not get
// while t may still run elsewhere. The zero judge lets every answer
// through. A value, not a closure: one allocation per job fewer.
type judge struct {
	run *Runner
	t   *scheduler.Ticket
	// copy judges a hedge's copy, whose failure is no answer and never
	// runs the job again: an answer not let through is lost.
	copy bool
}

// verdict is what becomes of an answer of status.
func (j judge) verdict(status int) verdict {
	v := pass
	switch {
	case j.run == nil || !answerMayRunAgain(j.t):
	case status == http.StatusInternalServerError:
		v = read // it may say the worker is asleep
	case status >= 500 || slices.Contains(j.run.RetryOn, status):
		v = drop
	}
	if j.copy && v != pass {
		return lost
	}
	return v
}

// answerMayRunAgain reports whether t may run again after its worker
// answered. A video job that a worker answered for may exist there: only
// one that got no answer runs again.
func answerMayRunAgain(t *scheduler.Ticket) bool {
	return !t.Job || t.Route.Rerun == request.RerunUntilSent
}

// ended is how t's attempt r ended, with err and with rec's answer as
// its held answer's verdict left it: what the attempt tells of its worker
// and, when the job runs again, why. It is the one place that decides
// both: the attempt hands its End to the pool once (Release, or Retry
// when the job runs again), the re-run is counted and logged by its
// cause, and the kind of job reads it (Kinds.Ended). A copy that lost its
// hedge's race, or the attempt a copy overtook, tells what the race says
// (see race.evidence).
func (run *Runner) ended(r *http.Request, rec *Recorder, t *scheduler.Ticket, err error) scheduler.End {
	e := scheduler.End{Rerun: run.rerunOf(r, rec, t, err)}
	if e.Rerun != scheduler.NoRerun {
		e.Worker = run.rerunEvidence(e.Rerun, rec, err)
	} else {
		e.Worker = run.evidenceOf(r, rec, t, err)
	}
	if race := rec.slot.race; race != nil {
		e.Worker = race.evidence(t, e.Worker)
	}
	return e
}

// Lookup readies t for reverse_proxy's ask for the worker of t's
// attempt, and reports whether t holds one to give it. The first ask gets
// the worker t holds. Asked again within one attempt (its block's
// lb_retries or lb_try_duration), reverse_proxy could not reach that
// worker: t leaves it and runs again on another, as any re-run does
// (Pool.Retry), counted as an attempt. reverse_proxy tells no more of its
// failure than that it asks again, so this is the one End not decided by
// ended.
func Lookup(ctx context.Context, pool Pool, t *scheduler.Ticket) bool {
	c := t.Attempt().(*tries) // the attempt under way's, set as it began (see begin)
	c.lookups++
	if c.lookups == 1 {
		return true
	}
	c.attempts++
	return pool.Retry(ctx, t, scheduler.End{Worker: scheduler.Failed, Rerun: scheduler.RerunReach}) == nil
}

// rerunOf says whether t's attempt that ended with err and rec's held
// answer is one to run again after, and why.
func (run *Runner) rerunOf(r *http.Request, rec *Recorder, t *scheduler.Ticket, err error) scheduler.Rerun {
	a := rec.held
	switch {
	case a == nil || !a.rerun || r.Context().Err() != nil || rec.tries.attempts >= t.Config().MaxAttempts:
		return scheduler.NoRerun
	case a.state == read && bytes.Contains(a.body, asleepMessage):
		return scheduler.RerunAsleep
	case a.state == drop || a.state == read:
		if rec.tries.jobsFault(t, a.status) {
			return scheduler.NoRerun
		}
		return scheduler.RerunStatus
	case a.state == broken && a.broken == errStalled && answerMayRunAgain(t):
		return scheduler.RerunStalled
	case a.state == broken && answerMayRunAgain(t):
		return scheduler.RerunCutShort
	case a.state == undecided && err != nil && run.workerDropped(err) && (t.Route.Rerun != request.RerunUnsent || run.Proxy.NeverSent(err)):
		return scheduler.RerunReach
	}
	return scheduler.NoRerun
}

// rerunEvidence is what an attempt that ended with err, to be run again
// for cause c, tells of its worker.
func (run *Runner) rerunEvidence(c scheduler.Rerun, rec *Recorder, err error) scheduler.Evidence {
	switch {
	case c == scheduler.RerunAsleep:
		return scheduler.Asleep
	case c == scheduler.RerunStatus:
		return evidenceOfStatus(context.Background(), nil, rec.held.status)
	case c == scheduler.RerunReach && run.wasDown(err):
		return scheduler.Unreachable
	}
	return scheduler.Failed
}

// evidenceOf is what t's attempt on r, ended with err and rec's answer,
// not to be run again, tells of its worker: a held answer that broke is
// its failure; a 5xx that was the job's own fault tells nothing.
func (run *Runner) evidenceOf(r *http.Request, rec *Recorder, t *scheduler.Ticket, err error) scheduler.Evidence {
	status := heldStatus(rec)
	switch {
	case rec.held != nil && rec.held.state == broken:
		return scheduler.Failed
	case err == nil && rec.tries.jobsFault(t, status):
		return scheduler.Refused
	case status == 0 && r.Context().Err() == nil && run.wasDown(err):
		return scheduler.Unreachable
	}
	return evidenceOfStatus(r.Context(), err, status)
}

// evidenceOfStatus tells how the exchange with the worker ended, as
// evidence of the worker's health: a 5xx is the worker's failure, as
// Envoy counts them; a 4xx is the request's fault and says nothing of
// the worker.
func evidenceOfStatus(clientCtx context.Context, err error, status int) scheduler.Evidence {
	switch {
	case clientCtx.Err() != nil:
		return scheduler.Abandoned
	case err != nil, status >= 500:
		return scheduler.Failed
	case status >= 400:
		return scheduler.Refused
	}
	return scheduler.Succeeded
}

// wasDown reports whether err, which ended an attempt before any byte of
// its answer, says its worker was down rather than up and failing: no
// connection could be made, or the one made was closed or reset before
// anything was read, as when the worker's process dies. A timeout says
// the worker was up and did not answer; a malformed or broken answer
// (io.ErrUnexpectedEOF), that it began one.
func (run *Runner) wasDown(err error) bool {
	switch {
	case err == nil || !run.workerDropped(err):
		return false
	case run.Proxy.NeverSent(err):
		return true
	}
	if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() {
		return false
	}
	return errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EPIPE)
}

// mayBeTheJobs reports whether a worker's answer of status may be the
// job's own fault: a 5xx but 503, which says the worker takes no jobs now
// (it is shutting down, crashed or overloaded), whatever the job.
func mayBeTheJobs(status int) bool {
	return status >= 500 && status != http.StatusServiceUnavailable
}

// workerDropped reports whether err, which ended an attempt before any
// answer, is the worker's doing: not the router's upstream_timeout, nor a
// body over max_body, nor the client gone.
func (run *Runner) workerDropped(err error) bool {
	return !errors.Is(err, ErrUpstreamTimeout) && !request.OverMaxBody(err) && !run.Proxy.ClientLeft(err)
}
