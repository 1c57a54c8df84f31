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
	"slices"
	"sync"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// The adapters mode measures LoRA placement (issue 24) on fake workers
// whose set_lora takes --lora-switch when it changes the adapter, all
// starting on the base weights, one job at a time each. Every strategy
// runs two phases on fresh workers:
//
//	phase 1  --adapter-jobs jobs of each of --adapters adapters, their
//	         order shuffled with --seed, sent at once; its makespan
//	         against the bound work per worker + switch time
//	phase 2  all demand moves to adapter a: as many jobs of a as phase 1
//	         had in all, sent as a steady stream at the fleet's capacity;
//	         the time until three workers (all, with fewer) hold a, and
//	         the makespan
//
// Strategies:
//
//	placement              the router, the adapters declared
//	                       (adapter_switch_prior = --lora-switch), each job
//	                       naming its adapter in the model field
//	per-request switching  the bench's own proxy: one job at a time per
//	                       worker, the next job to the first free worker,
//	                       each preceded by a set_lora for its adapter
//	static split           that proxy with adapter i pinned to worker i
//
// Every answer must carry its own adapter in X-Fake-Adapter; the others
// are counted as wrong.

// phase2Adapter is the adapter all of phase 2's demand moves to.
const phase2Adapter = "a"

// adapterStrategy is a way of serving LoRA adapters: start puts it in
// front of the fleet.
type adapterStrategy struct {
	name  string
	start func(ctx context.Context, o options, f testrouter.Fleet) (adapterFront, error)
}

// adapterFront is what the clients send their jobs to.
type adapterFront interface {
	urls() []string
	// holdings reads which adapter each worker holds.
	holdings(ctx context.Context) ([]holding, error)
	close()
}

var adapterStrategies = []adapterStrategy{
	{"placement", startPlacement},
	{"per-request switching", func(_ context.Context, o options, f testrouter.Fleet) (adapterFront, error) {
		return startSwitchingProxy(f, adapterNames(o.adapters), false)
	}},
	{"static split", func(_ context.Context, o options, f testrouter.Fleet) (adapterFront, error) {
		return startSwitchingProxy(f, adapterNames(o.adapters), true)
	}},
}

// adapterRun is what one strategy did.
type adapterRun struct {
	phase1, phase2       []outcome
	makespan1, makespan2 time.Duration
	switches1, switches2 int           // the fleet's set_lora calls that changed an adapter
	wrong                int           // answers from another adapter than their job's
	phase2At             time.Duration // phase 2's start, since phase 1's
	holders              time.Duration // phase 2's start → enough workers hold a; -1: never
	log                  *holdingLog
}

// benchAdapters runs the adapters mode and prints its table.
func benchAdapters(ctx context.Context, o options, out io.Writer) panel {
	work := float64(o.adapters*o.adapterJobs) * o.jobTime.Seconds() / sum(o.speeds)
	bound := work + o.loraSwitch.Seconds()
	need := min(3, len(o.speeds))
	fmt.Fprintf(out, "\n== adapters: %d adapters, %d workers starting on the base weights, switches of %s, jobs of %s ==\n",
		o.adapters, len(o.speeds), o.loraSwitch, o.jobTime)
	fmt.Fprintf(out, "phase 1: %d jobs of each adapter, shuffled, sent at once; bound = work per worker %s + switch %s = %s (target: makespan ≤ 1.6 × bound)\n",
		o.adapterJobs, fmtSeconds(work), o.loraSwitch, fmtSeconds(bound))
	fmt.Fprintf(out, "phase 2: %d jobs of adapter %s at the fleet's capacity, %.2f/s; holders: time until %d workers hold %s, ready (target: ≤ 2 × switch = %s)\n\n",
		o.adapters*o.adapterJobs, phase2Adapter, sum(o.speeds)/o.jobTime.Seconds(), need, phase2Adapter, 2*o.loraSwitch)

	runs := make(map[string]adapterRun)
	var rows []row
	for _, s := range adapterStrategies {
		res, run := timedAdapters(ctx, o, s, need)
		runs[s.name] = run
		rows = append(rows, adapterRow(res, run))
	}
	writeTable(out, adapterCols(runs, bound), rows)
	fmt.Fprintln(out, "wrong: 2xx answers from another adapter than the job's; switches: set_lora calls that changed a worker's adapter")
	if run := runs[adapterStrategies[0].name]; run.log != nil {
		fmt.Fprintf(out, "\n%s: the workers' adapters as GET /workers showed them every %s, from phase 1's start; phase 2 started at %s\n",
			adapterStrategies[0].name, pollEvery(o), fmtSeconds(run.phase2At.Seconds()))
		run.log.write(out)
	}
	return panel{
		title:  fmt.Sprintf("adapters, phase 1: %d jobs of each of %d adapters sent at once, switches of %s", o.adapterJobs, o.adapters, o.loraSwitch),
		xLabel: "time from the release of the batch to the answer (s)",
		series: rowSeries(rows, 1),
	}
}

// timedAdapters runs strategy s, saying on standard error how long it
// took, as runStrategies does.
func timedAdapters(ctx context.Context, o options, s adapterStrategy, need int) (runResult, adapterRun) {
	fmt.Fprintf(os.Stderr, "bench: %-26s", s.name)
	var run adapterRun
	res := timed(func() runResult {
		var err error
		run, err = runAdapters(ctx, o, s, need)
		return runResult{name: s.name, err: err}
	})
	if res.err != nil {
		fmt.Fprintf(os.Stderr, " not run (%.70s...)\n", res.err)
	} else {
		fmt.Fprintf(os.Stderr, " done in %s\n", res.took.Round(100*time.Millisecond))
	}
	return res, run
}

// adapterRow is a strategy's row: both phases' requests and failures,
// phase 1's makespan and latencies (for the plot).
func adapterRow(res runResult, run adapterRun) row {
	res.outcomes, res.wall = run.phase1, run.makespan1
	rw := measuredRow(res, nil, false)
	res.outcomes = run.phase2
	phase2 := measuredRow(res, nil, false)
	rw.requests += phase2.requests
	rw.failed += phase2.failed
	rw.notes = append(rw.notes, phase2.notes...)
	return rw
}

func adapterCols(runs map[string]adapterRun, bound float64) []column {
	get := func(r row) adapterRun { return runs[r.name] }
	return slices.Concat(
		[]column{nameCol()}, countCols(),
		[]column{
			{"wrong", func(r row) string { return fmt.Sprint(get(r).wrong) }},
			{"phase 1", func(r row) string { return fmtSeconds(r.wall) }},
			ratioCol("÷bound", func(r row) float64 { return r.wall }, bound),
			{"switches", func(r row) string { return fmt.Sprint(get(r).switches1) }},
			{"phase 2 holders", func(r row) string {
				if get(r).holders < 0 {
					return "never"
				}
				return fmtSeconds(get(r).holders.Seconds())
			}},
			{"phase 2", func(r row) string { return fmtSeconds(get(r).makespan2.Seconds()) }},
			{"switches", func(r row) string { return fmt.Sprint(get(r).switches2) }},
			tookCol(),
		})
}

// wrongAdapters counts the answers that came from another adapter than
// their job's, want[i] being outs[i]'s.
func wrongAdapters(outs []outcome, want func(i int) string) int {
	wrong := 0
	for i, oc := range outs {
		if oc.err == nil && oc.adapter != want(i) {
			wrong++
		}
	}
	return wrong
}

// runAdapters runs both phases of strategy s on a fresh fleet.
func runAdapters(ctx context.Context, o options, s adapterStrategy, need int) (adapterRun, error) {
	var run adapterRun
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	f, err := startLoraFleet(o)
	if err != nil {
		return run, err
	}
	defer f.Close()
	front, err := s.start(ctx, o, f)
	if err != nil {
		return run, err
	}
	defer front.close() // before the fleet closes
	perPhase := o.adapters * o.adapterJobs
	c := newClient(front.urls(), perPhase)
	defer c.close()
	poll := pollHoldings(ctx, front, pollEvery(o))

	j := adapterJob(o)
	names := phase1Adapters(o.adapters, o.adapterJobs, o.seed)
	want1, want2 := func(i int) string { return names[i] }, func(int) string { return phase2Adapter }
	run.phase1, run.makespan1, run.switches1 = runPhase(ctx, c, f, want1, measureBatch(slices.Repeat([]job{j}, perPhase)))
	run.phase2At = poll.since()
	stream := steadyArrivals(perPhase, sum(o.speeds)/o.jobTime.Seconds())
	run.phase2, run.makespan2, run.switches2 = runPhase(ctx, c, f, want2, measureOpen(slices.Repeat([]job{j}, perPhase), stream))
	run.log = poll.stop()
	run.holders = run.log.reached(run.phase2At, phase2Adapter, need)
	run.wrong = wrongAdapters(run.phase1, want1) + wrongAdapters(run.phase2, want2)
	return run, nil
}

// runPhase sends measure's requests, request i naming adapter models(i),
// and counts the switches the fleet made meanwhile.
func runPhase(ctx context.Context, c *client, f testrouter.Fleet, models func(int) string, measure measureFunc) ([]outcome, time.Duration, int) {
	c.models = models
	before := loraSwitches(f)
	outs, wall := measure(ctx, c)
	return outs, wall, loraSwitches(f) - before
}

// pollEvery is how often the holders are read: every 100 ms, or a tenth
// of the switch time when that is shorter, so that the time to the
// holders is measured finely enough.
func pollEvery(o options) time.Duration { return min(100*time.Millisecond, o.loraSwitch/10) }

// adapterJob is the mode's one kind of job: a 1024x1024 image with the
// number of steps that takes --job-time at --unit-ms.
func adapterJob(o options) job {
	return job{1024, 1024, adapterSteps(o)}
}

func adapterSteps(o options) int {
	return max(1, int(math.Round(float64(o.jobTime.Milliseconds())/o.unitMs)))
}

// adapterNames names n adapters a, b, c, ...
func adapterNames(n int) []string {
	names := make([]string, n)
	for i := range names {
		names[i] = string(rune('a' + i))
	}
	return names
}

// loraPath is where adapter is loaded from.
func loraPath(adapter string) string { return "/ckpt/lora/" + adapter }

// phase1Adapters is phase 1's adapter of each job: perAdapter of each of
// n adapters, interleaved in an order shuffled with seed.
func phase1Adapters(n, perAdapter int, seed uint64) []string {
	var names []string
	for range perAdapter {
		names = append(names, adapterNames(n)...)
	}
	rng := rand.New(rand.NewPCG(seed, 3))
	rng.Shuffle(len(names), func(i, j int) { names[i], names[j] = names[j], names[i] })
	return names
}

// steadyArrivals spaces n arrivals evenly at rate per second.
func steadyArrivals(n int, rate float64) []time.Duration {
	out := make([]time.Duration, n)
	for i := range out {
		out[i] = time.Duration(float64(i) / rate * float64(time.Second))
	}
	return out
}

// startLoraFleet starts one fake worker per --speeds value, named w1,
// w2, ..., whose set_lora takes --lora-switch when it changes the adapter.
func startLoraFleet(o options) (testrouter.Fleet, error) {
	var f testrouter.Fleet
	for i, s := range o.speeds {
		name := fmt.Sprintf("w%d", i+1)
		w, err := fakeworker.Start(fakeworker.Config{Name: name, Speed: s, UnitMs: o.unitMs, LoraSwitch: o.loraSwitch})
		if err != nil {
			f.Close()
			return nil, err
		}
		f = append(f, testrouter.Member{Name: name, Speed: s, Worker: w})
	}
	return f, nil
}

// loraSwitches is the fleet's count of set_lora calls that changed an
// adapter.
func loraSwitches(f testrouter.Fleet) int {
	n := 0
	for _, st := range f.Stats() {
		n += st.LoraSwitches
	}
	return n
}

// placementFront is the router, whose GET /workers says which adapter
// each worker holds.
type placementFront struct {
	url   string
	names map[string]string // worker URL → fleet name
}

// startPlacement starts the router with the adapters declared, and warms
// it up with --warmup jobs on the base weights, so that it knows the
// workers' speed as a router that has been running does.
func startPlacement(ctx context.Context, o options, f testrouter.Fleet) (adapterFront, error) {
	s := strategy{name: "placement", policy: "least_work", routers: 1}
	for _, a := range adapterNames(o.adapters) {
		s.options = append(s.options, fmt.Sprintf("adapter %s %s", a, loraPath(a)))
	}
	s.options = append(s.options, "adapter_switch_prior "+o.loraSwitch.String())
	urls, err := startRouters(ctx, s, f.URLs(), o.maxInflight)
	if err != nil {
		return nil, err
	}
	p := &placementFront{url: urls[0], names: make(map[string]string)}
	for _, m := range f {
		p.names[m.URL()] = m.Name
	}
	c := newClient(urls, max(o.warmup, 1))
	defer c.close()
	outs, _ := measureBatch(slices.Repeat([]job{adapterJob(o)}, o.warmup))(ctx, c)
	for _, oc := range outs {
		if oc.err != nil {
			p.close()
			return nil, fmt.Errorf("warm-up: %w", oc.err)
		}
	}
	return p, nil
}

func (p *placementFront) urls() []string { return []string{p.url} }

func (p *placementFront) close() { stopCaddy() }

func (p *placementFront) holdings(ctx context.Context) ([]holding, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.url+"/workers", nil)
	if err != nil {
		return nil, err
	}
	body, err := adminCall(req)
	if err != nil {
		return nil, err
	}
	var answer struct {
		Workers []struct {
			URL          string `json:"url"`
			Adapter      string `json:"adapter"`
			AdapterState string `json:"adapter_state"`
		} `json:"workers"`
	}
	if err := json.Unmarshal(body, &answer); err != nil {
		return nil, err
	}
	out := make([]holding, len(answer.Workers))
	for i, w := range answer.Workers {
		out[i] = holding{worker: p.names[w.URL], adapter: w.Adapter, state: w.AdapterState}
	}
	return out, nil
}

// holding is which adapter a worker holds ("" for the base weights) and
// in what state: ready, or switching to another.
type holding struct {
	worker, adapter, state string
}

// change is a holding seen at a time since the polling started.
type change struct {
	at time.Duration
	holding
}

// holdingLog is every change of a worker's holding that polling saw, in
// order.
type holdingLog struct {
	changes []change
	errs    int // reads that failed
}

// holdingPoll reads the holdings every so often in the background.
type holdingPoll struct {
	start  time.Time
	cancel context.CancelFunc
	done   sync.WaitGroup
	log    holdingLog
}

func pollHoldings(ctx context.Context, front adapterFront, every time.Duration) *holdingPoll {
	ctx, cancel := context.WithCancel(ctx)
	p := &holdingPoll{start: time.Now(), cancel: cancel}
	p.done.Go(func() {
		last := make(map[string]holding)
		tickUntilDone(ctx, every, func() { p.read(ctx, front, last) })
	})
	return p
}

// tickUntilDone calls f at once and then every so often, until ctx ends.
func tickUntilDone(ctx context.Context, every time.Duration, f func()) {
	tick := time.NewTicker(every)
	defer tick.Stop()
	for ctx.Err() == nil {
		f()
		select {
		case <-ctx.Done():
		case <-tick.C:
		}
	}
}

// read records the holdings that changed since last.
func (p *holdingPoll) read(ctx context.Context, front adapterFront, last map[string]holding) {
	hs, err := front.holdings(ctx)
	if err != nil {
		if ctx.Err() == nil {
			p.log.errs++
		}
		return
	}
	at := time.Since(p.start)
	for _, h := range hs {
		if last[h.worker] != h {
			last[h.worker] = h
			p.log.changes = append(p.log.changes, change{at, h})
		}
	}
}

// since is the time since the polling started.
func (p *holdingPoll) since() time.Duration { return time.Since(p.start) }

// stop ends the polling and returns what it saw.
func (p *holdingPoll) stop() *holdingLog {
	p.cancel()
	p.done.Wait()
	return &p.log
}

// reached is how long after from at least n workers held adapter, ready:
// 0 if they did at from, -1 if never.
func (l *holdingLog) reached(from time.Duration, adapter string, n int) time.Duration {
	held := make(map[string]bool)
	count := func() int {
		k := 0
		for _, h := range held {
			if h {
				k++
			}
		}
		return k
	}
	i := 0
	for ; i < len(l.changes) && l.changes[i].at < from; i++ {
		held[l.changes[i].worker] = l.changes[i].adapter == adapter && l.changes[i].state == "ready"
	}
	if count() >= n {
		return 0
	}
	for ; i < len(l.changes); i++ {
		c := l.changes[i]
		held[c.worker] = c.adapter == adapter && c.state == "ready"
		if count() >= n {
			return c.at - from
		}
	}
	return -1
}

// write prints the changes, one a line.
func (l *holdingLog) write(out io.Writer) {
	for _, c := range l.changes {
		adapter := c.adapter
		if adapter == "" {
			adapter = "base"
		}
		fmt.Fprintf(out, "  %8s  %s  %s  %s\n", fmtSeconds(c.at.Seconds()), c.worker, adapter, c.state)
	}
	if l.errs > 0 {
		fmt.Fprintf(out, "  %d reads of GET /workers failed\n", l.errs)
	}
}
