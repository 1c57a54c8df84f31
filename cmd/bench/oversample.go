package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"sync"
	"time"
)

// The oversample mode plays RL rollout steps that keep only the groups a
// filter passes (as dynamic sampling drops the groups whose samples all
// scored alike): each step needs --n groups of --group images that pass,
// and --filter-rate of the groups fail, drawn with --seed, the same groups
// failing whichever way the step is run. Two ways to get a step's groups:
//
//	exact + resend         send --n groups; send a new group for each one
//	                       the filter drops, until --n have passed
//	oversample + abort     send --oversample × --n groups at once; once --n
//	                       have passed, abort the rest with one
//	                       POST /abort_request {"rid_prefix": "step-<s>-"}
//	                       (and send more, as exact does, should too few
//	                       of them pass)
//
// Each image's X-Request-Id is step-<s>-<number>. The steps run back to
// back, so the work an abort leaves running on the GPUs delays the next
// step, as it would in training.

// plan is one way to get a step's groups.
type plan struct {
	name   string
	factor float64 // groups sent at a step's start, per group the step needs
}

// stepIDs spaces the request numbers of the steps: request i is image
// i % stepIDs of step i / stepIDs.
const stepIDs = 1_000_000

// stepJobID is request i's X-Request-Id.
func stepJobID(i int) string { return fmt.Sprintf("step-%d-%d", i/stepIDs, i%stepIDs) }

// stepLog is what one plan's steps did.
type stepLog struct {
	times            []float64 // seconds from each step's start to its last group needed
	groups           int       // groups sent
	waiting, running int       // jobs the aborts ended, as their answers counted them
	abortErrs        []string  // aborts that failed
}

// benchOversample runs the oversample mode: both plans, each on a fresh
// fleet and router of the first of --strategies, step times compared.
func benchOversample(ctx context.Context, o options, out io.Writer) panel {
	fmt.Fprintf(out, "\n== oversample: %d steps, each needing %d groups of %d images that pass a filter dropping %.0f%% of groups ==\n",
		o.steps, o.n, o.group, 100*o.filterRate)
	fmt.Fprintf(out, "step time: from a step's start to its last group needed; the next step starts at once, behind what the last one left running\n\n")
	plans := []plan{{"exact + resend", 1}, {fmt.Sprintf("oversample %gx + abort", o.oversample), o.oversample}}
	var rows []row
	logs := make(map[string]*stepLog)
	for _, p := range plans {
		log := &stepLog{}
		logs[p.name] = log
		rows = append(rows, planRow(runPlan(ctx, o, p, log), log))
	}
	exact := rows[0].lat.mean
	cols := []column{
		nameCol(),
		{"groups sent", func(r row) string { return fmt.Sprint(logs[r.name].groups) }},
		{"images", func(r row) string { return fmt.Sprint(r.requests) }},
		{"aborted waiting/running", func(r row) string {
			return fmt.Sprintf("%d/%d", logs[r.name].waiting, logs[r.name].running)
		}},
		{"step mean", func(r row) string { return fmtSeconds(r.lat.mean) }},
		{"p50", func(r row) string { return fmtSeconds(r.lat.p50) }},
		{"slowest", func(r row) string { return fmtSeconds(r.lat.p99) }},
		ratioCol("÷exact", func(r row) float64 { return r.lat.mean }, exact),
		{"all steps", func(r row) string { return fmtSeconds(r.wall) }},
		tookCol(),
	}
	writeTable(out, cols, rows)
	fmt.Fprintln(out, "images: requests sent, aborted ones included; the router answers an aborted one 409")
	return panel{
		title:  fmt.Sprintf("oversample: %d steps of %d groups × %d images, %.0f%% of groups filtered out", o.steps, o.n, o.group, 100*o.filterRate),
		xLabel: "step time (s)",
		series: rowSeries(rows, 1),
	}
}

// planRow is a plan's run as a row: its step times as the latencies, the
// failures other than the aborts' 409s counted by kind.
func planRow(res runResult, log *stepLog) row {
	rw := row{name: res.name, requests: len(res.outcomes), took: fmtDuration(res.took)}
	if res.err != nil {
		rw.notes, rw.skipped = []string{"not run: " + firstLine(res.err)}, true
		return rw
	}
	rw.lat, rw.wall = summarize(log.times), sum(log.times)
	errs := make(map[string]int)
	for _, oc := range res.outcomes {
		if se, ok := oc.err.(*statusError); oc.err != nil && (!ok || se.status != http.StatusConflict) {
			errs[firstLine(oc.err)]++
		}
	}
	for _, e := range sortedKeys(errs) {
		rw.notes = append(rw.notes, fmt.Sprintf("%d× %s", errs[e], e))
	}
	rw.notes = append(rw.notes, log.abortErrs...)
	return rw
}

// runPlan runs --steps steps of plan p on a fresh fleet and router, or on
// --router.
func runPlan(ctx context.Context, o options, p plan, log *stepLog) runResult {
	measure := measureSteps(o, p.factor, log)
	conns := int(math.Ceil(p.factor*float64(o.n))) * o.group
	if o.router != "" {
		return timed(func() runResult { return runExternal(ctx, o, measure, conns) })
	}
	fmt.Fprintf(os.Stderr, "bench: %-26s", p.name)
	res := timed(func() runResult { return runStrategy(ctx, o, o.strategies[0], measure, conns) })
	fmt.Fprintf(os.Stderr, " done in %s\n", res.took.Round(100*time.Millisecond))
	res.name = p.name
	return res
}

// measureSteps runs the steps one after the other.
func measureSteps(o options, factor float64, log *stepLog) measureFunc {
	return func(ctx context.Context, c *client) ([]outcome, time.Duration) {
		c.ids = stepJobID
		start := time.Now()
		var out []outcome
		for s := range o.steps {
			out = append(out, runStep(ctx, c, o, s, factor, log)...)
		}
		return out, time.Since(start)
	}
}

// groupResult is how one group came back.
type groupResult struct {
	group int
	outs  []outcome
	ok    bool // every image came back
}

// runStep runs step s: it sends factor × --n groups, and one more whenever
// those still out could no longer bring the step to --n passed; once --n
// have passed, it aborts the rest.
func runStep(ctx context.Context, c *client, o options, s int, factor float64, log *stepLog) []outcome {
	results := make(chan groupResult)
	launched, out, passed := 0, 0, 0
	launch := func() {
		g := launched
		launched, out = launched+1, out+1
		go func() { results <- runGroup(ctx, c, o, s, g) }()
	}
	start := time.Now()
	for range int(math.Ceil(factor * float64(o.n))) {
		launch()
	}
	var outs []outcome
	for passed < o.n && out > 0 {
		r := <-results
		out--
		outs = append(outs, r.outs...)
		if r.ok && keeps(o, s, r.group) {
			passed++
		}
		if passed+out < o.n && ctx.Err() == nil {
			launch()
		}
	}
	log.times = append(log.times, time.Since(start).Seconds())
	log.groups += launched
	if out > 0 {
		log.abort(ctx, c, s)
	}
	for ; out > 0; out-- {
		outs = append(outs, (<-results).outs...)
	}
	return outs
}

// runGroup sends group g of step s: --group images of one job of the mix,
// at once.
func runGroup(ctx context.Context, c *client, o options, s, g int) groupResult {
	j := drawJob(mixes[o.mix], rand.New(rand.NewPCG(o.seed, uint64(s)<<32|uint64(g))))
	r := groupResult{group: g, outs: make([]outcome, o.group), ok: true}
	var wg sync.WaitGroup
	for k := range r.outs {
		i := s*stepIDs + g*o.group + k
		wg.Go(func() { r.outs[k] = c.generate(ctx, i, j, time.Time{}) })
	}
	wg.Wait()
	for _, oc := range r.outs {
		r.ok = r.ok && oc.err == nil
	}
	return r
}

// keeps reports whether the filter passes group g of step s: a draw of its
// own, so that a group fares alike in both plans.
func keeps(o options, s, g int) bool {
	return rand.New(rand.NewPCG(o.seed^0xf11e, uint64(s)<<32|uint64(g))).Float64() >= o.filterRate
}

// abort ends what step s still has out and adds up what the answer counts.
func (l *stepLog) abort(ctx context.Context, c *client, s int) {
	body, _, err := c.call(ctx, "abort ", http.MethodPost, "/abort_request", s*stepIDs, map[string]string{"rid_prefix": fmt.Sprintf("step-%d-", s)})
	var answer struct {
		Aborted struct{ Waiting, Running int } `json:"aborted"`
	}
	if err == nil {
		err = json.Unmarshal(body, &answer)
	}
	if err != nil {
		l.abortErrs = append(l.abortErrs, fmt.Sprintf("step %d: %v", s, err))
		return
	}
	l.waiting += answer.Aborted.Waiting
	l.running += answer.Aborted.Running
}
