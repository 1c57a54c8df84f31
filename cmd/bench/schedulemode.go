package main

import (
	"fmt"
	"io"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// schedSeeds are the seeds of the schedule mode's runs; it reports the
// median over them.
var schedSeeds = []uint64{1, 2, 3, 4, 5}

// schedOutcome is what one strategy reached on one fleet, the median over
// the seeds.
type schedOutcome struct {
	strategy      string
	ofEF, ofBound float64       // the batch's makespan ÷ the earliest-finish schedule's, ÷ the lower bound
	minEF, maxEF  float64       // the range of ofEF over the seeds
	mean, p99     float64       // the open loop's wait, seconds
	cpu           time.Duration // the runs of every seed, batch and open loop, on one goroutine
	notRun        string        // why the strategy did not run
}

// benchSchedule runs the schedule mode: for each fleet size of --fleets,
// a batch of --per-worker jobs per worker at once and an open loop at
// --util, through each diffusion_router strategy of --strategies.
func benchSchedule(o options, out io.Writer) {
	fmt.Fprintf(out, "\n== schedule: the router's scheduler alone on a virtual clock (no HTTP, no sleeping), median of seeds %d-%d ==\n",
		schedSeeds[0], schedSeeds[len(schedSeeds)-1])
	fmt.Fprintf(out, "jobs: %s; %d per worker; worker speeds %s repeated; speeds learned from nothing; unit %gms\n",
		describeMix(mixes[o.mix]), o.perWorker, fmtSpeeds(o.speeds), o.unitMs)
	fmt.Fprintf(out, "batch: every job at once; ÷EF = makespan ÷ the earliest-finish schedule's (longest first, each on the worker that ends it first, true times known); ÷bound = ÷ max(longest job on the fastest worker, total cost ÷ total speed)\n")
	fmt.Fprintf(out, "open: as many jobs (at least %d), Poisson arrivals at util %.2f; wait = arrival → its worker begins it; ÷fifo against least_work/fifo's\n\n", o.openJobs, o.util)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "workers\tjobs\tstrategy\tbatch ÷EF\t(range)\t÷bound\topen mean wait\tp99 wait\tmean÷fifo\tp99÷fifo\tCPU\t")
	notes := make(map[string]string)
	for _, n := range o.fleets {
		outcomes := make([]schedOutcome, len(o.strategies))
		for i, s := range o.strategies {
			outcomes[i] = runSchedule(o, s, fleetSpeeds(o.speeds, n))
			if outcomes[i].notRun != "" {
				notes[s.name] = outcomes[i].notRun
			}
		}
		writeScheduleRows(tw, n, n*o.perWorker, outcomes)
	}
	tw.Flush()
	for _, s := range o.strategies {
		if why := notes[s.name]; why != "" {
			fmt.Fprintf(out, "%s not run: %s\n", s.name, why)
			delete(notes, s.name)
		}
	}
}

// fleetSpeeds repeats pattern over n workers.
func fleetSpeeds(pattern []float64, n int) []float64 {
	speeds := make([]float64, n)
	for i := range speeds {
		speeds[i] = pattern[i%len(pattern)]
	}
	return speeds
}

// runSchedule runs strategy s on a fleet of speeds, for each seed a batch
// and an open loop, and returns the medians.
func runSchedule(o options, s strategy, speeds []float64) schedOutcome {
	res := schedOutcome{strategy: s.name}
	newStrategy, order, err := schedStrategy(s)
	if err != nil {
		res.notRun = err.Error()
		return res
	}
	n := len(speeds) * o.perWorker
	unit := time.Duration(o.unitMs * float64(time.Millisecond))
	var ofEF, ofBound, means, p99s []float64
	began := time.Now()
	for _, seed := range schedSeeds {
		jobs := makeJobs(mixes[o.mix], n, seed)
		batch := schedTasks(jobs, nil)
		newSchedSim(speeds, simConfig{newStrategy(), order, unit, defaultHedgeAfter, ""}, n).run(batch)
		last, _ := makespan(batch)
		span := last.Seconds()
		costs := taskCosts(batch)
		ofEF = append(ofEF, span/earliestFinish(costs, speeds, unit).Seconds())
		ofBound = append(ofBound, span/(batchBound(jobs, speeds)*unit.Seconds()))

		stream := makeJobs(mixes[o.mix], max(n, o.openJobs), seed)
		arrivals := poissonArrivals(len(stream), arrivalRate(mixes[o.mix], speeds, o.unitMs, o.util), seed)
		open := schedTasks(stream, arrivals)
		newSchedSim(speeds, simConfig{newStrategy(), order, unit, defaultHedgeAfter, ""}, len(open)).run(open)
		w := summarize(waits(open))
		means, p99s = append(means, w.mean), append(p99s, w.p99)
	}
	res.cpu = time.Since(began)
	res.ofEF, res.ofBound, res.mean, res.p99 = median(ofEF), median(ofBound), median(means), median(p99s)
	res.minEF, res.maxEF = slices.Min(ofEF), slices.Max(ofEF)
	return res
}

// schedStrategy is the pool's strategy and queue order for s, as
// diffusion_router would configure them.
func schedStrategy(s strategy) (func() scheduler.Strategy, scheduler.QueueOrder, error) {
	if s.caddy != "" || s.routers > 1 {
		return nil, nil, fmt.Errorf("the schedule mode runs diffusion_router's scheduler, one pool")
	}
	newStrategy, ok := scheduler.Strategies[s.policy]
	if !ok {
		return nil, nil, fmt.Errorf("no policy %q (want one of %s)", s.policy, scheduler.StrategyNames())
	}
	name := s.order
	if name == "" {
		name = scheduler.DefaultQueueOrder
	}
	order, ok := scheduler.QueueOrders[name]
	if !ok {
		return nil, nil, fmt.Errorf("no queue_order %q", s.order)
	}
	return newStrategy, order, nil
}

// defaultHedgeAfter is the router's hedge_after: its stall_factor's
// default (reference.md).
const defaultHedgeAfter = 5

// taskCosts is the costs of tasks.
func taskCosts(tasks []*schedTask) []float64 {
	costs := make([]float64, len(tasks))
	for i, t := range tasks {
		costs[i] = t.cost
	}
	return costs
}

// median is the middle value of xs (the lower of the two middle ones).
func median(xs []float64) float64 {
	sorted := slices.Sorted(slices.Values(xs))
	return sorted[(len(sorted)-1)/2]
}

// writeScheduleRows writes one fleet's outcomes, the open loop's waits
// also as ratios to least_work/fifo's when it ran.
func writeScheduleRows(tw io.Writer, workers, jobs int, outcomes []schedOutcome) {
	var fifo *schedOutcome
	for i := range outcomes {
		if outcomes[i].strategy == "least_work/fifo" {
			fifo = &outcomes[i]
		}
	}
	for _, r := range outcomes {
		if r.notRun != "" {
			fmt.Fprintf(tw, "%d\t%d\t%s\tnot run\t\t\t\t\t\t\t\t\n", workers, jobs, r.strategy)
			continue
		}
		meanRatio, p99Ratio := "-", "-"
		if fifo != nil {
			meanRatio, p99Ratio = fmt.Sprintf("%.3f", r.mean/fifo.mean), fmt.Sprintf("%.3f", r.p99/fifo.p99)
		}
		fmt.Fprintf(tw, "%d\t%d\t%s\t%.3f\t%.3f-%.3f\t%.3f\t%s\t%s\t%s\t%s\t%s\t\n", workers, jobs, r.strategy,
			r.ofEF, r.minEF, r.maxEF, r.ofBound, fmtSeconds(r.mean), fmtSeconds(r.p99), meanRatio, p99Ratio, fmtSeconds(r.cpu.Seconds()))
	}
}
