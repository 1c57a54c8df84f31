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
// attempt says of its worker (see race.outcome).
func (s *slot) release(o scheduler.Outcome) {
	if s.released {
		return
	}
	s.released = true
	if s.race != nil {
		o = s.race.outcome(s.t, o)
	}
	if d := s.run.Pool.Release(s.t, o); d > 0 {
		s.run.logEjection(s.t, d)
	}
}

// brokeOff counts a failure against the worker whose answer began and
// then broke: if its slot already went free as a success, it was a failure
// after all.
func (s *slot) brokeOff() {
	if !s.released {
		s.release(scheduler.Failed)
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
