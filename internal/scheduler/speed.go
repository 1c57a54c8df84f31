package scheduler

import (
	"math"
	"slices"
	"time"
)

// SpeedWindow is how many recent jobs a worker's speed is the median of: a
// stalled job or two moves the median hardly at all.
const SpeedWindow = 31

// A learned speed stays within these bounds, in cost units per second: far
// beyond any GPU (a 1024x1024 image step takes a GPU tens of milliseconds
// at the least) and far below one that works at all.
const (
	minSpeed = 1e-4
	maxSpeed = 1e6
)

// SpeedEstimate learns how fast a worker turns cost into time, in cost
// units per second, from the jobs it completes.
type SpeedEstimate struct {
	value   float64 // median of the samples; 0 until the first
	relErr  float64 // moving average of |predicted - actual| / actual
	errSeen bool
	n       int // samples taken, up to SpeedWindow
	next    int
	samples *[SpeedWindow]float64 // apart, to keep a worker's hot fields small
}

// Observe learns from a job of cost that ran for elapsed, having been
// predicted to take predicted.
func (s *SpeedEstimate) Observe(cost float64, elapsed, predicted time.Duration) {
	if cost <= 0 || elapsed <= 0 {
		return
	}
	if predicted > 0 {
		e := math.Abs(float64(predicted-elapsed)) / float64(elapsed)
		if s.errSeen {
			s.relErr += (e - s.relErr) / 8
		} else {
			s.relErr, s.errSeen = e, true
		}
	}
	if s.samples == nil {
		s.samples = new([SpeedWindow]float64)
	}
	s.samples[s.next] = min(max(cost/elapsed.Seconds(), minSpeed), maxSpeed)
	s.next = (s.next + 1) % SpeedWindow
	s.n = min(s.n+1, SpeedWindow)
	var sorted [SpeedWindow]float64
	copy(sorted[:], s.samples[:s.n])
	slices.Sort(sorted[:s.n])
	s.value = sorted[s.n/2]
}

// Value is the learned speed, in cost units per second; 0 until a job
// has completed.
func (s *SpeedEstimate) Value() float64 { return s.value }

// RelErr is the moving average of |predicted - actual| / actual job time.
func (s *SpeedEstimate) RelErr() float64 { return s.relErr }

// Samples is how many jobs the estimate rests on, up to SpeedWindow.
func (s *SpeedEstimate) Samples() int { return s.n }
