package attempt

import "time"

// Clock is the time the timers of attempts run on: the hedges' and the
// stall watches'. Tests give their own.
type Clock interface {
	Now() time.Time
	// AfterFunc calls f in its own goroutine once d has passed.
	AfterFunc(d time.Duration, f func()) Timer
}

// Timer is a Clock's timer, as *time.Timer is one.
type Timer interface {
	Reset(d time.Duration) bool
	Stop() bool
}

// realClock is the wall clock.
type realClock struct{}

func (realClock) Now() time.Time { return time.Now() }

func (realClock) AfterFunc(d time.Duration, f func()) Timer { return time.AfterFunc(d, f) }
