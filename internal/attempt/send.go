package attempt

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"go.opentelemetry.io/otel/attribute"
	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// send sends r to t's worker through next and releases the worker: when
// the answer begins (the generation is done; megabytes of base64 may still
// be on their way, but the worker's slot is free), or when a job its kind
// holds (a video job) ends. An answer set aside releases nothing: the job
// may run again. A 2xx answer held whole releases its worker as it begins
// all the same; if it then breaks, the failure is counted at once. A
// worker on probation is released only when its answer is known whole or
// broken: its next job waits for that verdict. The attempt runs in base,
// r's context or one a hedge may cancel; r's own context is the client's.
// race, when t's job may get a copy, says what the attempt's end tells of
// its worker.
func (run *Runner) send(rec *Recorder, r *http.Request, base context.Context, t *scheduler.Ticket, next Next, race *race) error {
	ctx := base
	if scheduler.TicketFrom(base) != t {
		ctx = scheduler.WithTicket(base, t)
	}
	if run.UpstreamTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, run.UpstreamTimeout)
		defer cancel()
	}
	ctx, stop := context.WithCancelCause(ctx)
	defer stop(nil)
	rec.stall = watchStalls(run.StallTimeout, run.clock(), stop)
	defer rec.stall.disarm()
	rec.slot = slot{run: run, t: t, r: r, race: race}
	s := &rec.slot
	defer func() {
		// An answer that broke off after it began to reach the client
		// aborts the client's, by http.ErrAbortHandler (see serve). The
		// worker is released all the same; unless the client left, it was
		// the worker that broke it. Then the client's connection is reset,
		// so that no client takes what came for a whole answer.
		if v := recover(); v != nil {
			if r.Context().Err() == nil {
				run.Metrics.Broken.WithLabelValues("streamed").Inc()
				s.brokeOff()
			}
			s.release(run.ended(r, rec, t, errBrokenAnswer))
			if v == http.ErrAbortHandler {
				rec.reset()
			}
			panic(v)
		}
	}()
	run.begin(rec, r, t)
	ctx, end := traceAttempt(ctx, rec, t, race != nil && t != race.primary)
	attempt := r
	if ctx != r.Context() {
		attempt = r.WithContext(ctx)
	}
	err := serve(next, rec, attempt)
	switch {
	case rec.stall.stalled():
		err = errStalled
	case err != nil && errors.Is(ctx.Err(), context.DeadlineExceeded) && r.Context().Err() == nil:
		err = fmt.Errorf("%w: %w", ErrUpstreamTimeout, err)
	}
	err = run.settle(rec, r, s, err, ctx.Err() != nil && err != errStalled)
	end(err, attribute.Int("http.response.status_code", heldStatus(rec)))
	e := run.ended(r, rec, t, err)
	if e.Rerun != scheduler.NoRerun {
		s.kept, s.end = true, e
		return err // the re-run frees the worker: see slot.kept
	}
	if !run.Kinds.Ended(r, t, Ending{End: e, Err: err, Status: heldStatus(rec), Sent: rec.status, Peek: rec.peek}) {
		s.release(e)
	}
	return err
}

// begin readies rec for t's attempt r: how its answer is held and read,
// and when its worker goes free.
func (run *Runner) begin(rec *Recorder, r *http.Request, t *scheduler.Ticket) {
	w := run.Kinds.Watch(r, t)
	rec.run, rec.ticket, rec.checks = run, t, r.Method != http.MethodHead
	rec.peek, rec.peekLimit, rec.learns = rec.peek[:0], w.Peek, w.Learns
	// The worker of a stream generates while it sends events: its slot
	// is taken until the stream ends.
	rec.freeEarly = !w.Holds && !t.Route.Stream && !t.OnProbation()
	t.NoteSent()
	t.SetAttempt(&rec.tries)
	rec.tries.attempts++
	rec.tries.lookups = 0
}

// settle settles a 2xx answer held whole, once its attempt ended with err
// (ended: by the router or the client): whole, it goes to the client; cut
// short, its worker failed. It returns the attempt's error as the client
// is to see it.
func (run *Runner) settle(rec *Recorder, r *http.Request, s *slot, err error, ended bool) error {
	if werr := rec.settle(err, ended); werr != nil {
		return werr
	}
	a := rec.held
	if a == nil || a.state != broken {
		return err
	}
	run.Logger.Warn("worker's answer was cut short", zap.String("request_id", r.Header.Get(request.IDHeader)),
		zap.String("worker", s.t.ServedBy()), zap.Int("attempt", rec.tries.attempts), zap.Error(a.broken))
	run.Metrics.Broken.WithLabelValues("held").Inc()
	s.brokeOff()
	return nil // the job runs again, or the client gets the 502 of a broken answer
}

// errBrokenAnswer ends an attempt whose answer broke off while it was
// still held: none of it reached the client.
var errBrokenAnswer = errors.New("the connection ended before the answer did")

// serve runs next, and ends the check of an answer that streamed to the
// client. A proxy aborts an answer that breaks off after its header by
// panicking with http.ErrAbortHandler: while that answer is held, nothing
// of it reached the client, and the attempt just failed; once it streams,
// the abort goes on to the client's.
func serve(next Next, rec *Recorder, r *http.Request) (err error) {
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
func heldStatus(rec *Recorder) int {
	if rec.held != nil {
		return rec.held.status
	}
	return rec.status
}
