package scheduler

import (
	"math"
	"math/rand/v2"
	"slices"
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

// seconds is a duration of s seconds.
func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// A job 150 times longer than predicted (a hidden num_inference_steps, a
// stall) moves its worker's speed by at most SpeedStep, first job or not.
func TestOneOverrunMovesSpeedAtMostOneStep(t *testing.T) {
	var first SpeedEstimate
	first.Observe(8, seconds(300), seconds(2)) // predicted 4 units/s; ran at 8/300
	if want := 4.0 / SpeedStep; first.Value() != want {
		t.Fatalf("a first job 150x over its prediction set the speed to %v; want %v, the prediction's speed / SpeedStep", first.Value(), want)
	}

	var s SpeedEstimate
	for range 20 {
		s.Observe(8, seconds(2), seconds(2))
	}
	s.Observe(8, seconds(300), seconds(2))
	if s.Value() != 4 {
		t.Fatalf("one overrun among 21 jobs moved the speed from 4 to %v", s.Value())
	}
	// However the jobs go, one moves a learned speed by at most SpeedStep.
	var r SpeedEstimate
	r.Observe(1, time.Second, 0)
	for i := range 500 {
		before := r.Value()
		elapsed := seconds(math.Pow(10, float64(i%9-4))) // 0.1 ms to 10000 s
		r.Observe(1+float64(i%5), elapsed, seconds(float64(i%3)))
		if ratio := r.Value() / before; ratio > SpeedStep*(1+1e-12) || ratio < 1/SpeedStep*(1-1e-12) {
			t.Fatalf("job %d moved the speed from %v to %v", i, before, r.Value())
		}
	}
}

// The bound costs no learning: a fast GPU is learned on its first job,
// however slow the guess it was predicted by, and a worker that really
// slows down is followed within the window.
func TestSpeedStillLearnsRealChanges(t *testing.T) {
	var s SpeedEstimate
	s.Observe(100, seconds(1), seconds(100)) // the pool's first guess: 1 unit/s
	if s.Value() != 100 {
		t.Fatalf("first job at 100 units/s learned as %v", s.Value())
	}
	for i := range SpeedWindow {
		predicted := seconds(100 / s.Value())
		s.Observe(100, seconds(10), predicted) // now 10 units/s, predicted from what was learned
		if i == SpeedWindow-1 && s.Value() != 10 {
			t.Fatalf("after %d jobs at 10 units/s the speed is %v", SpeedWindow, s.Value())
		}
	}
}

// The speed is the median of the last SpeedWindow samples, moved at most
// SpeedStep a job, however the samples come and go.
func TestSpeedIsTheMedianOfTheLastSamples(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var s SpeedEstimate
	var last []float64
	var before float64
	for i := range 500 {
		speed := []float64{1, 2, 3, 2, 2}[rng.IntN(5)] * (1 + rng.Float64()/10)
		took := time.Duration(10 / speed * float64(time.Second))
		s.Observe(10, took, 0)
		last = append(last, 10/took.Seconds())
		if len(last) > SpeedWindow {
			last = last[1:]
		}
		sorted := slices.Sorted(slices.Values(last))
		want := sorted[len(sorted)/2]
		if i > 0 {
			want = min(max(want, before/SpeedStep), before*SpeedStep)
		}
		if math.Abs(s.value-want) > 1e-9*want {
			t.Fatalf("after %d samples the speed is %v; want %v", i+1, s.value, want)
		}
		before = s.value
	}
}
