package attempt

import (
	"context"
	"errors"
	"sync/atomic"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/clock"
)

// errStalled ends an attempt whose held answer went answers.stall_timeout
// without a byte.
var errStalled = errors.New("no byte of it came within answer_stall_timeout")

// stallWatch ends an attempt whose answer, held back, stops coming: no
// byte for its bound. It watches only while the answer is held: bytes
// held are copied into memory as they come, so a pause is the worker's;
// once the answer streams, a slow client may pause it too. One watch
// serves one attempt: a timer that fires late cancels nothing after it.
type stallWatch struct {
	bound  time.Duration
	clock  clock.Clock
	cancel context.CancelCauseFunc // the attempt's
	timer  clock.Timer             // made at the first arm
	fired  atomic.Bool
}

// watchStalls watches the attempt that cancel ends, within bound on c.
func watchStalls(bound time.Duration, c clock.Clock, cancel context.CancelCauseFunc) *stallWatch {
	return &stallWatch{bound: bound, clock: c, cancel: cancel}
}

// arm starts the bound again: the answer is held, and a byte just came.
func (s *stallWatch) arm() {
	switch {
	case s == nil:
	case s.timer == nil:
		s.timer = s.clock.AfterFunc(s.bound, func() {
			s.fired.Store(true)
			s.cancel(errStalled)
		})
	default:
		s.timer.Reset(s.bound)
	}
}

// disarm stops watching: the answer streams, or the attempt ended.
func (s *stallWatch) disarm() {
	if s != nil && s.timer != nil {
		s.timer.Stop()
	}
}

// stalled reports whether the watch ended its attempt.
func (s *stallWatch) stalled() bool { return s != nil && s.fired.Load() }
