package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
)

// The refit mode plays one rollout step of non-colocated RL training during
// which the trainer moves new weights into the workers a few at a time,
// past the router, as miles_diffusion's trainer does (issue 41):
//
//	before   every worker gets step-1's tensors by a direct
//	         update_weights_from_tensor, declared with their checksums
//	         (POST /update_weight_version), so that the step starts on a
//	         known version
//	step     --n jobs of --mix at once, each carrying the run's policy in
//	         X-Weight-Version-Policy
//	refit    --refit-after the release, for each group of --refit-group
//	         workers in turn: POST /pause_generation naming them (it
//	         answers once their jobs ended), update_weights_from_tensor
//	         with step-2's tensors to each directly, a sleep of --transfer
//	         standing for the transfer itself (the fake loads at once), then
//	         POST /continue_generation with new_version step-2 and the
//	         checksums; then the next group
//
// Each policy runs --runs times on a fresh fleet and router of the first of
// --strategies, the policies alternating, with the same jobs. While the
// step runs, GET /workers is read every refitPoll: a worker is refitting
// from the moment its group's pause is sent until its continue answers;
// the others are available. Idle while jobs wait is the worker-time during
// which an available worker held no job (active_requests 0) while the
// router's queue was not empty (queued_by_priority), each reading standing
// until the next; its share is that over the available worker-time, from
// the release to the last answer.

const (
	oldVersion = "step-1"
	newVersion = "step-2"
	// refitPoll is how often the router's view of the workers is read.
	refitPoll = 10 * time.Millisecond
)

// refitPolicies are the X-Weight-Version-Policy values the mode compares.
var refitPolicies = []string{"latest", "max-staleness:1"}

// refitRun is what one run of the step did.
type refitRun struct {
	outcomes []outcome
	makespan time.Duration
	// refitFrom and refitTo are the first pause sent and the last continue
	// answered, since the release.
	refitFrom, refitTo time.Duration
	samples            []workerSample
	pollErrs           int           // reads of GET /workers that failed
	busy               time.Duration // the fake workers' time running jobs, from their own count
	err                error         // why the run could not start, or the trainer's first failed call
}

// benchRefit runs the refit mode and prints its table.
func benchRefit(ctx context.Context, o options, out io.Writer) panel {
	fmt.Fprintf(out, "\n== refit: %d jobs sent at once on %s, %d workers refit %d at a time, --refit-after %s, transfers of %s ==\n",
		o.n, oldVersion, len(o.speeds), o.refitGroup, o.refitAfter, o.transfer)
	bound := batchBound(makeJobs(mixes[o.mix], o.n, o.seed), o.speeds) * o.unitMs / 1000
	fmt.Fprintf(out, "lower bound: %s without a refit (max(longest job on the fastest worker, total cost / total speed)); each worker out for --transfer adds %s to total cost / total speed\n",
		fmtSeconds(bound), o.transfer)
	fmt.Fprintf(out, "per group: pause_generation (waits for its jobs) → update_weights_from_tensor to each worker directly → sleep %s → continue_generation to %s with checksums\n", o.transfer, newVersion)
	fmt.Fprintf(out, "idle: worker-time an available worker (not in the group being refit) held no job while jobs waited in the router's queue, ÷ available worker-time; GET /workers every %s\n", refitPoll)
	fmt.Fprintf(out, "cells: median (min–max) over %d runs per policy, alternating\n\n", o.runs)

	runs := make(map[string][]refitRun)
	for k := range o.runs {
		for _, p := range refitPolicies {
			fmt.Fprintf(os.Stderr, "bench: %-26s", fmt.Sprintf("%s, run %d", p, k+1))
			res := timed(func() runResult {
				run := refitRun{}
				res := runStrategy(ctx, o, o.strategies[0], measureRefit(o, p, &run), o.n)
				run.busy = res.busy
				run.err = cmp.Or(res.err, run.err)
				runs[p] = append(runs[p], run)
				return res
			})
			fmt.Fprintf(os.Stderr, " done in %s\n", res.took.Round(100*time.Millisecond))
		}
	}
	rows := make([]row, len(refitPolicies))
	for i, p := range refitPolicies {
		rows[i] = refitRow(p, runs[p])
	}
	writeTable(out, refitCols(runs, len(o.speeds)), rows)
	fmt.Fprintf(out, "fleet busy: the fake workers' own time running jobs ÷ (workers × makespan); refit done: release → last continue answered\n")
	fmt.Fprintf(out, "answers: by the X-Weight-Version they carry, over all runs\n")
	return panel{
		title:  fmt.Sprintf("refit: %d %s jobs sent at once, workers refit %d at a time", o.n, o.mix, o.refitGroup),
		xLabel: "time from the release of the batch to the answer (s)",
		series: rowSeries(rows, 1),
	}
}

// refitRow is a policy's runs as a row: its answers' latencies pooled,
// the failures by kind.
func refitRow(policy string, runs []refitRun) row {
	var res runResult
	for _, r := range runs {
		res.outcomes = append(res.outcomes, r.outcomes...)
	}
	res.name = policy
	rw := measuredRow(res, nil, false)
	for _, r := range runs {
		if r.err != nil {
			rw.notes = append(rw.notes, firstLine(r.err))
		}
		if r.pollErrs > 0 {
			rw.notes = append(rw.notes, fmt.Sprintf("%d reads of GET /workers failed", r.pollErrs))
		}
	}
	return rw
}

func refitCols(runs map[string][]refitRun, workers int) []column {
	over := func(r row, f func(refitRun) float64, format func(float64) string) string {
		return fmtSpread(runs[r.name], f, format)
	}
	pct := func(x float64) string {
		if math.IsNaN(x) {
			return "-"
		}
		return fmt.Sprintf("%.1f%%", 100*x)
	}
	return slices.Concat(
		[]column{
			{"policy", func(r row) string { return r.name }},
			{"runs", func(r row) string { return fmt.Sprint(len(runs[r.name])) }},
		}, countCols(),
		[]column{
			{"makespan", func(r row) string {
				return over(r, func(x refitRun) float64 { return x.makespan.Seconds() }, fmtSeconds)
			}},
			{"idle while jobs wait", func(r row) string {
				return over(r, func(x refitRun) float64 { return x.idle(0, x.makespan) }, pct)
			}},
			{"during the refit", func(r row) string {
				return over(r, func(x refitRun) float64 { return x.idle(x.refitFrom, min(x.refitTo, x.makespan)) }, pct)
			}},
			{"fleet busy", func(r row) string {
				return over(r, func(x refitRun) float64 { return x.busy.Seconds() / x.makespan.Seconds() / float64(workers) }, pct)
			}},
			{"refit done", func(r row) string {
				return over(r, func(x refitRun) float64 { return x.refitTo.Seconds() }, fmtSeconds)
			}},
			{"answers " + oldVersion + "/" + newVersion, func(r row) string {
				var old, fresh int
				for _, x := range runs[r.name] {
					for _, oc := range x.outcomes {
						old += btoi(oc.err == nil && oc.version == oldVersion)
						fresh += btoi(oc.err == nil && oc.version == newVersion)
					}
				}
				return fmt.Sprintf("%d/%d", old, fresh)
			}},
		})
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// fmtSpread is the median of f over runs, and with several runs their
// range: "2.41s (2.38s–2.50s)".
func fmtSpread(runs []refitRun, f func(refitRun) float64, format func(float64) string) string {
	vals := make([]float64, len(runs))
	for i, r := range runs {
		vals[i] = f(r)
	}
	slices.Sort(vals)
	if len(vals) == 0 {
		return "-"
	}
	median := percentile(vals, 50)
	if len(vals) == 1 {
		return format(median)
	}
	return fmt.Sprintf("%s (%s–%s)", format(median), format(vals[0]), format(vals[len(vals)-1]))
}

// measureRefit declares step-1 on every worker, then releases the step's
// jobs under policy while a trainer refits the workers and a sampler
// reads the router's view of them; run records what happened.
func measureRefit(o options, policy string, run *refitRun) measureFunc {
	return func(ctx context.Context, c *client) ([]outcome, time.Duration) {
		router := c.urls[0]
		workers, err := refitStart(ctx, router)
		if err != nil {
			run.err = err
			return nil, 0
		}
		t := &trainer{router: router, size: o.refitGroup, transfer: o.transfer}
		c.header = http.Header{"X-Weight-Version-Policy": {policy}}
		start := time.Now()
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		sampler := sampleWorkers(ctx, router, start, t.refitting)
		var wg sync.WaitGroup
		wg.Go(func() {
			sleepUntil(ctx, start.Add(o.refitAfter))
			t.refit(ctx, workers, start)
		})
		run.outcomes, run.makespan = measureBatch(makeJobs(mixes[o.mix], o.n, o.seed))(ctx, c)
		wg.Wait()
		cancel()
		run.samples, run.pollErrs = sampler.stop()
		run.refitFrom, run.refitTo, run.err = t.from, t.to, t.err
		return run.outcomes, run.makespan
	}
}

// refitStart loads step-1's tensors into every worker of the router,
// directly, and declares them with their checksums. It returns the
// workers' URLs, in the router's order.
func refitStart(ctx context.Context, router string) ([]string, error) {
	view, err := readWorkers(ctx, router)
	if err != nil {
		return nil, err
	}
	var workers []string
	for _, w := range view.Workers {
		workers = append(workers, w.URL)
	}
	if err := transferTo(ctx, workers, oldVersion); err != nil {
		return nil, err
	}
	_, err = postJSON(ctx, router+"/update_weight_version", map[string]any{"new_version": oldVersion, "checksums": checksums(oldVersion)})
	return workers, err
}

// versionTensors are the tensors the trainer sends for version v: their
// bytes differ by version, and so do the fake's checksums.
func versionTensors(v string) []fakeworker.Tensor {
	return []fakeworker.Tensor{{Name: "blocks.0.weight", Data: []byte("weights of " + v)}}
}

// checksums is a declaration's checksums of version v's tensors.
func checksums(v string) map[string]string {
	return map[string]string{"transformer": fakeworker.Checksum(versionTensors(v)...)}
}

// transferTo sends version v's tensors to each worker's own
// update_weights_from_tensor, not through the router.
func transferTo(ctx context.Context, workers []string, v string) error {
	body := map[string]any{
		"serialized_named_tensors": []string{fakeworker.TensorPayload(versionTensors(v)...)},
		"load_format":              "flattened_bucket",
		"target_modules":           []string{"transformer"},
		"weight_version":           v,
	}
	for _, w := range workers {
		if _, err := postJSON(ctx, w+"/update_weights_from_tensor", body); err != nil {
			return err
		}
	}
	return nil
}

// trainer refits the workers a group at a time.
type trainer struct {
	router   string
	size     int           // workers per group
	transfer time.Duration // the sleep that stands for a group's transfer

	mu    sync.Mutex
	group []string // the workers being refit now

	// Written by refit, read once it has returned.
	from, to time.Duration // since the step's start: the first pause sent, the last continue answered
	err      error
}

// refit refits the workers, size at a time, and records when it began
// and ended; it stops at the first call that fails.
func (t *trainer) refit(ctx context.Context, workers []string, start time.Time) {
	t.from = time.Since(start)
	for g := range slices.Chunk(workers, t.size) {
		t.setGroup(g)
		t.err = t.refitGroup(ctx, g)
		t.setGroup(nil)
		if t.err != nil {
			return
		}
	}
	t.to = time.Since(start)
}

// refitGroup pauses g, transfers step-2 to it and lets it continue on
// step-2, its checksums checked.
func (t *trainer) refitGroup(ctx context.Context, g []string) error {
	if _, err := postJSON(ctx, t.router+"/pause_generation", map[string]any{"workers": g}); err != nil {
		return err
	}
	if err := transferTo(ctx, g, newVersion); err != nil {
		return err
	}
	sleepUntil(ctx, time.Now().Add(t.transfer))
	_, err := postJSON(ctx, t.router+"/continue_generation",
		map[string]any{"workers": g, "new_version": newVersion, "checksums": checksums(newVersion)})
	return err
}

func (t *trainer) setGroup(g []string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.group = g
}

// refitting reports whether worker u is in the group being refit.
func (t *trainer) refitting(u string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return slices.Contains(t.group, u)
}

// workerSample is one reading of GET /workers.
type workerSample struct {
	at        time.Duration // since the step's start, when the answer came
	queued    int           // jobs waiting in the router's queue
	available int           // workers not being refit
	idle      int           // of those, the ones that held no job
}

// idle is the share of the available worker-time from from to to during
// which available workers held no job while jobs waited; each sample
// stands until the next. NaN when no worker was available.
func (r refitRun) idle(from, to time.Duration) float64 {
	var idle, available float64
	for i, s := range r.samples[:max(len(r.samples)-1, 0)] {
		lo, hi := max(s.at, from), min(r.samples[i+1].at, to)
		if hi <= lo {
			continue
		}
		d := (hi - lo).Seconds()
		available += d * float64(s.available)
		if s.queued > 0 {
			idle += d * float64(s.idle)
		}
	}
	return idle / available
}

// workerSampler reads the router's view of the workers until stopped.
type workerSampler struct {
	done    sync.WaitGroup
	samples []workerSample
	errs    int
}

// sampleWorkers reads GET /workers every refitPoll until ctx ends; a
// worker counts as available unless refitting says it is being refit
// when the read is sent.
func sampleWorkers(ctx context.Context, router string, start time.Time, refitting func(string) bool) *workerSampler {
	s := &workerSampler{}
	s.done.Go(func() {
		tickUntilDone(ctx, refitPoll, func() {
			s.read(ctx, router, start, refitting)
		})
	})
	return s
}

func (s *workerSampler) read(ctx context.Context, router string, start time.Time, refitting func(string) bool) {
	view, err := readWorkers(ctx, router)
	if err != nil {
		if ctx.Err() == nil {
			s.errs++
		}
		return
	}
	smp := workerSample{at: time.Since(start), queued: view.queued()}
	for _, w := range view.Workers {
		if refitting(w.URL) || w.State == "paused" {
			continue
		}
		smp.available++
		smp.idle += btoi(w.ActiveRequests == 0)
	}
	s.samples = append(s.samples, smp)
}

// stop waits for the sampler to end (its context must be done) and
// returns what it read.
func (s *workerSampler) stop() ([]workerSample, int) {
	s.done.Wait()
	return s.samples, s.errs
}

// workersView is what the mode reads of GET /workers.
type workersView struct {
	Workers []struct {
		URL            string `json:"url"`
		ActiveRequests int    `json:"active_requests"`
		State          string `json:"state"`
	} `json:"workers"`
	QueuedByPriority map[string]int `json:"queued_by_priority"`
}

func (v workersView) queued() int {
	n := 0
	for _, k := range v.QueuedByPriority {
		n += k
	}
	return n
}

func readWorkers(ctx context.Context, router string) (workersView, error) {
	var v workersView
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, router+"/workers", nil)
	if err != nil {
		return v, err
	}
	body, err := adminCall(req)
	if err != nil {
		return v, err
	}
	return v, json.Unmarshal(body, &v)
}

// postJSON posts body as JSON to u and returns the answer of a 200.
func postJSON(ctx context.Context, u string, body any) ([]byte, error) {
	b, err := json.Marshal(body)
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, bytes.NewReader(b))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	return adminCall(req)
}

// refitDescription is the header's line on the refit mode's fleet.
func refitDescription(o options) string {
	return fmt.Sprintf("fleet:    %d fake workers on 127.0.0.1, speeds %s, %gms per cost unit at speed 1, fresh for every run; router %s\n",
		len(o.speeds), fmtSpeeds(o.speeds), o.unitMs, o.strategies[0].name)
}
