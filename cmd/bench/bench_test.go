package main

import (
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig"

	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

func TestMakeJobsProportions(t *testing.T) {
	for name, mix := range mixes {
		jobs := makeJobs(mix, 400, 1)
		if len(jobs) != 400 {
			t.Fatalf("%s: %d jobs, want 400", name, len(jobs))
		}
		counts := map[job]int{}
		for _, j := range jobs {
			counts[j]++
		}
		for _, s := range mix {
			if want := 4 * s.percent; counts[s.job] != want {
				t.Errorf("%s: %d× %s, want %d", name, counts[s.job], s.job, want)
			}
		}
	}
}

func TestApportionRounding(t *testing.T) {
	mix := mixes["mixed"] // 50, 30, 15, 5
	for n := 1; n <= 60; n++ {
		counts := apportion(mix, n)
		total := 0
		for i, c := range counts {
			total += c
			exact := float64(n*mix[i].percent) / 100
			if math.Abs(float64(c)-exact) >= 1 {
				t.Errorf("n=%d: %d× %s, exact share %.2f", n, c, mix[i].job, exact)
			}
		}
		if total != n {
			t.Errorf("n=%d: counts %v add up to %d", n, counts, total)
		}
	}
	if got := apportion(mix, 10); !slices.Equal(got, []int{5, 3, 2, 0}) {
		t.Errorf("n=10: %v, want [5 3 2 0] (15%% rounds up before 5%%)", got)
	}
}

func TestMakeJobsDeterministic(t *testing.T) {
	mix := mixes["mixed"]
	a, b := makeJobs(mix, 200, 7), makeJobs(mix, 200, 7)
	if !slices.Equal(a, b) {
		t.Fatal("the same seed gave different sequences")
	}
	if c := makeJobs(mix, 200, 8); slices.Equal(a, c) {
		t.Fatal("seeds 7 and 8 gave the same sequence")
	}
}

func TestPoissonArrivals(t *testing.T) {
	const n, rate = 20000, 50.0
	a := poissonArrivals(n, rate, 3)
	if !slices.Equal(a, poissonArrivals(n, rate, 3)) {
		t.Fatal("the same seed gave different traces")
	}
	if a[0] != 0 || !slices.IsSorted(a) {
		t.Fatal("arrivals do not start at 0 and rise")
	}
	meanGap := a[n-1].Seconds() / (n - 1)
	if math.Abs(meanGap*rate-1) > 0.03 {
		t.Errorf("mean gap %.5fs, want about %.5fs", meanGap, 1/rate)
	}
}

func TestArrivalRateAndBound(t *testing.T) {
	heavy := mixes["heavy"] // 0.9 × (0.25 × 8) + 0.1 × (2.25 × 50) = 13.05 units
	if got := meanCost(heavy); math.Abs(got-13.05) > 1e-9 {
		t.Fatalf("mean cost of heavy = %v, want 13.05", got)
	}
	speeds := []float64{1, 1, 1, 2} // 500 units/s at 10 ms per unit
	if got, want := arrivalRate(heavy, speeds, 10, 0.7), 0.7*500/13.05; math.Abs(got-want) > 1e-9 {
		t.Errorf("arrival rate %v, want %v", got, want)
	}
	// One big job dominates: 1536²×50 = 112.5 units, on speed 2.
	if got := batchBound([]job{{1536, 1536, 50}, {512, 512, 8}}, speeds); got != 112.5/2 {
		t.Errorf("bound %v, want 56.25", got)
	}
	// Many small jobs: total / total speed = 10 × 2 / 5.
	small := slices.Repeat([]job{{512, 512, 8}}, 10)
	if got := batchBound(small, speeds); got != 4 {
		t.Errorf("bound %v, want 4", got)
	}
}

// batchJobs is a batch for the simulator: everything arrives at 0.
func batchJobs(work ...float64) []simJob {
	jobs := make([]simJob, len(work))
	for i, w := range work {
		jobs[i].work = w
	}
	return jobs
}

func checkSim(t *testing.T, got []simResult, want []simResult) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%d results, want %d", len(got), len(want))
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("job %d: %+v, want %+v", i, got[i], want[i])
		}
	}
}

func TestSimulateBatchFastestFirst(t *testing.T) {
	// Speeds 1 and 2, work 4, 2, 2 at once: job 0 to the fast worker
	// (0→2), job 1 to the slow one (0→2), job 2 to the fast one at 2 (→3).
	got := simulate(batchJobs(4, 2, 2), []float64{1, 2}, fifoOrder)
	checkSim(t, got, []simResult{{1, 0, 2}, {0, 0, 2}, {1, 2, 3}})
}

func TestSimulateLPTBeatsFIFO(t *testing.T) {
	speeds := []float64{1, 2}
	jobs := batchJobs(1, 4, 2)
	// LPT: 4 on the fast worker (0→2), 2 on the slow one (0→2), 1 on the
	// fast one at 2 (→2.5).
	checkSim(t, simulate(jobs, speeds, largestFirst), []simResult{{1, 2, 2.5}, {1, 0, 2}, {0, 0, 2}})
	// FIFO: 1 on the fast worker (0→0.5), 4 on the slow one (0→4), 2 on the
	// fast one at 0.5 (→1.5): makespan 4.
	checkSim(t, simulate(jobs, speeds, fifoOrder), []simResult{{1, 0, 0.5}, {0, 0, 4}, {1, 0.5, 1.5}})
}

func TestSimulateArrivals(t *testing.T) {
	// Speeds 1 and 2. Job 0 (work 2) at 0 takes the idle fast worker
	// (→1); job 1 (2) at 0.5 the slow one (→2.5); job 2 (1) at 1 the fast
	// one, just freed (→1.5); job 3 (1) at 3 finds both idle and takes
	// the fast one (→3.5).
	jobs := []simJob{{0, 2}, {0.5, 2}, {1, 1}, {3, 1}}
	got := simulate(jobs, []float64{1, 2}, fifoOrder)
	checkSim(t, got, []simResult{{1, 0, 1}, {0, 0.5, 2.5}, {1, 1, 1.5}, {1, 3, 3.5}})
}

func TestSimulateQueueing(t *testing.T) {
	// One worker: jobs wait their turn, in arrival order even when given
	// out of order.
	jobs := []simJob{{1, 1}, {0, 2}, {0.5, 1}}
	got := simulate(jobs, []float64{1}, fifoOrder)
	checkSim(t, got, []simResult{{0, 3, 4}, {0, 0, 2}, {0, 2, 3}})
}

func TestSimulateZeroWork(t *testing.T) {
	got := simulate(batchJobs(0, 0, 1), []float64{1}, fifoOrder)
	checkSim(t, got, []simResult{{0, 0, 0}, {0, 0, 0}, {0, 0, 1}})
}

func TestPercentile(t *testing.T) {
	ten := []float64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	for _, c := range []struct{ p, want float64 }{{50, 5}, {90, 9}, {99, 10}, {100, 10}, {1, 1}} {
		if got := percentile(ten, c.p); got != c.want {
			t.Errorf("p%g of 1..10 = %g, want %g", c.p, got, c.want)
		}
	}
	hundred := make([]float64, 100)
	for i := range hundred {
		hundred[i] = float64(i + 1)
	}
	if got := percentile(hundred, 99); got != 99 {
		t.Errorf("p99 of 1..100 = %g, want 99", got)
	}
	if got := percentile([]float64{7}, 50); got != 7 {
		t.Errorf("p50 of [7] = %g", got)
	}
	if !math.IsNaN(percentile(nil, 50)) {
		t.Error("percentile of nothing is not NaN")
	}
	s := summarize([]float64{4, 1, 3, 2})
	if s.mean != 2.5 || s.p50 != 2 || s.p99 != 4 {
		t.Errorf("summary %+v", s)
	}
}

func TestSVGWellFormed(t *testing.T) {
	many := make([]float64, 5000)
	for i := range many {
		many[i] = float64(i) / 1000
	}
	panels := []panel{
		{title: `batch <heavy> & "quoted"`, xLabel: "latency (s)", series: []series{
			{name: "least_work/fifo", values: []float64{0.5, 1, 2}},
			{name: "a<b & c", values: many},
			{name: "empty"},
			{name: "ideal (simulated)", values: []float64{0.4, 0.9}, dashed: true},
		}},
		{title: "nothing to plot"},
		{title: "log", logX: true, series: []series{{name: "x", values: []float64{0, 0.002, 0.3, 12}}}},
	}
	var b strings.Builder
	if err := writeSVG(&b, panels); err != nil {
		t.Fatal(err)
	}
	dec := xml.NewDecoder(strings.NewReader(b.String()))
	counts := map[string]int{}
	root := ""
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("not well-formed XML: %v", err)
		}
		if el, ok := tok.(xml.StartElement); ok {
			if root == "" {
				root = el.Name.Local
			}
			counts[el.Name.Local]++
		}
	}
	if root != "svg" {
		t.Errorf("root element %q, want svg", root)
	}
	if counts["polyline"] != 4 {
		t.Errorf("%d polylines, want 4 (one per non-empty series)", counts["polyline"])
	}
	if !strings.Contains(b.String(), "a&lt;b &amp; c") {
		t.Error("series name not escaped")
	}
}

func TestXTicks(t *testing.T) {
	lin := xTicks(plotArea{xMin: 0, xMax: 10.3})
	if len(lin) != 6 || lin[1].value != 2 || lin[5].label != "10" {
		t.Errorf("linear ticks %v", lin)
	}
	logTicks := xTicks(plotArea{xMin: 0.01, xMax: 1.5, logX: true})
	var labels []string
	for _, tk := range logTicks {
		labels = append(labels, tk.label)
	}
	if want := "0.01 0.02 0.05 0.1 0.2 0.5 1"; strings.Join(labels, " ") != want {
		t.Errorf("log ticks %q, want %q", strings.Join(labels, " "), want)
	}
}

func TestCDFPoints(t *testing.T) {
	pts := cdfPoints([]float64{1, 2, 3, 4}, 100)
	want := [][2]float64{{1, 0}, {1, 0.25}, {2, 0.25}, {2, 0.5}, {3, 0.5}, {3, 0.75}, {4, 0.75}, {4, 1}}
	if !slices.Equal(pts, want) {
		t.Errorf("staircase %v, want %v", pts, want)
	}
	big := make([]float64, 10001)
	pts = cdfPoints(big, 500)
	if len(pts) > 2*510 || pts[len(pts)-1][1] != 1 {
		t.Errorf("thinned to %d points, last %v", len(pts), pts[len(pts)-1])
	}
}

// TestStrategyConfigsAdapt checks that every default strategy's generated
// Caddyfile adapts, so a typo in the generator fails here and not after a
// benchmark run.
func TestStrategyConfigsAdapt(t *testing.T) {
	strategies, err := parseStrategies(defaultStrategies)
	if err != nil {
		t.Fatal(err)
	}
	adapter := caddyconfig.GetAdapter("caddyfile")
	workers := []string{"http://127.0.0.1:30001", "http://127.0.0.1:30002"}
	for _, s := range strategies {
		text := s.caddyfile([]int{18080}, "benchtest", workers, 2)
		if _, _, err := adapter.Adapt([]byte(text), nil); err != nil {
			t.Errorf("%s: %v\n%s", s.name, err, text)
		}
	}
	for _, bad := range []string{"caddy/", "least_work@0", "least_work@two", "least_work@2halves"} {
		if _, err := parseStrategies(bad); err == nil {
			t.Errorf("%s was accepted", bad)
		}
	}
}

// TestReplicaConfigs checks the configs of router replicas: "@2" puts every
// worker behind both routers, "@2split" gives each router every other one;
// each router has a pool of its own.
func TestReplicaConfigs(t *testing.T) {
	strategies, err := parseStrategies("least_work/largest_first@2,least_work@2split,caddy/least_conn@2")
	if err != nil {
		t.Fatal(err)
	}
	workers := []string{"http://127.0.0.1:30001", "http://127.0.0.1:30002", "http://127.0.0.1:30003", "http://127.0.0.1:30004"}
	for _, tc := range []struct {
		s     strategy
		sites []string
	}{
		{strategies[0], []string{
			"diffusion_router bench-1 {\n\t\tworkers " + strings.Join(workers, " "),
			"diffusion_router bench-2 {\n\t\tworkers " + strings.Join(workers, " "),
		}},
		{strategies[1], []string{
			"diffusion_router bench-1 {\n\t\tworkers http://127.0.0.1:30001 http://127.0.0.1:30003\n",
			"diffusion_router bench-2 {\n\t\tworkers http://127.0.0.1:30002 http://127.0.0.1:30004\n",
		}},
		{strategies[2], []string{
			":18080 {\n\treverse_proxy 127.0.0.1:30001 127.0.0.1:30002 127.0.0.1:30003 127.0.0.1:30004",
			":18081 {\n\treverse_proxy 127.0.0.1:30001 127.0.0.1:30002 127.0.0.1:30003 127.0.0.1:30004",
		}},
	} {
		if tc.s.routers != 2 {
			t.Errorf("%s: %d routers, want 2", tc.s.name, tc.s.routers)
		}
		text := tc.s.caddyfile([]int{18080, 18081}, "bench", workers, 0)
		for _, site := range tc.sites {
			if !strings.Contains(text, site) {
				t.Errorf("%s: the config lacks %q:\n%s", tc.s.name, site, text)
			}
		}
		if _, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(text), nil); err != nil {
			t.Errorf("%s: %v\n%s", tc.s.name, err, text)
		}
	}
}

func TestParseFlags(t *testing.T) {
	o, err := parseFlags([]string{"--speeds", "1, 2.5", "--mode", "open"})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(o.speeds, []float64{1, 2.5}) || o.warmup != 4 || len(o.strategies) != 7 {
		t.Errorf("parsed %+v", o)
	}
	if o, err := parseFlags([]string{"--mode", "refit"}); err != nil || len(o.speeds) != 8 || o.refitGroup != 2 {
		t.Errorf("refit mode: %v, %d workers refit %d at a time; want 8, 2", err, len(o.speeds), o.refitGroup)
	}
	for _, bad := range [][]string{{"--mode", "x"}, {"--mix", "x"}, {"--speeds", "1,0"}, {"--n", "0"},
		{"--refit-group", "0"}, {"--transfer", "-1s"}, {"--mode", "refit", "--router", "http://127.0.0.1:1"}} {
		if _, err := parseFlags(bad); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
}

// TestOversampleMode runs both plans at a small scale on one worker: each
// step gets its groups, the exact plan aborts nothing, and oversampling
// sends its groups at once and aborts the ones left when enough passed
// (a step where 3 of its 4 groups pass leaves at least one image queued).
func TestOversampleMode(t *testing.T) {
	args := []string{"--mode", "oversample", "--n", "2", "--group", "2", "--steps", "2", "--oversample", "2",
		"--mix", "uniform", "--speeds", "1", "--unit-ms", "5", "--warmup", "0", "--strategies", "least_work/fifo"}
	o, err := parseFlags(args)
	if err != nil {
		t.Fatal(err)
	}
	for o.seed = 1; ; o.seed++ { // a seed whose steps each keep 3 of their first 4 groups
		kept := 0
		for s := range 2 {
			for g := range 4 {
				if keeps(o, s, g) {
					kept++
				}
			}
		}
		if kept == 6 {
			break
		}
	}
	cleanHome, err := testrouter.IsolateHome("bench-oversample-test-")
	if err != nil {
		t.Fatal(err)
	}
	defer cleanHome()
	logs := map[float64]*stepLog{1: {}, 2: {}}
	for factor, log := range logs {
		res := runPlan(t.Context(), o, plan{fmt.Sprint(factor), factor}, log)
		if res.err != nil || len(log.times) != 2 || len(log.abortErrs) > 0 {
			t.Fatalf("plan %gx: %v, %d steps, abort errors %v", factor, res.err, len(log.times), log.abortErrs)
		}
	}
	exact := 0 // each step sends groups until 2 have passed
	for s := range 2 {
		for g, passed := 0, 0; passed < 2; g++ {
			exact++
			if keeps(o, s, g) {
				passed++
			}
		}
	}
	if l := logs[1]; l.waiting+l.running != 0 || l.groups != exact {
		t.Errorf("exact plan: %d groups sent, %d/%d aborted; want %d, none aborted", l.groups, l.waiting, l.running, exact)
	}
	if l := logs[2]; l.groups != 8 || l.waiting == 0 {
		t.Errorf("oversample plan: %d groups sent, %d/%d aborted; want 8 sent, some aborted while waiting", l.groups, l.waiting, l.running)
	}
}

// adapterOptions parses the adapters mode's flags for a test, with a
// home of its own.
func adapterOptions(t *testing.T, args ...string) options {
	return testOptions(t, append([]string{"--mode", "adapters", "--unit-ms", "1"}, args...)...)
}

// testOptions parses the bench's flags for a test, and gives the test a
// home of its own until it ends, as the bench's run does.
func testOptions(t *testing.T, args ...string) options {
	t.Helper()
	o, err := parseFlags(args)
	if err != nil {
		t.Fatal(err)
	}
	cleanHome, err := testrouter.IsolateHome("bench-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cleanHome)
	return o
}

// TestAdaptersModeAnswers runs the three ways of serving adapters at a
// hundredth of the full scale (switches of 50 ms, jobs of 10 ms): every
// answer comes from its own adapter, and a static split never has three
// workers on adapter a.
func TestAdaptersModeAnswers(t *testing.T) {
	o := adapterOptions(t, "--lora-switch", "50ms", "--job-time", "10ms", "--adapter-jobs", "10")
	for _, s := range adapterStrategies {
		run, err := runAdapters(t.Context(), o, s, 3)
		if err != nil {
			t.Fatalf("%s: %v", s.name, err)
		}
		if run.wrong != 0 || len(run.phase1) != 40 || len(run.phase2) != 40 {
			t.Errorf("%s: %d wrong answers of %d+%d", s.name, run.wrong, len(run.phase1), len(run.phase2))
		}
		if s.name == "static split" && (run.holders >= 0 || run.switches1 != 4) {
			t.Errorf("static split: 3 holders of a after %s, %d switches; want never, 4", run.holders, run.switches1)
		}
	}
}

// TestPlacementBounds holds placement to issue 24's bounds at a tenth of
// the full scale (switches of 500 ms, jobs of 100 ms, 15 jobs of each of
// 4 adapters): phase 1 within 1.6 × (work per worker + switch), three
// workers on adapter a within two switches of phase 2's start. A
// hundredth would be quicker, but there a job's HTTP round trips and the
// race detector are a fair share of its 10 ms.
func TestPlacementBounds(t *testing.T) {
	o := adapterOptions(t, "--lora-switch", "500ms", "--job-time", "100ms", "--adapter-jobs", "15")
	run, err := runAdapters(t.Context(), o, adapterStrategies[0], 3)
	if err != nil {
		t.Fatal(err)
	}
	// work per worker: 60 jobs of 100 ms on 4 workers
	bound := 1.6 * (1500 + 500) * time.Millisecond
	if run.wrong != 0 || run.makespan1 > bound || run.holders < 0 || run.holders > 2*o.loraSwitch {
		var log strings.Builder
		run.log.write(&log)
		t.Errorf("placement: %d wrong answers, phase 1 took %s (bound %s), 3 holders of a after %s (bound %s)\n%s",
			run.wrong, run.makespan1, bound, run.holders, 2*o.loraSwitch, log.String())
	}
}

func TestHoldersReached(t *testing.T) {
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	log := holdingLog{changes: []change{
		{ms(0), holding{"w1", "a", "ready"}},
		{ms(0), holding{"w2", "a", "ready"}},
		{ms(0), holding{"w3", "a", "ready"}},
		{ms(10), holding{"w3", "a", "switching to b"}},
		{ms(20), holding{"w4", "a", "ready"}},
		{ms(30), holding{"w2", "b", "ready"}},
	}}
	for _, tc := range []struct {
		from time.Duration
		want time.Duration
	}{{ms(0), 0}, {ms(5), 0}, {ms(12), ms(8)}, {ms(25), 0}, {ms(31), -1}} {
		if got := log.reached(tc.from, "a", 3); got != tc.want {
			t.Errorf("from %s: %s, want %s", tc.from, got, tc.want)
		}
	}
}

// TestRefitMode runs the refit mode at a tiny scale (24 jobs of 20 ms on
// 4 workers, refit 2 at a time with transfers of 20 ms): its report has a
// row per policy with every field, no job failed, and every answer names
// step-1 or step-2 in X-Weight-Version.
func TestRefitMode(t *testing.T) {
	o := testOptions(t, "--mode", "refit", "--mix", "uniform", "--n", "24", "--speeds", "1,1,1,1", "--unit-ms", "1",
		"--transfer", "20ms", "--refit-after", "20ms", "--warmup", "0", "--strategies", "least_work/fifo")
	var out strings.Builder
	benchRefit(t.Context(), o, &out)
	report := out.String()
	table := map[string][]string{}
	var header []string
	for line := range strings.Lines(report) {
		cells := splitCells(line)
		switch {
		case len(cells) > 0 && cells[0] == "policy":
			header = cells
		case header != nil && len(cells) == len(header):
			table[cells[0]] = cells
		}
	}
	want := []string{"policy", "runs", "requests", "failed", "makespan", "idle while jobs wait", "during the refit", "fleet busy", "refit done", "answers step-1/step-2"}
	if !slices.Equal(header, want) {
		t.Fatalf("header %q, want %q\n%s", header, want, report)
	}
	for _, p := range refitPolicies {
		cells := table[p]
		if cells == nil {
			t.Fatalf("no row for %s\n%s", p, report)
		}
		var old, fresh int
		if _, err := fmt.Sscanf(cells[9], "%d/%d", &old, &fresh); err != nil || cells[2] != "24" || cells[3] != "0" || old+fresh != 24 {
			t.Errorf("%s: %q; want 24 requests, none failed, 24 answers on step-1 or step-2\n%s", p, cells, report)
		}
		for i, c := range cells[4:9] {
			if c == "-" || c == "" {
				t.Errorf("%s: %s is %q\n%s", p, header[4+i], c, report)
			}
		}
	}
	if strings.Contains(report, "  latest: ") || strings.Contains(report, "  max-staleness:1: ") {
		t.Errorf("notes under the table: a run or its trainer failed\n%s", report)
	}
}

// splitCells splits a line of a report table into its cells, which two or
// more spaces part.
func splitCells(line string) []string {
	var cells []string
	for c := range strings.SplitSeq(strings.TrimSpace(line), "  ") {
		if c = strings.TrimSpace(c); c != "" {
			cells = append(cells, c)
		}
	}
	return cells
}
