package scheduler

import (
	"testing"
	"time"
)

func TestSpeedLearningConvergesAndIgnoresAStall(t *testing.T) {
	var s SpeedEstimate
	// A worker that turns 4 units into a second, with ±10% noise.
	for i := range 20 {
		noise := 1 + 0.1*float64(i%3-1)
		s.Observe(8, time.Duration(2*noise*float64(time.Second)), 0)
	}
	if s.value < 3.6 || s.value > 4.4 {
		t.Fatalf("learned speed %v; want about 4", s.value)
	}
	before := s.value
	s.Observe(8, 200*time.Second, 2*time.Second) // one job stalled for 100x its time
	if s.value < before*0.9 {
		t.Fatalf("one stalled job moved the speed from %v to %v", before, s.value)
	}
	// The worker really slows down (another model, a throttled GPU): the
	// estimate follows within a window.
	for range SpeedWindow {
		s.Observe(8, 8*time.Second, 0)
	}
	if s.value != 1 {
		t.Fatalf("speed after slowing down: %v; want 1", s.value)
	}
}

func TestPredictionErrorTracked(t *testing.T) {
	var s SpeedEstimate
	s.Observe(10, 2*time.Second, time.Second) // predicted half the real time
	if s.relErr != 0.5 {
		t.Fatalf("relative error %v; want 0.5", s.relErr)
	}
	for range 50 {
		s.Observe(10, 2*time.Second, 2*time.Second)
	}
	if s.relErr > 0.01 {
		t.Fatalf("relative error %v after exact predictions; want near 0", s.relErr)
	}
}
