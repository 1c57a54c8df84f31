package main

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"
)

// benchBatch runs the batch mode: all --n jobs at once, makespan against the
// lower bound and against a simulated central LPT queue.
func benchBatch(ctx context.Context, o options, out io.Writer) panel {
	jobs := makeJobs(mixes[o.mix], o.n, o.seed)
	unit := o.unitMs / 1000 // seconds per cost unit at speed 1
	bound := batchBound(jobs, o.speeds) * unit
	sj, costs := simJobs(jobs, nil, unit)
	lpt := simulatedRow("ideal LPT (simulated)", sj, costs, simulate(sj, o.speeds, largestFirst), len(o.speeds), true)

	fmt.Fprintf(out, "\n== batch: %d requests sent at once, makespan = time until the last answer ==\n", len(jobs))
	fmt.Fprintf(out, "total cost %.0f units = %s of work at speed 1; lower bound %s = max(longest job on the fastest worker, total cost / total speed)\n",
		sum(costs), fmtSeconds(sum(costs)*unit), fmtSeconds(bound))
	fmt.Fprintf(out, "ideal LPT = one central queue, largest job first to the first free worker (the fastest if several), no overhead\n")
	fmt.Fprintf(out, "latency columns: time from the release of the batch to each answer\n\n")

	results := runStrategies(ctx, o, measureBatch(jobs), len(jobs))
	headers := workerHeaders(workerNames(o, results), o.speeds, o.router != "")
	rows := append(measuredRows(results, o, true), simRowFor(o, lpt))
	makespan := func(r row) float64 { return r.wall }
	cols := slices.Concat(
		[]column{nameCol()}, countCols(),
		[]column{
			{"makespan", func(r row) string { return fmtSeconds(r.wall) }},
			ratioCol("÷bound", makespan, bound),
			ratioCol("÷LPT", makespan, lpt.wall),
		},
		latencyCols(), workerCols(headers), []column{tookCol()})
	writeTable(out, cols, rows)
	fmt.Fprintln(out, "per-worker cells: jobs answered (share of the cost served)")
	return panel{
		title:  fmt.Sprintf("batch: %d %s jobs sent at once, speeds %s", len(jobs), o.mix, fmtSpeeds(o.speeds)),
		xLabel: "time from the release of the batch to the answer (s)",
		series: rowSeries(rows, 1),
	}
}

// benchOpen runs the open mode: Poisson arrivals at util × capacity, the
// latency distribution against a simulated ideal central FIFO queue.
func benchOpen(ctx context.Context, o options, out io.Writer) panel {
	mix := mixes[o.mix]
	jobs := makeJobs(mix, o.n, o.seed)
	rate := arrivalRate(mix, o.speeds, o.unitMs, o.util)
	arrivals := poissonArrivals(o.n, rate, o.seed)
	unit := o.unitMs / 1000
	sj, costs := simJobs(jobs, arrivals, unit)
	ideal := simulatedRow("ideal (simulated)", sj, costs, simulate(sj, o.speeds, fifoOrder), len(o.speeds), true)

	span := max(arrivals[len(arrivals)-1].Seconds(), 1e-9)
	fmt.Fprintf(out, "\n== open: %d requests, Poisson arrivals at %.2f/s ==\n", len(jobs), rate)
	fmt.Fprintf(out, "rate = util %.2f × capacity %.0f units/s / mean cost %.4g; this trace: arrivals over %s, offered load %.2f of capacity\n",
		o.util, sum(o.speeds)/unit, meanCost(mix), fmtSeconds(span), sum(costs)*unit/sum(o.speeds)/span)
	fmt.Fprintf(out, "latency: request sent → answer read; ideal = the same trace through one central FIFO queue, no overhead\n\n")

	results := runStrategies(ctx, o, measureOpen(jobs, arrivals), min(len(jobs), 256))
	headers := workerHeaders(workerNames(o, results), o.speeds, o.router != "")
	rows := append(measuredRows(results, o, true), simRowFor(o, ideal))
	cols := slices.Concat(
		[]column{nameCol()}, countCols(), latencyCols(),
		[]column{
			ratioCol("mean÷ideal", func(r row) float64 { return r.lat.mean }, ideal.lat.mean),
			ratioCol("p99÷ideal", func(r row) float64 { return r.lat.p99 }, ideal.lat.p99),
		},
		workerCols(headers), []column{tookCol()})
	writeTable(out, cols, rows)
	fmt.Fprintln(out, "per-worker cells: jobs answered (share of the cost served)")
	return panel{
		title:  fmt.Sprintf("open: %d %s jobs, Poisson arrivals at util %.2f, speeds %s", len(jobs), o.mix, o.util, fmtSpeeds(o.speeds)),
		xLabel: "latency, request sent to answer read (s)",
		logX:   true,
		series: rowSeries(rows, 1),
	}
}

// benchOverhead runs the overhead mode: --clients closed loops of the
// lightest generation request for --duration, requests per second.
func benchOverhead(ctx context.Context, o options, out io.Writer) panel {
	fmt.Fprintf(out, "\n== overhead: %d clients in closed loops for %s, each request a %s image with %d step (cost %.2g units, i.e. ~0 service time) ==\n",
		o.clients, o.duration, lightJob.size(), lightJob.steps, lightJob.cost())
	fmt.Fprintf(out, "worker/job: the fake worker's own time per request (its slot, not its HTTP handling)\n\n")

	results := runStrategies(ctx, o, measureOverhead(o.clients, o.duration), o.clients)
	headers := workerHeaders(workerNames(o, results), o.speeds, o.router != "")
	rows := measuredRows(results, o, false)
	perJob := make(map[string]string)
	for i, r := range results {
		if ok := rows[i].requests - rows[i].failed; ok > 0 && r.busy > 0 {
			perJob[r.name] = fmtSeconds(r.busy.Seconds() / float64(ok))
		}
	}
	cols := slices.Concat(
		[]column{nameCol()}, countCols(),
		[]column{{"req/s", func(r row) string {
			return fmt.Sprintf("%.0f", float64(r.requests-r.failed)/r.wall)
		}}},
		latencyCols(),
		[]column{{"worker/job", func(r row) string { return cmp.Or(perJob[r.name], "-") }}},
		workerCols(headers), []column{tookCol()})
	writeTable(out, cols, rows)
	fmt.Fprintln(out, "per-worker cells: requests answered")
	return panel{
		title:  fmt.Sprintf("overhead: %d clients, %s images with 1 step, %s per strategy", o.clients, lightJob.size(), o.duration),
		xLabel: "latency, request sent to answer read (ms)",
		logX:   true,
		series: rowSeries(rows, 1000),
	}
}

// simJobs turns jobs (and their arrival offsets; nil for a batch) into
// simulator jobs in seconds, and returns their costs.
func simJobs(jobs []job, arrivals []time.Duration, unit float64) ([]simJob, []float64) {
	sj := make([]simJob, len(jobs))
	costs := make([]float64, len(jobs))
	for i, j := range jobs {
		costs[i] = j.cost()
		sj[i].work = costs[i] * unit
		if arrivals != nil {
			sj[i].arrival = arrivals[i].Seconds()
		}
	}
	return sj, costs
}

// simRowFor drops a simulation's per-worker cells when the columns are an
// external router's workers, which cannot be matched to --speeds.
func simRowFor(o options, r row) row {
	if o.router != "" {
		r.perWorker = nil
	}
	return r
}

func measuredRows(results []runResult, o options, withCost bool) []row {
	names := workerNames(o, results)
	rows := make([]row, len(results))
	for i, r := range results {
		rows[i] = measuredRow(r, names, withCost)
	}
	return rows
}

// workerNames names the per-worker columns: the fleet's workers, or for an
// external router the X-Fake-Worker names that answered.
func workerNames(o options, results []runResult) []string {
	if o.router == "" {
		names := make([]string, len(o.speeds))
		for i := range names {
			names[i] = fmt.Sprintf("w%d", i+1)
		}
		return names
	}
	var names []string
	for _, r := range results {
		for _, w := range r.workers {
			if !slices.Contains(names, w) {
				names = append(names, w)
			}
		}
	}
	slices.Sort(names)
	return names
}

// rowSeries turns the rows that have latencies into plot series, values
// multiplied by scale; simulations are dashed.
func rowSeries(rows []row, scale float64) []series {
	var ss []series
	for _, r := range rows {
		if len(r.lat.sorted) == 0 {
			continue
		}
		vals := make([]float64, len(r.lat.sorted))
		for i, v := range r.lat.sorted {
			vals[i] = v * scale
		}
		ss = append(ss, series{name: r.name, values: vals, dashed: r.simulated})
	}
	return ss
}

func fmtSpeeds(speeds []float64) string {
	parts := make([]string, len(speeds))
	for i, v := range speeds {
		parts[i] = fmt.Sprint(v)
	}
	return strings.Join(parts, ",")
}
