// Package clock is the time the router's timers run on. The router runs
// on the wall clock; tests and the scheduler's simulation (cmd/bench
// --mode schedule) run it on a Virtual one, whose time moves only when
// its owner says, so that a run of hours takes the CPU time of its
// decisions and never depends on how loaded the machine is.
package clock

import "time"

// Clock tells the time and runs functions after a while.
type Clock interface {
	Now() time.Time
	// AfterFunc calls f once d has passed, as time.AfterFunc does; f
	// must not expect to run on any particular goroutine.
	AfterFunc(d time.Duration, f func()) Timer
}

// Timer is a Clock's timer, as *time.Timer is one.
type Timer interface {
	// Reset makes the timer fire d from now, whether it fired, was
	// stopped or is pending; it reports whether it was pending.
	Reset(d time.Duration) bool
	// Stop keeps the timer from firing; it reports whether it was
	// pending.
	Stop() bool
}

// Real is the wall clock.
var Real Clock = wall{}

type wall struct{}

func (wall) Now() time.Time { return time.Now() }

func (wall) AfterFunc(d time.Duration, f func()) Timer { return time.AfterFunc(d, f) }
