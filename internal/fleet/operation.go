package fleet

import (
	"context"
	"errors"
	"time"
)

// An operation over the fleet runs to its end whether or not its caller
// waits for it: a trainer's client timeout or Ctrl-C must not leave
// workers half updated, or recorded as stale when they loaded the new
// weights. The caller gets the report if it is still there; one that
// comes back reads it from Last.

// Report is what became of a fleet operation, as GET /fleet_operation
// shows it.
type Report struct {
	Operation     string     `json:"operation"`                // update_weights, set_lora, sleep, wake, ...
	WeightVersion string     `json:"weight_version,omitempty"` // the version it leads to
	Running       bool       `json:"running"`
	Started       time.Time  `json:"started"`
	Ended         *time.Time `json:"ended"` // null while it runs
	Results       []Result   `json:"results"`
	Error         string     `json:"error,omitempty"` // why it did not run to its end on every worker it meant to
	Err           error      `json:"-"`
}

// errBroke is the error of an operation that ended in a panic; the panic
// itself is logged.
var errBroke = errors.New("the operation broke off; see the router's log")

// Start takes the fleet, waiting for it while ctx lasts (or, without wait,
// failing at once with ErrFleetBusy), and runs run in the pool's
// background to its end, with the pool's context rather than ctx. The
// channel returned delivers the operation's report once it has ended.
func (f *Fleet) Start(ctx context.Context, wait bool, name, version string, run func(ctx context.Context) ([]Result, error)) (<-chan Report, error) {
	unlock, err := f.Lock(ctx, wait)
	if err != nil {
		return nil, err
	}
	rep := Report{Operation: name, WeightVersion: version, Running: true, Started: time.Now().UTC()}
	f.record(rep)
	done := make(chan Report, 1)
	f.pool.Go(name+" of the fleet", func(ctx context.Context) {
		defer func() {
			ended := time.Now().UTC()
			rep.Running, rep.Ended = false, &ended
			if rep.Err != nil {
				rep.Error = rep.Err.Error()
			}
			f.record(rep)
			unlock()
			done <- rep
		}()
		rep.Err = errBroke // unless run returns
		rep.Results, rep.Err = run(ctx)
	})
	return done, nil
}

// record makes rep the last operation's report.
func (f *Fleet) record(rep Report) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.last = &rep
}

// Last returns the report of the operation running or run last; false
// when none has run since the pool was made.
func (f *Fleet) Last() (Report, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.last == nil {
		return Report{}, false
	}
	return *f.last, true
}
