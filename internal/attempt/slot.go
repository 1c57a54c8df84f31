package attempt

import (
	"net/http"
	"time"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// slot is an attempt's claim on its worker, released once.
type slot struct {
	run      *Runner
	t        *scheduler.Ticket
	r        *http.Request // the attempt's request
	race     *race         // when t's job may get a copy
	released bool
	// kept says the attempt ended in a way its job may run again after,
	// keeping its worker for the re-run, which frees it (pool.Retry);
	// end is how the attempt ended. The client may
	// leave, or a copy answer, before the re-run: then releaseKept frees
	// the worker. The decision is the attempt's, made once: asked again
	// later, a context that ended since would say no re-run, and nothing
	// would free the worker.
	kept bool
	end  scheduler.End
}

// releaseKept frees the worker s's attempt kept for a re-run that is not
// to come.
func (s *slot) releaseKept() {
	if s.kept {
		s.release(s.end)
	}
}

// release ends the claim, once, as e, the attempt's end, says.
func (s *slot) release(e scheduler.End) {
	if s.released {
		return
	}
	s.released = true
	if d := s.run.Pool.Release(s.t, e); d > 0 {
		s.run.logEjection(s.t, d)
	}
}

// brokeOff counts a failure against the worker whose answer began and
// then broke, if its slot already went free as a success: it was a
// failure after all. A slot not yet free goes free as the attempt's end
// says, a failure (see Runner.evidenceOf).
func (s *slot) brokeOff() {
	if !s.released {
		return
	}
	if d := s.run.Pool.NoteCutShort(s.t); d > 0 {
		s.run.logEjection(s.t, d)
	}
}

// logEjection says that the worker that served t failed it once too often
// and is ejected for d.
func (run *Runner) logEjection(t *scheduler.Ticket, d time.Duration) {
	run.Logger.Warn("worker ejected after failed requests", zap.String("worker", t.ServedBy()), zap.Duration("for", d))
}
