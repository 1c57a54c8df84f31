package diffusionrouter

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.opentelemetry.io/otel/attribute"
	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/control"
	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// A job that a worker fails before any byte of its answer reached the
// client runs again on another worker, from the body the router holds,
// until max_attempts workers have had it. The client sees one answer.

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
// errUpstreamTimeout ends an attempt that outlived upstream_timeout.
var errUpstreamTimeout = errors.New("worker did not answer within upstream_timeout")

var asleepMessage = []byte("Server is sleeping. Call resume_memory_occupation first.")

// proxy sends r to t's worker, and to others in turn while the answers
// are ones the job may run again after, keeping each answer from the
// client until it is known to be the one the client gets.
func (h *Handler) proxy(rec *recorder, r *http.Request, t *scheduler.Ticket, next caddyhttp.Handler) error {
	for {
		var j judge // the zero judge: every answer is the client's
		rerun := h.mayRunAgain(r, t)
		if rerun {
			j = judge{h: h, t: t}
		}
		var err error
		if h.hedges(t) {
			err = h.sendHedged(rec, r, t, next, j, rerun)
		} else {
			rec.hold(j, rerun)
			err = h.send(rec, r, r.Context(), t, next, nil)
		}
		cause := h.rerunCause(r, rec, t, err)
		if cause == noRerun {
			rec.slot.releaseKept() // the client left, or a copy answered, after the attempt kept its worker
			if jobsFault(t, heldStatus(rec)) {
				h.pool.Forgive(t.Blamed) // its 5xx was the job's fault too
			}
			if err := rec.passHeld(); err != nil {
				return err
			}
			return h.answered(rec, t, err)
		}
		from := t.ServedBy()
		if cause == badGateway && mayBeTheJobs(rec.held.status) {
			t.Blamed = from
		}
		retry := h.pool.Retry
		if cause == stalled {
			retry = h.pool.RetryElsewhere
		}
		if retryErr := retry(r.Context(), t, cause.outcome(rec)); retryErr != nil {
			return h.lastAnswer(rec, t, cause, err, retryErr)
		}
		h.metrics.reruns.WithLabelValues(cause.String()).Inc()
		traceEvent(r.Context(), rec.tracer, "diffusion_router.rerun", attribute.String("diffusion.cause", cause.String()),
			attribute.String("diffusion.from", from), attribute.String("diffusion.to", t.ServedBy()))
		h.logger.Info("job runs again on another worker", zap.String("request_id", r.Header.Get(requestIDHeader)),
			zap.String("from", from), zap.String("to", t.ServedBy()), zap.Stringer("cause", cause), zap.Int("attempt", t.Attempts+1))
		rec.dropHeld()
		r = withOwnVars(r)
		r.Body = io.NopCloser(bytes.NewReader(t.Body))
	}
}

// withOwnVars gives r a copy of its request variables. reverse_proxy
// writes to them as it prepares a request, and the connection the last
// attempt was dialling may still be read by net/http's dialer in the
// background, as the variables the last attempt saw.
func withOwnVars(r *http.Request) *http.Request {
	vars, _ := r.Context().Value(caddyhttp.VarsCtxKey).(map[string]any)
	return r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, maps.Clone(vars)))
}

// lastAnswer answers a job that found no worker to run again on: with its
// last answer, or error; when every worker is asleep, with the 503 that
// says so. A job cancelled while it waited to run again gets nothing here:
// forward answers with the cause.
func (h *Handler) lastAnswer(rec *recorder, t *scheduler.Ticket, cause rerunCause, err, retryErr error) error {
	switch {
	case t.Cancelled() != nil:
		rec.dropHeld()
		return nil
	case cause == fellAsleep && errors.Is(retryErr, scheduler.ErrAsleep):
		rec.dropHeld()
		rec.Header().Set("Retry-After", strconv.Itoa(retryAfter(t)))
		status, msg := queueError(h.pool, t, retryErr)
		return control.WriteError(rec, status, msg)
	case rec.held.status != 0:
		return rec.passHeld()
	}
	rec.dropHeld()
	return h.answered(rec, t, err)
}

// answered finishes a request whose last attempt ended with err: an error
// before any answer gets a JSON error the client can act on.
func (h *Handler) answered(rec *recorder, t *scheduler.Ticket, err error) error {
	if err != nil && rec.status == 0 {
		return h.proxyError(rec, t, err)
	}
	return err // non-nil only when the response had begun; Caddy logs it
}

// mayRunAgain reports whether r may be sent to another worker after this
// attempt: a job whose body the router holds, or a request without a body
// that any worker may answer, with attempts left.
func (h *Handler) mayRunAgain(r *http.Request, t *scheduler.Ticket) bool {
	if t.Attempts+1 >= t.Config().MaxAttempts {
		return false
	}
	return t.Job || t.Pin == "" && (r.Method == http.MethodGet || r.Method == http.MethodHead)
}

// judge says which of a worker's answers to t the client must not get
// while t may still run elsewhere. The zero judge lets every answer
// through. A value, not a closure: one allocation per job fewer.
type judge struct {
	h *Handler
	t *scheduler.Ticket
	// copy judges a hedge's copy, whose failure is no answer and never
	// runs the job again: an answer not let through is lost.
	copy bool
}

// verdict is what becomes of an answer of status.
func (j judge) verdict(status int) verdict {
	v := pass
	switch {
	case j.h == nil || !answerMayRunAgain(j.t):
	case status == http.StatusInternalServerError:
		v = read // it may say the worker is asleep
	case status >= 500 || slices.Contains(j.h.LoadBalancing.RetryOn, status):
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
func (h *Handler) rerunCause(r *http.Request, rec *recorder, t *scheduler.Ticket, err error) rerunCause {
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
	case a.state == undecided && err != nil && workerDropped(err) && (t.Route.Rerun != request.RerunUnsent || neverSent(err)):
		return unreachable
	}
	return noRerun
}

// outcomeOf is what t's attempt on r, ended with err and status, says of
// its worker; a 5xx that was the job's own fault says nothing.
func outcomeOf(r *http.Request, t *scheduler.Ticket, err error, status int) scheduler.Outcome {
	if err == nil && jobsFault(t, status) {
		return scheduler.Refused
	}
	return scheduler.OutcomeOf(r.Context(), err, status)
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

// neverSent reports whether err ended an attempt before its request
// reached the worker: no connection could be made.
func neverSent(err error) bool {
	_, dial := errors.AsType[reverseproxy.DialError](err)
	return dial
}

// workerDropped reports whether err, which ended an attempt before any
// answer, is the worker's doing: not the router's upstream_timeout, nor a
// body over max_body.
func workerDropped(err error) bool {
	if errors.Is(err, errUpstreamTimeout) || isMaxBytes(err) {
		return false
	}
	he, ok := errors.AsType[caddyhttp.HandlerError](err)
	return !ok || he.StatusCode != 499
}

// outcome is what the attempt says of its worker.
func (c rerunCause) outcome(rec *recorder) scheduler.Outcome {
	switch c {
	case fellAsleep:
		return scheduler.Asleep
	case badGateway:
		return scheduler.OutcomeOf(context.Background(), nil, rec.held.status)
	}
	return scheduler.Failed
}

// send sends r to t's worker through next and releases the worker: when
// the answer begins (the generation is done; megabytes of base64 may still
// be on their way, but the worker's slot is free), or when a video job it
// started ends. An answer set aside releases nothing: the job may run
// again. A 2xx answer held whole releases its worker as it begins all the
// same; if it then breaks, the failure is counted at once. A worker on
// probation is released only when its answer is known whole or broken:
// its next job waits for that verdict. The attempt
// runs in base, r's context or one a hedge may cancel; r's own context is
// the client's. race, when t's job may get a copy, says what the attempt's
// end tells of its worker.
func (h *Handler) send(rec *recorder, r *http.Request, base context.Context, t *scheduler.Ticket, next caddyhttp.Handler, race *hedge) error {
	ctx := base
	if ticketFrom(base) != t {
		ctx = withTicket(base, t)
	}
	if h.UpstreamTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, time.Duration(h.UpstreamTimeout))
		defer cancel()
	}
	ctx, stop := context.WithCancelCause(ctx)
	defer stop(nil)
	rec.stall = watchStalls(h.answers.stallTimeout, stop)
	defer rec.stall.disarm()
	rec.slot = slot{h: h, t: t, r: r, race: race}
	s := &rec.slot
	defer func() {
		// An answer that broke off after it began to reach the client
		// aborts the client's, by http.ErrAbortHandler (see serve). The
		// worker is released all the same; unless the client left, it was
		// the worker that broke it. Then the client's connection is reset,
		// so that no client takes what came for a whole answer.
		if v := recover(); v != nil {
			if r.Context().Err() != nil {
				s.release(scheduler.Abandoned)
			} else {
				h.metrics.broken.WithLabelValues("streamed").Inc()
				s.brokeOff()
			}
			if v == http.ErrAbortHandler {
				rec.reset()
			}
			panic(v)
		}
	}()
	rec.ticket, rec.answers = t, h.answersFor(r)
	rec.freeEarly = false
	switch {
	case readsVideoJob(r, t.Route):
		rec.peekLimit = maxVideoResponsePeek
	case t.Route.Stream:
		// The worker generates while it sends events: its slot is taken
		// until the stream ends.
	default:
		rec.freeEarly = !t.OnProbation()
	}
	learnImageJobs(rec, r, t)
	t.Sent = true
	t.Attempts++
	t.Lookups = 0
	ctx, end := traceAttempt(ctx, rec.tracer, t, race != nil && t != race.primary)
	attempt := r
	if ctx != r.Context() {
		attempt = r.WithContext(ctx)
	}
	err := serve(next, rec, attempt)
	switch {
	case rec.stall.stalled():
		err = errStalled
	case err != nil && errors.Is(ctx.Err(), context.DeadlineExceeded) && r.Context().Err() == nil:
		err = fmt.Errorf("%w: %w", errUpstreamTimeout, err)
	}
	err = h.settle(rec, r, s, err, ctx.Err() != nil && err != errStalled)
	end(err, attribute.Int("http.response.status_code", heldStatus(rec)))
	if rec.held != nil {
		if cause := h.rerunCause(r, rec, t, err); cause != noRerun {
			s.kept, s.keptAs = true, cause.outcome(rec)
			return err // the re-run frees the worker: see slot.kept
		}
	}
	if !h.trackVideoJob(r, t, rec, err) {
		s.release(outcomeOf(r, t, err, heldStatus(rec)))
	}
	return err
}

// settle settles a 2xx answer held whole, once its attempt ended with err
// (ended: by the router or the client): whole, it goes to the client; cut
// short, its worker failed. It returns the attempt's error as the client
// is to see it.
func (h *Handler) settle(rec *recorder, r *http.Request, s *slot, err error, ended bool) error {
	if werr := rec.settle(err, ended); werr != nil {
		return werr
	}
	a := rec.held
	if a == nil || a.state != broken {
		return err
	}
	h.logger.Warn("worker's answer was cut short", zap.String("request_id", r.Header.Get(requestIDHeader)),
		zap.String("worker", s.t.ServedBy()), zap.Int("attempt", s.t.Attempts), zap.Error(a.broken))
	h.metrics.broken.WithLabelValues("held").Inc()
	s.brokeOff()
	return nil // the job runs again, or the client gets the 502 of a broken answer
}

// slot is an attempt's claim on its worker, released once.
type slot struct {
	h        *Handler
	t        *scheduler.Ticket
	r        *http.Request // the attempt's request
	race     *hedge        // when t's job may get a copy
	released bool
	// kept says the attempt ended in a way its job may run again after,
	// keeping its worker for the re-run, which frees it (pool.Retry);
	// keptAs is what the attempt said of that worker. The client may
	// leave, or a copy answer, before the re-run: then releaseKept frees
	// the worker. The decision is the attempt's, made once: asked again
	// later, a context that ended since would say no re-run, and nothing
	// would free the worker.
	kept   bool
	keptAs scheduler.Outcome
}

// releaseKept frees the worker s's attempt kept for a re-run that is not
// to come.
func (s *slot) releaseKept() {
	if s.kept {
		s.release(s.keptAs)
	}
}

// release ends the claim with outcome o, which a race turns into what the
// attempt says of its worker (see hedge.outcome).
func (s *slot) release(o scheduler.Outcome) {
	if s.released {
		return
	}
	s.released = true
	if s.race != nil {
		o = s.race.outcome(s.t, o)
	}
	if d := s.h.pool.Release(s.t, o); d > 0 {
		s.h.logEjection(s.t, d)
	}
}

// logEjection says that the worker that served t failed it once too often
// and is ejected for d.
func (h *Handler) logEjection(t *scheduler.Ticket, d time.Duration) {
	h.logger.Warn("worker ejected after failed requests", zap.String("worker", t.ServedBy()), zap.Duration("for", d))
}

// brokeOff counts a failure against the worker whose answer began and
// then broke: if its slot already went free as a success, it was a failure
// after all.
func (s *slot) brokeOff() {
	if !s.released {
		s.release(scheduler.Failed)
		return
	}
	if d := s.h.pool.NoteCutShort(s.t); d > 0 {
		s.h.logEjection(s.t, d)
	}
}

// answersFor is how the answers to r are held back and checked: not at
// all for a HEAD, whose answer has no body.
func (h *Handler) answersFor(r *http.Request) *heldAnswers {
	if r.Method == http.MethodHead {
		return nil
	}
	return &h.answers
}

// errBrokenAnswer ends an attempt whose answer broke off while it was
// still held: none of it reached the client.
var errBrokenAnswer = errors.New("the connection ended before the answer did")

// serve runs next, and ends the check of an answer that streamed to the
// client. reverse_proxy aborts an answer that breaks off after its header
// by panicking with http.ErrAbortHandler: while that answer is held,
// nothing of it reached the client, and the attempt just failed; once it
// streams, the abort goes on to the client's.
func serve(next caddyhttp.Handler, rec *recorder, r *http.Request) (err error) {
	defer func() {
		v := recover()
		switch {
		case v == nil:
			return
		case v == http.ErrAbortHandler && rec.held != nil:
			rec.held.truncated = true
			err = errBrokenAnswer
			return
		}
		rec.dropHeld()
		panic(v)
	}()
	if err = next.ServeHTTP(rec, r); err == nil {
		rec.finishStream()
	}
	return err
}

// heldStatus is the status of the answer the client gets or will get.
func heldStatus(rec *recorder) int {
	if rec.held != nil {
		return rec.held.status
	}
	return rec.status
}
