package scheduler

import (
	"context"
	"errors"
	"fmt"
)

type ticketKey struct{}

// WithTicket carries t in ctx through the proxy that sends its attempt,
// whose request clone keeps the context, to the transport and the
// upstream selection that read it.
func WithTicket(ctx context.Context, t *Ticket) context.Context {
	return context.WithValue(ctx, ticketKey{}, t)
}

// jobContext is a job's cancellable context, which carries its ticket.
type jobContext struct {
	context.Context
	t *Ticket
}

func (c *jobContext) Value(key any) any {
	if key == (ticketKey{}) {
		return c.t
	}
	return c.Context.Value(key)
}

// TicketFrom is the ticket ctx carries, or nil.
func TicketFrom(ctx context.Context) *Ticket {
	t, _ := ctx.Value(ticketKey{}).(*Ticket)
	return t
}

// errCancelled is the cause of a ticket's context that Cancel ended.
type errCancelled struct{ cause error }

func (e *errCancelled) Error() string { return e.cause.Error() }

func (e *errCancelled) Unwrap() error { return e.cause }

// WithCancel makes t cancellable: its job waits for a worker and runs on
// it in the context returned, a child of ctx that carries t (TicketFrom).
func (t *Ticket) WithCancel(ctx context.Context) context.Context {
	t.parent = ctx
	var cancellable context.Context
	cancellable, t.cancel = context.WithCancelCause(ctx)
	t.job = jobContext{Context: cancellable, t: t}
	t.ctx = &t.job
	return t.ctx
}

// errOvertaken is the cause of a ticket's context that Overtake ended. It
// is a cancellation, as the client's leaving is: the attempt's answer is
// nobody's.
var errOvertaken = fmt.Errorf("a copy of the job on another worker answered first: %w", context.Canceled)

// Overtake ends the context of t's attempt, which a copy of its job (see
// CopyContext) overtook, with no cause an abort would give: the client
// gets the copy's answer. A job's one context serves its attempt too, so
// that a job that is never copied, nearly all of them, costs no context
// of its own for the chance.
func (t *Ticket) Overtake() {
	if t.cancel != nil {
		t.cancel(errOvertaken)
	}
}

// CopyContext returns the context of a copy of t's job running beside
// t's attempt, and what ends it: it ends when the client leaves or t's
// job is cancelled (Cancel), but not when the copy overtakes t's attempt
// (Overtake). A cancelled job whose attempt a copy overtook already has
// its answer: its copy runs on. t must have been made cancellable.
func (t *Ticket) CopyContext() (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(t.parent)
	stop := context.AfterFunc(t.ctx, func() {
		if CancelledBy(t.ctx) != nil {
			cancel(context.Cause(t.ctx))
		}
	})
	return ctx, func() { stop(); cancel(nil) }
}

// Cancelled returns the cause Cancel gave t's job, or nil: whatever error
// its attempt ended with (a connection closed, an answer cut off), that
// is what the job's client is to be told.
func (t *Ticket) Cancelled() error {
	if t.ctx == nil {
		return nil
	}
	return CancelledBy(t.ctx)
}

// Cancel ends t's job for cause, whether it waits or runs. A waiting job
// leaves the queue at once and never reaches a worker. A running one has
// its connection to the worker closed; sglang-diffusion cannot stop a
// generation, so its worker's slot stays counted until the job's
// predicted end, as for a client that left: freeLocked decides that, in
// one place, for every job released as abandoned.
func (t *Ticket) Cancel(cause error) {
	if t.cancel != nil {
		t.cancel(&errCancelled{cause})
	}
}

// CancelledBy returns the cause Cancel gave ctx's job, or nil.
func CancelledBy(ctx context.Context) error {
	if c, ok := errors.AsType[*errCancelled](context.Cause(ctx)); ok {
		return c.cause
	}
	return nil
}
