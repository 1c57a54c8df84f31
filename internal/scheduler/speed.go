package scheduler

import (
	"math"
	"slices"
	"time"
)

// SpeedWindow is how many recent jobs a worker's speed is the median of: a
// stalled job or two moves the median hardly at all.
const SpeedWindow = 31

// SpeedStep bounds what one job says of its worker's speed: a job that ran
// longer than predicted counts as at most SpeedStep times slower than its
// prediction, and once a worker has a speed, one job moves it by at most a
// factor of SpeedStep either way. A job far over its prediction is more
// often one the router misjudged (a field it did not read), a stall or a
// cold start than a slower GPU; taken at its word as a worker's first job,
// it would set that worker's speed, and through the pool's median the
// speed assumed for every new worker. A worker that really slows down is
// still followed: each job moves its speed by up to SpeedStep, and the
// median follows once most of the window is slow.
const SpeedStep = 4

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
	value   float64 // median of the samples, moved at most SpeedStep a job; 0 until the first
	relErr  float64 // moving average of |predicted - actual| / actual
	errSeen bool
	n       int // samples taken, up to SpeedWindow
	next    int
	samples *speedSamples // apart, to keep a worker's hot fields small
}

// speedSamples are a worker's last SpeedWindow samples, in the order they
// came and in order of size, so that a job's end finds their median
// without sorting them.
type speedSamples struct {
	byArrival [SpeedWindow]float64
	bySize    [SpeedWindow]float64 // the first n of them, ascending
}

// replace puts sample in the place of old among the first n by size
// (n+1 of them after, when old is not among them: the window was not
// full).
func (ss *speedSamples) replace(old, sample float64, n int, full bool) {
	sized := ss.bySize[:n]
	if full {
		i, _ := slices.BinarySearch(sized, old)
		sized = slices.Delete(sized, i, i+1)
	}
	i, _ := slices.BinarySearch(sized, sample)
	sized = append(sized, 0) // within bySize
	copy(sized[i+1:], sized[i:])
	sized[i] = sample
}

// Observe learns from a job of cost that ran for elapsed, having been
// predicted to take predicted (0: no prediction).
func (s *SpeedEstimate) Observe(cost float64, elapsed, predicted time.Duration) {
	if cost <= 0 || elapsed <= 0 {
		return
	}
	s.noteError(elapsed, predicted)
	sample := cost / elapsed.Seconds()
	if predicted > 0 {
		// Only the slow side is bounded by the prediction: a prediction may
		// rest on nothing but the pool's first guess, 1 unit a second, and
		// GPUs run tens, which a worker's first job should teach at once.
		sample = max(sample, cost/predicted.Seconds()/SpeedStep)
	}
	if s.samples == nil {
		s.samples = new(speedSamples)
	}
	sample = min(max(sample, minSpeed), maxSpeed)
	full := s.n == SpeedWindow
	s.samples.replace(s.samples.byArrival[s.next], sample, s.n, full)
	s.samples.byArrival[s.next] = sample
	s.next = (s.next + 1) % SpeedWindow
	s.n = min(s.n+1, SpeedWindow)
	median := s.samples.bySize[s.n/2]
	if s.value > 0 {
		median = min(max(median, s.value/SpeedStep), s.value*SpeedStep)
	}
	s.value = median
}

// noteError folds a job's prediction error into the moving average.
func (s *SpeedEstimate) noteError(elapsed, predicted time.Duration) {
	if predicted <= 0 {
		return
	}
	e := math.Abs(float64(predicted-elapsed)) / float64(elapsed)
	if s.errSeen {
		s.relErr += (e - s.relErr) / 8
	} else {
		s.relErr, s.errSeen = e, true
	}
}

// Value is the learned speed, in cost units per second; 0 until a job
// has completed.
func (s *SpeedEstimate) Value() float64 { return s.value }

// RelErr is the moving average of |predicted - actual| / actual job time.
func (s *SpeedEstimate) RelErr() float64 { return s.relErr }

// Samples is how many jobs the estimate rests on, up to SpeedWindow.
func (s *SpeedEstimate) Samples() int { return s.n }

// speedOfLocked is w's learned speed, or the pool's median speed while w has
// completed nothing.
func (d *dispatchState) speedOfLocked(w *worker) float64 {
	if w.load.speed.Value() > 0 {
		return w.load.speed.Value()
	}
	return d.defaultSpeed
}

// DefaultInitialSpeed is the speed, in cost units per second, assumed for
// every worker until one has completed a job: a 20-step 1024x1024 image in
// 20 s, slower than an H100 runs FLUX (6.7 s an image), so that the first
// jobs are not declared late on a guess.
const DefaultInitialSpeed = 1

// SetInitialSpeed sets the speed, in cost units per second, assumed for
// every worker while none of the pool's workers has completed a job; the
// config loaded last sets it.
func (p *Pool) SetInitialSpeed(speed float64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.initialSpeed = speed
	p.refreshDefaultSpeedLocked()
}

// refreshDefaultSpeedLocked sets the speed assumed for new workers to the
// median of the learned ones, or the initial speed while there are none.
func (p *Pool) refreshDefaultSpeedLocked() {
	speeds := p.speeds[:0]
	for _, w := range p.workers {
		if w.load.speed.Value() > 0 {
			speeds = append(speeds, w.load.speed.Value())
		}
	}
	p.speeds = speeds
	if len(speeds) == 0 {
		p.defaultSpeed = p.initialSpeed
		return
	}
	slices.Sort(speeds)
	p.defaultSpeed = speeds[len(speeds)/2]
}

// maxPrediction bounds a predicted time, so that no prediction overflows
// a time.Duration or an end time.
const maxPrediction = 30 * 24 * time.Hour

// timeForLocked is how long w is predicted to take over work of cost.
func (d *dispatchState) timeForLocked(w *worker, cost float64) time.Duration {
	return time.Duration(min(cost/d.speedOfLocked(w), maxPrediction.Seconds()) * float64(time.Second))
}

// workLeftLocked is the predicted cost w still has to process at now (Unix
// nanoseconds): its jobs' costs, less what the running one has done.
func (d *dispatchState) workLeftLocked(w *worker, now int64) float64 {
	if w.load.inflight == 0 {
		return 0
	}
	done := float64(now-w.load.headSince) / float64(time.Second) * d.speedOfLocked(w)
	return w.load.work - min(w.load.headCost, max(0, done))
}
