package scheduler

import (
	"math/rand/v2"
	"slices"
	"strings"
)

// A Job is what a strategy or a queue order may read of a job.
type Job struct {
	Cost float64 // predicted work, in cost units
	Seq  uint64  // arrival order in the pool's queue

	// What a queue order may weigh: when the job arrived, in seconds on
	// the pool's clock; how long it is predicted to run on a worker of
	// the pool's median speed, in seconds; and whether the queue is long
	// (see Adaptive).
	Arrived float64
	Runs    float64
	Long    bool
}

// A Candidate is a worker that may take a job now, as a strategy sees it:
// a copy, so that a strategy reads the pool but cannot change it.
type Candidate struct {
	URL      string
	Inflight int     // jobs in flight
	WorkLeft float64 // predicted cost units still to process
	Speed    float64 // learned cost units per second; the pool's median while unknown
}

// FinishTime is how long c would take to finish its work and then a job of
// cost, in seconds.
func (c *Candidate) FinishTime(cost float64) float64 {
	return (c.WorkLeft + cost) / c.Speed
}

// A Strategy chooses the worker for a job among candidates that may all
// take it now, and returns the index of its choice. It runs under the
// pool's lock on every decision: it must be quick and must not block.
type Strategy interface {
	Pick(job Job, cands []Candidate) int
}

// Strategies makes the strategy of each `policy` value. Each config gets
// its own, so that a strategy with state (round robin's turn) keeps it to
// itself; the config's pool lock guards it.
var Strategies = map[string]func() Strategy{
	"least_work":    func() Strategy { return LeastWork{} },
	"least_request": func() Strategy { return LeastRequest{} },
	"round_robin":   func() Strategy { return new(RoundRobin) },
	"random":        func() Strategy { return Random{} },
}

// DefaultStrategy is the policy when a config names none.
const DefaultStrategy = "least_work"

// StrategyNames lists the valid `policy` values, for error messages.
func StrategyNames() string {
	names := make([]string, 0, len(Strategies))
	for n := range Strategies {
		names = append(names, n)
	}
	slices.Sort(names)
	return strings.Join(names, ", ")
}

// LeastWork gives the job to the worker that will finish it soonest: the
// least (predicted work left + the job's cost) / learned speed. Exact ties,
// as among idle workers of one speed, are broken at random.
type LeastWork struct{}

// Pick implements Strategy.
func (LeastWork) Pick(job Job, cands []Candidate) int {
	return argmin(job, cands, func(c *Candidate) float64 { return c.FinishTime(job.Cost) })
}

// LeastRequest picks the worker with the fewest jobs in flight, breaking
// ties at random so idle workers share the load evenly.
type LeastRequest struct{}

// Pick implements Strategy.
func (LeastRequest) Pick(job Job, cands []Candidate) int {
	return argmin(job, cands, func(c *Candidate) float64 { return float64(c.Inflight) })
}

// RoundRobin cycles through the candidates in pool order.
type RoundRobin struct {
	turn int
}

// Pick implements Strategy.
func (s *RoundRobin) Pick(_ Job, cands []Candidate) int {
	s.turn++
	return s.turn % len(cands)
}

// Random picks a candidate uniformly at random.
type Random struct{}

// Pick implements Strategy.
func (Random) Pick(_ Job, cands []Candidate) int {
	return rand.IntN(len(cands))
}

// argmin returns the index of the candidate with the least score. The scan
// starts at a place drawn from the job's arrival number, so that among
// equal scores (idle workers of one speed) each gets its share, as at
// random, and the same jobs on the same fleet are placed the same way: a
// simulation can be replayed, and two queue orders compared on it.
func argmin(job Job, cands []Candidate, score func(*Candidate) float64) int {
	start := int(spread(job.Seq) % uint64(len(cands)))
	best, bestScore := start, score(&cands[start])
	for i := start + 1; i < start+len(cands); i++ {
		j := i
		if j >= len(cands) {
			j -= len(cands)
		}
		if s := score(&cands[j]); s < bestScore {
			best, bestScore = j, s
		}
	}
	return best
}

// spread scatters consecutive numbers over the whole range (SplitMix64's
// finalizer).
func spread(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}

// A QueueOrder ranks waiting jobs: the lower a job's key, the sooner it
// gets a worker; equal keys go in arrival order.
type QueueOrder interface {
	Key(job Job) float64
}

// QueueOrders is the queue order of each `queue_order` value.
var QueueOrders = map[string]QueueOrder{
	"adaptive":       Adaptive{},
	"fifo":           FIFO{},
	"largest_first":  LargestFirst{},
	"smallest_first": SmallestFirst{},
}

// DefaultQueueOrder is the queue order when a config names none.
const DefaultQueueOrder = "adaptive"

// FIFO hands out jobs in arrival order.
type FIFO struct{}

// Key implements QueueOrder.
func (FIFO) Key(Job) float64 { return 0 }

// LargestFirst hands out the longest job first: the batch makespan rule
// (longest processing time first keeps a batch within 4/3 of the best).
type LargestFirst struct{}

// Key implements QueueOrder.
func (LargestFirst) Key(job Job) float64 { return -job.Cost }

// Adaptive hands out jobs in arrival order while the queue is short, and
// once it is long, each job as if it had come as long before it did as
// it runs: the larger first among jobs that came together. The queue is
// long once it holds more than longQueue of the largest jobs that came
// since it was last empty per worker, and stays long until it empties.
//
// A batch, a rollout step, arrives at once and makes the queue long early
// on, so its jobs go largest first, the rule that ends a batch soonest:
// in arrival order, a large job handed out near the end ends last, on
// whatever worker is free. A stream of jobs at a load the fleet keeps up
// with hardly ever makes it long, so it is served in arrival order, the
// rule of the least waiting. No job waits for ever: it is passed only by
// jobs that came at most as long after it as they run.
type Adaptive struct{}

// Key implements QueueOrder.
func (Adaptive) Key(job Job) float64 {
	if job.Long {
		return job.Arrived - job.Runs
	}
	return job.Arrived
}

// SmallestFirst hands out the shortest job first: the mean latency rule.
type SmallestFirst struct{}

// Key implements QueueOrder.
func (SmallestFirst) Key(job Job) float64 { return job.Cost }
