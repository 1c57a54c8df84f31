package main

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
)

// job is one image generation request: POST /v1/images/generations with
// this size and step count.
type job struct {
	width, height, steps int
}

// cost is the job's work in units of one 1024×1024 image denoised for one
// step, as the fake worker counts it.
func (j job) cost() float64 { return fakeworker.Cost(j.width, j.height, j.steps, 1, 1) }

func (j job) size() string { return fmt.Sprintf("%dx%d", j.width, j.height) }

func (j job) String() string { return fmt.Sprintf("%s/%d", j.size(), j.steps) }

// request is the body of the i-th request for j, asking for base64 as real
// clients do (sglang's default, "url", needs cloud storage).
func (j job) request(i int) map[string]any {
	return map[string]any{
		"prompt":              fmt.Sprintf("bench prompt %d", i),
		"size":                j.size(),
		"num_inference_steps": j.steps,
		"response_format":     "b64_json",
	}
}

// lightJob is the lightest real generation request, for the overhead mode:
// its cost is 1/1024² of a unit, so the worker's service time is nil and
// what is measured is the HTTP path.
var lightJob = job{1, 1, 1}

// share is one kind of job of a mix and its share in percent.
type share struct {
	job     job
	percent int
}

// mixes are the workloads --mix names. Each adds up to 100%.
var mixes = map[string][]share{
	"uniform": {
		{job{1024, 1024, 20}, 100},
	},
	"mixed": {
		{job{512, 512, 20}, 50},
		{job{1024, 1024, 30}, 30},
		{job{1024, 1024, 50}, 15},
		{job{2048, 2048, 50}, 5},
	},
	"heavy": {
		{job{512, 512, 8}, 90},
		{job{1536, 1536, 50}, 10},
	},
}

// mixNames lists the valid --mix values.
func mixNames() string {
	names := make([]string, 0, len(mixes))
	for n := range mixes {
		names = append(names, n)
	}
	slices.Sort(names)
	return strings.Join(names, "|")
}

// meanCost is the expected cost of one job drawn from the mix.
func meanCost(mix []share) float64 {
	var sum float64
	for _, s := range mix {
		sum += s.job.cost() * float64(s.percent) / 100
	}
	return sum
}

// describeMix reads like "90% 512x512/8, 10% 1536x1536/50 (mean cost 13.05)".
func describeMix(mix []share) string {
	parts := make([]string, len(mix))
	for i, s := range mix {
		parts[i] = fmt.Sprintf("%d%% %s", s.percent, s.job)
	}
	return fmt.Sprintf("%s (size/steps; mean cost %.4g units)", strings.Join(parts, ", "), meanCost(mix))
}

// makeJobs returns n jobs in exactly the mix's proportions (rounded by
// largest remainder), in an order shuffled by seed. The same arguments give
// the same sequence.
func makeJobs(mix []share, n int, seed uint64) []job {
	counts := apportion(mix, n)
	jobs := make([]job, 0, n)
	for i, s := range mix {
		for range counts[i] {
			jobs = append(jobs, s.job)
		}
	}
	rng := rand.New(rand.NewPCG(seed, 1))
	rng.Shuffle(len(jobs), func(i, j int) { jobs[i], jobs[j] = jobs[j], jobs[i] })
	return jobs
}

// apportion splits n over the mix's percentages: the floor of each share,
// then one more to the largest remainders (earlier kinds first on ties).
func apportion(mix []share, n int) []int {
	counts := make([]int, len(mix))
	rems := make([]int, len(mix))
	left := n
	for i, s := range mix {
		counts[i] = n * s.percent / 100
		rems[i] = n * s.percent % 100
		left -= counts[i]
	}
	order := make([]int, len(mix))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(a, b int) bool { return rems[order[a]] > rems[order[b]] })
	for i := 0; left > 0; i = (i + 1) % len(order) {
		counts[order[i]]++
		left--
	}
	return counts
}

// poissonArrivals returns n arrival offsets from the start of a run, with
// exponential gaps of mean 1/rate seconds, drawn with seed. The first job
// arrives at 0.
func poissonArrivals(n int, rate float64, seed uint64) []time.Duration {
	rng := rand.New(rand.NewPCG(seed, 2))
	out := make([]time.Duration, n)
	var t float64
	for i := range out {
		out[i] = time.Duration(t * float64(time.Second))
		t += rng.ExpFloat64() / rate
	}
	return out
}

// arrivalRate is the request rate, per second, at which the mix offers
// util × the fleet's capacity: capacity is sum(speeds) cost units per
// unitMs milliseconds.
func arrivalRate(mix []share, speeds []float64, unitMs, util float64) float64 {
	capacity := sum(speeds) * 1000 / unitMs // cost units per second
	return util * capacity / meanCost(mix)
}

// warmupSeed derives the seed of the warm-up jobs, so they differ from the
// measured ones but are the same for every strategy.
func warmupSeed(seed uint64) uint64 { return seed ^ 0x5eed }

// batchBound is the lower bound on a batch's makespan, in cost units at
// speed 1: max(longest job on the fastest worker, total cost / total speed).
func batchBound(jobs []job, speeds []float64) float64 {
	var total, longest float64
	for _, j := range jobs {
		total += j.cost()
		longest = max(longest, j.cost())
	}
	return math.Max(longest/slices.Max(speeds), total/sum(speeds))
}

func sum(xs []float64) float64 {
	var s float64
	for _, x := range xs {
		s += x
	}
	return s
}
