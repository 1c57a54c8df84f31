package diffusionrouter

import (
	"math"
	"slices"
	"time"
)

// speedWindow is how many recent jobs a worker's speed is the median of: a
// stalled job or two moves the median hardly at all.
const speedWindow = 31

// A learned speed stays within these bounds, in cost units per second: far
// beyond any GPU (a 1024x1024 image step takes a GPU tens of milliseconds
// at the least) and far below one that works at all.
const (
	minSpeed = 1e-4
	maxSpeed = 1e6
)

// speedEstimate learns how fast a worker turns cost into time, in cost
// units per second, from the jobs it completes.
type speedEstimate struct {
	value   float64 // median of the samples; 0 until the first
	relErr  float64 // moving average of |predicted - actual| / actual
	errSeen bool
	n       int // samples taken, up to speedWindow
	next    int
	samples *[speedWindow]float64 // apart, to keep a worker's hot fields small
}

// observe learns from a job of cost that ran for elapsed, having been
// predicted to take predicted.
func (s *speedEstimate) observe(cost float64, elapsed, predicted time.Duration) {
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
		s.samples = new([speedWindow]float64)
	}
	s.samples[s.next] = min(max(cost/elapsed.Seconds(), minSpeed), maxSpeed)
	s.next = (s.next + 1) % speedWindow
	s.n = min(s.n+1, speedWindow)
	var sorted [speedWindow]float64
	copy(sorted[:], s.samples[:s.n])
	slices.Sort(sorted[:s.n])
	s.value = sorted[s.n/2]
}
