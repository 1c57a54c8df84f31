package main

import (
	"fmt"
	"io"
	"math"
	"text/tabwriter"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// hangOutcome is what a batch reached with hung workers, with hedges off
// or on, the median over the seeds.
type hangOutcome struct {
	hedgeAfter  float64
	ofEF        float64 // makespan ÷ the earliest-finish schedule's of the same jobs; +Inf: jobs never answered
	unanswered  int     // jobs the run ended without answering (most over the seeds)
	launched    float64 // hedged copies launched
	won         float64 // copies whose answer the client got
	stallReruns float64 // jobs run again after their answer stalled
}

// benchScheduleHang runs the schedule mode's batch with hung workers
// (--hang): for each fleet size and strategy, with hedge_after off and
// at the router's default.
func benchScheduleHang(o options, out io.Writer) {
	fmt.Fprintf(out, "\n== schedule, hung workers: the router's scheduler and attempts on a virtual clock, median of seeds %d-%d ==\n",
		schedSeeds[0], schedSeeds[len(schedSeeds)-1])
	fmt.Fprintf(out, "jobs: %s; a batch of %d per worker at once; worker speeds %s repeated; unit %gms\n",
		describeMix(mixes[o.mix]), o.perWorker, fmtSpeeds(o.speeds), o.unitMs)
	fmt.Fprintf(out, "hung: worker 0 of every %d hangs after its first job, its /health answering: %s\n", hangEvery, hangDescriptions[o.hang])
	fmt.Fprintf(out, "÷EF = makespan ÷ the earliest-finish schedule's (healthy workers only); never: a job was not answered within %s\n\n", simHorizon)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "workers\tjobs\tstrategy\thedge_after\tbatch ÷EF\tunanswered\tcopies\tcopies won\tstall re-runs\t")
	for _, n := range o.fleets {
		speeds := fleetSpeeds(o.speeds, n)
		for _, s := range o.strategies {
			for _, after := range []float64{0, defaultHedgeAfter} {
				r, err := runHang(o, s, speeds, after)
				if err != nil {
					fmt.Fprintf(tw, "%d\t%d\t%s\tnot run: %v\t\t\t\t\t\t\n", n, n*o.perWorker, s.name, err)
					continue
				}
				fmt.Fprintf(tw, "%d\t%d\t%s\t%s\t%s\t%d\t%g\t%g\t%g\t\n", n, n*o.perWorker, s.name, fmtHedgeAfter(after),
					fmtHangRatio(r.ofEF), r.unanswered, r.launched, r.won, r.stallReruns)
			}
		}
	}
	tw.Flush()
}

var hangDescriptions = map[string]string{
	hangSilent: "silent (it answers no more: the job it is on never ends)",
	hangStall:  "stall (each answer stops halfway: the header and half the body)",
}

// runHang runs strategy s's batch on speeds, with hedge_after after (0:
// off), for each seed.
func runHang(o options, s strategy, speeds []float64, after float64) (hangOutcome, error) {
	res := hangOutcome{hedgeAfter: after}
	newStrategy, order, err := schedStrategy(s)
	if err != nil {
		return res, err
	}
	n := len(speeds) * o.perWorker
	unit := time.Duration(o.unitMs * float64(time.Millisecond))
	healthy := healthySpeeds(speeds)
	var ofEF, launched, won, stalls []float64
	for _, seed := range schedSeeds {
		batch := schedTasks(makeJobs(mixes[o.mix], n, seed), nil)
		sim := newSchedSim(speeds, simConfig{newStrategy(), order, unit, after, o.hang}, n)
		sim.run(batch)
		last, unanswered := makespan(batch)
		ratio := last.Seconds() / earliestFinish(taskCosts(batch), healthy, unit).Seconds()
		if unanswered > 0 {
			ratio = math.Inf(1)
		}
		res.unanswered = max(res.unanswered, unanswered)
		ofEF = append(ofEF, ratio)
		hedges, reruns := sim.runner.Metrics.Hedges, sim.runner.Metrics.Reruns
		launched = append(launched, count(hedges, "launched"))
		won = append(won, count(hedges, "won"))
		stalls = append(stalls, count(reruns, "stalled"))
	}
	res.ofEF, res.launched, res.won, res.stallReruns = median(ofEF), median(launched), median(won), median(stalls)
	return res, nil
}

// healthySpeeds is speeds without the workers that hang: the fleet the
// earliest-finish schedule has, but for their first jobs.
func healthySpeeds(speeds []float64) []float64 {
	var out []float64
	for i, v := range speeds {
		if i%hangEvery != 0 {
			out = append(out, v)
		}
	}
	return out
}

func fmtHedgeAfter(after float64) string {
	if after == 0 {
		return "off"
	}
	return fmt.Sprintf("%g", after)
}

func fmtHangRatio(r float64) string {
	if math.IsInf(r, 1) {
		return "never"
	}
	return fmt.Sprintf("%.3f", r)
}

// count is what vec counted for value.
func count(vec *prometheus.CounterVec, value string) float64 {
	var m dto.Metric
	if err := vec.WithLabelValues(value).Write(&m); err != nil {
		panic(err) // a counter always writes
	}
	return m.GetCounter().GetValue()
}
