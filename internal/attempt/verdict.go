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

// rerunCause is why a job runs again.
type rerunCause uint8

const (
	noRerun     rerunCause = iota
	unreachable            // the worker could not be reached, or dropped the connection before answering
	badGateway             // it answered a 5xx or a status in retry_on
	fellAsleep             // it answered that it is asleep: put to sleep behind the router's back
	cutShort               // its 2xx answer broke off, or its JSON or msgpack is not whole
	stalled                // its 2xx answer stopped coming (answer_stall_timeout): never sent back to it
)

var rerunCauseNames = [...]string{"", "connection", "status", "asleep", "cut_short", "stalled"}

func (c rerunCause) String() string { return rerunCauseNames[c] }

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

// rerunCause says whether t's attempt that ended with err and rec's held
// answer is one to run again after, and why.
func (run *Runner) rerunCause(r *http.Request, rec *Recorder, t *scheduler.Ticket, err error) rerunCause {
	a := rec.held
	switch {
	case a == nil || !a.rerun || r.Context().Err() != nil || t.Attempts >= t.Config().MaxAttempts:
		return noRerun
	case a.state == read && bytes.Contains(a.body, asleepMessage):
		return fellAsleep
	case a.state == drop || a.state == read:
		if jobsFault(t, a.status) {
			return noRerun
		}
		return badGateway
	case a.state == broken && a.broken == errStalled && answerMayRunAgain(t):
		return stalled
	case a.state == broken && answerMayRunAgain(t):
		return cutShort
	case a.state == undecided && err != nil && run.workerDropped(err) && (t.Route.Rerun != request.RerunUnsent || run.Proxy.NeverSent(err)):
		return unreachable
	}
	return noRerun
}

// rerunOutcome is what an attempt that ended with err, to be run again
// for cause c, says of its worker.
func (run *Runner) rerunOutcome(c rerunCause, rec *Recorder, err error) scheduler.Outcome {
	switch {
	case c == fellAsleep:
		return scheduler.Asleep
	case c == badGateway:
		return scheduler.OutcomeOf(context.Background(), nil, rec.held.status)
	case c == unreachable && run.wasDown(err):
		return scheduler.Unreachable
	}
	return scheduler.Failed
}

// outcomeOf is what t's attempt on r, ended with err and status, says of
// its worker; a 5xx that was the job's own fault says nothing.
func (run *Runner) outcomeOf(r *http.Request, t *scheduler.Ticket, err error, status int) scheduler.Outcome {
	switch {
	case err == nil && jobsFault(t, status):
		return scheduler.Refused
	case status == 0 && r.Context().Err() == nil && run.wasDown(err):
		return scheduler.Unreachable
	}
	return scheduler.OutcomeOf(r.Context(), err, status)
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

// jobsFault reports whether a 5xx answer to t is taken as the job's own
// fault rather than its worker's: another worker answered t with a 5xx
// already. A job that fails the same way on two workers would fail on
// all of them.
func jobsFault(t *scheduler.Ticket, status int) bool {
	return mayBeTheJobs(status) && t.Blamed != "" && t.Blamed != t.ServedBy()
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
