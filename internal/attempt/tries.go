package attempt

import (
	"net/http"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// tries is what a job's attempts count of it, in the Recorder of its
// client (a hedge's copy in its own). Each attempt's ticket carries it
// too (scheduler.Ticket.SetAttempt), for Lookup, which finds the ticket
// alone in the request reverse_proxy asks about.
type tries struct {
	attempts int    // times the request was sent to a worker, its copies' too
	lookups  int    // reverse_proxy's lookups of the worker of the attempt under way; more than one is a retry (see Lookup)
	blamed   string // the worker whose 5xx made the job run again, if one did
}

// Attempts is how many times the request rec answers was sent to a
// worker, hedged copies and reverse_proxy's retries included.
func (rec *Recorder) Attempts() int { return rec.tries.attempts }

// mayRunAgain reports whether r, whose ticket is t, may be sent to another
// worker after the attempt under way: a job whose body the router holds,
// or a request without a body that any worker may answer, with attempts
// left.
func (c *tries) mayRunAgain(r *http.Request, t *scheduler.Ticket) bool {
	if c.attempts+1 >= t.Config().MaxAttempts {
		return false
	}
	return t.Job || t.Pin == "" && (r.Method == http.MethodGet || r.Method == http.MethodHead)
}

// jobsFault reports whether a 5xx answer to t is taken as the job's own
// fault rather than its worker's: another worker answered t with a 5xx
// already. A job that fails the same way on two workers would fail on
// all of them.
func (c *tries) jobsFault(t *scheduler.Ticket, status int) bool {
	return mayBeTheJobs(status) && c.blamed != "" && c.blamed != t.ServedBy()
}
