package main

import (
	"cmp"
	"math"
	"slices"
)

// simJob is a job for the simulator: when it arrives and how long it takes
// on a worker of speed 1, in any one time unit (the bench uses seconds).
type simJob struct {
	arrival float64
	work    float64
}

// simResult is what the simulator did with one job.
type simResult struct {
	worker        int // index into speeds
	start, finish float64
}

// queueOrder picks which waiting job a freed worker takes next: it returns
// the index in waiting, whose jobs are in arrival order.
type queueOrder func(jobs []simJob, waiting []int) int

// fifoOrder takes the job that arrived first.
func fifoOrder([]simJob, []int) int { return 0 }

// largestFirst takes the job with the most work; the earliest on ties.
// Over a batch that all arrives at once this is LPT scheduling.
func largestFirst(jobs []simJob, waiting []int) int {
	best := 0
	for i, j := range waiting {
		if jobs[j].work > jobs[waiting[best]].work {
			best = i
		}
	}
	return best
}

// simulate is the ideal router as a discrete-event simulation: one central
// queue, perfect knowledge of work and speeds, no overhead. Whenever a
// worker is free and a job waits, the worker takes the job order chooses;
// when several workers are free at once, the fastest (then the first in
// speeds) goes first. Results are in the order of jobs.
func simulate(jobs []simJob, speeds []float64, order queueOrder) []simResult {
	res := make([]simResult, len(jobs))
	byArrival := make([]int, len(jobs))
	for i := range byArrival {
		byArrival[i] = i
	}
	slices.SortStableFunc(byArrival, func(a, b int) int {
		return cmp.Compare(jobs[a].arrival, jobs[b].arrival)
	})
	freeAt := make([]float64, len(speeds))
	byFastest := workersByFastest(speeds)

	var waiting []int
	next, done := 0, 0
	now := 0.0
	if len(jobs) > 0 {
		now = jobs[byArrival[0]].arrival
	}
	for done < len(jobs) {
		for next < len(jobs) && jobs[byArrival[next]].arrival <= now {
			waiting = append(waiting, byArrival[next])
			next++
		}
		for _, w := range byFastest {
			if len(waiting) == 0 {
				break
			}
			if freeAt[w] > now {
				continue
			}
			k := order(jobs, waiting)
			j := waiting[k]
			waiting = slices.Delete(waiting, k, k+1)
			res[j] = simResult{worker: w, start: now, finish: now + jobs[j].work/speeds[w]}
			freeAt[w] = res[j].finish
			done++
		}
		now = nextEvent(now, freeAt, jobs, byArrival, next, len(waiting) > 0)
	}
	return res
}

// nextEvent is the next time something can happen after now: the next
// arrival, or, while jobs wait, the next worker to free up.
func nextEvent(now float64, freeAt []float64, jobs []simJob, byArrival []int, next int, jobsWaiting bool) float64 {
	t := math.Inf(1)
	if next < len(jobs) {
		t = jobs[byArrival[next]].arrival
	}
	if jobsWaiting {
		for _, f := range freeAt {
			if f <= now { // a zero-work job just ended: dispatch again now
				return now
			}
			t = min(t, f)
		}
	}
	return t
}

// workersByFastest returns worker indices, fastest first, stable on ties.
func workersByFastest(speeds []float64) []int {
	idx := make([]int, len(speeds))
	for i := range idx {
		idx[i] = i
	}
	slices.SortStableFunc(idx, func(a, b int) int { return cmp.Compare(speeds[b], speeds[a]) })
	return idx
}
