package scheduler

import "context"

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
