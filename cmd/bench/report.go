package main

import (
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"time"
)

// percentile is the p-th percentile (0 < p ≤ 100) of sorted by the
// nearest-rank method: the smallest value with at least p% of the values at
// or below it. NaN when sorted is empty.
func percentile(sorted []float64, p float64) float64 {
	if len(sorted) == 0 {
		return math.NaN()
	}
	rank := int(math.Ceil(p * float64(len(sorted)) / 100))
	return sorted[min(max(rank, 1), len(sorted))-1]
}

// summary is the latency distribution of one run's successful requests, in
// seconds.
type summary struct {
	sorted              []float64
	mean, p50, p90, p99 float64
}

func summarize(latencies []float64) summary {
	s := summary{sorted: slices.Sorted(slices.Values(latencies))}
	s.mean = sum(s.sorted) / float64(len(s.sorted))
	s.p50 = percentile(s.sorted, 50)
	s.p90 = percentile(s.sorted, 90)
	s.p99 = percentile(s.sorted, 99)
	return s
}

// row is one line of a report: a measured strategy or a simulation.
type row struct {
	name      string
	requests  int
	failed    int
	wall      float64 // seconds: makespan (batch), measuring window (overhead)
	lat       summary
	perWorker []string // one cell per worker
	took      string
	notes     []string // printed under the table
	skipped   bool     // the strategy did not run; notes say why
	simulated bool
}

// measuredRow turns a run into a row; workers names the per-worker columns.
func measuredRow(r runResult, workers []string, withCost bool) row {
	rw := row{name: r.name, requests: len(r.outcomes), wall: r.wall.Seconds(), took: fmtDuration(r.took)}
	if r.err != nil {
		rw.notes = append(rw.notes, "not run: "+firstLine(r.err))
		rw.skipped = true
		return rw
	}
	var lat []float64
	jobs := make(map[string]int)
	cost := make(map[string]float64)
	var total float64
	errs := make(map[string]int)
	for _, oc := range r.outcomes {
		if oc.err != nil {
			rw.failed++
			errs[firstLine(oc.err)]++
			continue
		}
		lat = append(lat, oc.latency.Seconds())
		jobs[oc.worker]++
		cost[oc.worker] += oc.job.cost()
		total += oc.job.cost()
	}
	rw.lat = summarize(lat)
	for _, w := range workers {
		rw.perWorker = append(rw.perWorker, workerCell(jobs[w], cost[w], total, withCost))
	}
	for _, e := range sortedKeys(errs) {
		rw.notes = append(rw.notes, fmt.Sprintf("%d× %s", errs[e], e))
	}
	if r.warmFail > 0 {
		rw.notes = append(rw.notes, fmt.Sprintf("%d warm-up requests failed", r.warmFail))
	}
	return rw
}

// simulatedRow turns a simulation (times in seconds) into a row.
func simulatedRow(name string, jobs []simJob, costs []float64, res []simResult, nWorkers int, withCost bool) row {
	rw := row{name: name, requests: len(res), took: "-", simulated: true}
	lat := make([]float64, len(res))
	jobsPer := make([]int, nWorkers)
	costPer := make([]float64, nWorkers)
	for i, r := range res {
		lat[i] = r.finish - jobs[i].arrival
		rw.wall = max(rw.wall, r.finish)
		jobsPer[r.worker]++
		costPer[r.worker] += costs[i]
	}
	rw.lat = summarize(lat)
	for w := range nWorkers {
		rw.perWorker = append(rw.perWorker, workerCell(jobsPer[w], costPer[w], sum(costPer), withCost))
	}
	return rw
}

// workerCell is "jobs" or "jobs (share of the cost served)".
func workerCell(jobs int, cost, total float64, withCost bool) string {
	if !withCost || total == 0 {
		return fmt.Sprint(jobs)
	}
	return fmt.Sprintf("%d (%.0f%%)", jobs, 100*cost/total)
}

// workerHeaders names the per-worker columns "w1×1", "w4×2", ...
func workerHeaders(workers []string, speeds []float64, external bool) []string {
	out := make([]string, len(workers))
	for i, w := range workers {
		out[i] = w
		if !external && i < len(speeds) {
			out[i] = fmt.Sprintf("%s×%g", w, speeds[i])
		}
	}
	return out
}

// column is one column of a report table: its header and how a row fills it.
type column struct {
	header string
	cell   func(row) string
}

// writeTable prints rows under the columns, then each row's notes. The
// first column is left-aligned, the others right-aligned.
func writeTable(out io.Writer, cols []column, rows []row) {
	cells := [][]string{make([]string, len(cols))}
	for i, c := range cols {
		cells[0][i] = c.header
	}
	for _, r := range rows {
		line := make([]string, len(cols))
		if r.skipped {
			line[0] = r.name // the note says why
		} else {
			for i, c := range cols {
				line[i] = c.cell(r)
			}
		}
		cells = append(cells, line)
	}
	widths := make([]int, len(cols))
	for _, line := range cells {
		for i, c := range line {
			widths[i] = max(widths[i], len([]rune(c)))
		}
	}
	for _, line := range cells {
		var b strings.Builder
		for i, c := range line {
			pad := strings.Repeat(" ", widths[i]-len([]rune(c)))
			switch {
			case i == 0:
				b.WriteString(c + pad)
			default:
				b.WriteString("  " + pad + c)
			}
		}
		fmt.Fprintln(out, strings.TrimRight(b.String(), " "))
	}
	for _, r := range rows {
		for _, n := range r.notes {
			fmt.Fprintf(out, "  %s: %s\n", r.name, n)
		}
	}
}

// Column builders shared by the modes.

func nameCol() column { return column{"strategy", func(r row) string { return r.name }} }

func countCols() []column {
	return []column{
		{"requests", func(r row) string { return fmt.Sprint(r.requests) }},
		{"failed", func(r row) string { return fmt.Sprint(r.failed) }},
	}
}

func latencyCols() []column {
	return []column{
		{"mean", func(r row) string { return fmtSeconds(r.lat.mean) }},
		{"p50", func(r row) string { return fmtSeconds(r.lat.p50) }},
		{"p90", func(r row) string { return fmtSeconds(r.lat.p90) }},
		{"p99", func(r row) string { return fmtSeconds(r.lat.p99) }},
	}
}

// ratioCol is value(row) / ref, e.g. makespan over the lower bound.
func ratioCol(header string, value func(row) float64, ref float64) column {
	return column{header, func(r row) string { return fmtRatio(value(r) / ref) }}
}

func workerCols(headers []string) []column {
	cols := make([]column, len(headers))
	for i, h := range headers {
		cols[i] = column{h, func(r row) string {
			if i < len(r.perWorker) {
				return r.perWorker[i]
			}
			return "-"
		}}
	}
	return cols
}

func tookCol() column { return column{"took", func(r row) string { return r.took }} }

// fmtSeconds prints a time in seconds with a unit that fits its size.
func fmtSeconds(s float64) string {
	switch {
	case math.IsNaN(s):
		return "-"
	case s >= 1:
		return fmt.Sprintf("%.2fs", s)
	case s >= 1e-3:
		return fmt.Sprintf("%.2fms", s*1e3)
	}
	return fmt.Sprintf("%.0fµs", s*1e6)
}

func fmtRatio(x float64) string {
	if math.IsNaN(x) || math.IsInf(x, 0) {
		return "-"
	}
	return fmt.Sprintf("%.2f", x)
}

func fmtDuration(d time.Duration) string { return fmt.Sprintf("%.1fs", d.Seconds()) }

// firstLine is the error's message up to its first newline, unwrapped from
// errUnavailable's prefix.
func firstLine(err error) string {
	msg := err.Error()
	if errors.Is(err, errUnavailable) {
		msg = strings.TrimPrefix(msg, errUnavailable.Error()+": ")
		msg = "config refused: " + msg
	}
	line, _, _ := strings.Cut(msg, "\n")
	return line
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
