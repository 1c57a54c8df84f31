package e2e

// A rollout step's batch on a fleet with a faulty worker, timed against
// the same batch without the fault, and a stream of jobs beside a worker
// that breaks its answers: what hedging and ejection buy a step.

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// batchOf sends n jobs at once, as a rollout step does, and reports how
// long the last took and how many did not answer 200.
func batchOf(t *testing.T, r *testrouter.Router, n int, body string) (time.Duration, int) {
	t.Helper()
	start := time.Now()
	var mu sync.Mutex
	failed := 0
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			if rp := r.Post("/v1/images/generations", body); rp.Status != 200 {
				mu.Lock()
				failed++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return time.Since(start), failed
}

// stepWithFault runs a batch of 60 heavy jobs on workers of speeds 1, 1,
// 1 and 2, the fast one with the fault.
func stepWithFault(t *testing.T, pool string, fault fakeworker.Config) (time.Duration, int, *testrouter.Router) {
	t.Helper()
	fault.Name, fault.Speed, fault.UnitMs = "faulty", 2, 10
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a", UnitMs: 10}, fakeworker.Config{Name: "b", UnitMs: 10},
		fakeworker.Config{Name: "c", UnitMs: 10}, fault)
	// Jobs of 100-200 ms: a copy is considered once a job overruns 5 times
	// its prediction and health_timeout, here 1 s.
	r := testrouter.Start(t, testrouter.MetricsSite("diffusion_router "+pool+" {\n workers "+testrouter.URLs(ws)+"\n health_timeout 1s\n}"))
	took, failed := batchOf(t, r, 60, testrouter.HeavyImage)
	return took, failed, r
}

func TestHungWorkerCostsAStepLittleMoreThanACrashedOne(t *testing.T) {
	// The counters are the process's: the hung pool's may hold an earlier
	// run's hedges (-count), so the step's are what it adds.
	hungWon := map[string]string{"pool": "hung", "outcome": "won"}
	crashed, lostToCrash, r := stepWithFault(t, "crashed", fakeworker.Config{CrashAfter: 5})
	wonBefore := testrouter.Value(t, r, "caddy_diffusion_hedges_total", hungWon)
	hung, lostToHang, r := stepWithFault(t, "hung", fakeworker.Config{HangAfter: 5})
	t.Logf("step with a crashed worker %v, with a hung one %v (%.2fx)", crashed, hung, hung.Seconds()/crashed.Seconds())
	if lostToCrash+lostToHang > 0 {
		t.Fatalf("%d jobs failed with a crashed worker, %d with a hung one; want none", lostToCrash, lostToHang)
	}
	if won := testrouter.Value(t, r, "caddy_diffusion_hedges_total", hungWon) - wonBefore; won < 1 {
		t.Fatalf("hedges won: %g; the jobs the hung worker held end by their copies", won)
	}
	// The bar is 1.15x; a loaded test machine gets some slack.
	if hung > crashed*115/100+300*time.Millisecond {
		t.Fatalf("a step with a hung worker took %v, against %v with a crashed one", hung, crashed)
	}
}

// served sends n jobs at once and reports how long the last took and, for
// each, the worker that answered it (X-Fake-Worker), or what went wrong. A
// job unanswered after limit counts as lost.
func served(t *testing.T, r *testrouter.Router, n int, body string, limit time.Duration) (time.Duration, []string) {
	t.Helper()
	start := time.Now()
	by := make([]string, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), limit)
			defer cancel()
			req, _ := http.NewRequestWithContext(ctx, "POST", r.Base+"/v1/images/generations", strings.NewReader(body))
			resp, err := testrouter.Client.Do(req)
			if err != nil {
				by[i] = err.Error()
				return
			}
			defer resp.Body.Close()
			if _, err := io.Copy(io.Discard, resp.Body); err != nil || resp.StatusCode != 200 {
				by[i] = fmt.Sprintf("status %d, %v", resp.StatusCode, err)
				return
			}
			by[i] = resp.Header.Get("X-Fake-Worker")
		})
	}
	wg.Wait()
	return time.Since(start), by
}

func TestAWorkerHungFromTheStartCostsABatchOneHedge(t *testing.T) {
	good := testrouter.StartWorkers(t, fakeworker.Config{Name: "a", UnitMs: 10}, fakeworker.Config{Name: "b", UnitMs: 10},
		fakeworker.Config{Name: "c", UnitMs: 10})
	hung := testrouter.StartWorkers(t, fakeworker.Config{Name: "hung", UnitMs: 10})[0]
	hung.Hang() // accepts jobs, never answers them; /health still answers
	site := func(pool string, ws []*fakeworker.Worker) string {
		return testrouter.MetricsSite("diffusion_router " + pool + " {\n workers " + testrouter.URLs(ws) + "\n health_timeout 1s\n}")
	}
	// Far beyond the batch's second or so, far short of the 100 s that
	// hedge_after times the 20 s predicted at 1 unit/s would wait.
	const limit = 20 * time.Second
	const jobs = 12 // of 200 ms: four rounds on three workers

	r := testrouter.Start(t, site("without_hung", good))
	without, by := served(t, r, jobs, testrouter.HeavyImage, limit)
	for _, w := range by {
		if w != "a" && w != "b" && w != "c" {
			t.Fatalf("without the hung worker a job got %q", w)
		}
	}

	// Fresh pools: nothing is learned when the batch starts.
	r = testrouter.Start(t, site("with_hung", slices.Concat(good, []*fakeworker.Worker{hung})))
	won := map[string]string{"pool": "with_hung", "outcome": "won"}
	wonBefore := testrouter.Value(t, r, "caddy_diffusion_hedges_total", won)
	with, by := served(t, r, jobs, testrouter.HeavyImage, limit)
	for _, w := range by {
		if w != "a" && w != "b" && w != "c" {
			t.Fatalf("with a worker hung from the start, a job got %q; want every job answered by a, b or c: %q", w, by)
		}
	}
	if n := testrouter.Value(t, r, "caddy_diffusion_hedges_total", won) - wonBefore; n < 1 {
		t.Fatalf("hedges won: %g; the job the hung worker took ends by its copy", n)
	}
	// The documented bound: the hung worker holds its job until it has
	// run hedge_after (5) times its time at the speed the pool learned
	// from the others (what it now predicts for the hung worker), and at
	// least health_timeout; then the copy runs once.
	speed := r.Workers()[hung.URL()]["speed"].(float64)
	job := time.Duration(20 / speed * float64(time.Second))
	bound := without*11/10 + max(5*job, time.Second) + job
	t.Logf("batch of %d: %v on the 3 good workers, %v with one hung from the start (job predicted at %v; bound %v)", jobs, without, with, job, bound)
	if with > bound {
		t.Fatalf("with a worker hung from the start the batch took %v, beyond %v", with, bound)
	}
}

// The other side of the bound: a healthy first job on a worker slower than
// the others, but within hedge_after of them, runs to its end uncopied,
// though it runs longer than health_timeout.
func TestASlowFirstJobWithinItsBoundGetsNoCopy(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "fast", UnitMs: 10}, fakeworker.Config{Name: "slow", UnitMs: 10, Speed: 0.4})
	r := testrouter.Start(t, testrouter.MetricsSite("diffusion_router slow_first {\n workers "+testrouter.URLs(ws)+"\n health_timeout 400ms\n}"))
	launched := map[string]string{"pool": "slow_first", "outcome": "launched"}
	before := testrouter.Value(t, r, "caddy_diffusion_hedges_total", launched)
	// 200 ms on the fast worker, 500 ms on the slow one: a copy would be
	// due after 5 x 200 ms.
	_, by := served(t, r, 2, testrouter.HeavyImage, 20*time.Second)
	slices.Sort(by)
	if by[0] != "fast" || by[1] != "slow" {
		t.Fatalf("two jobs on two idle workers were answered by %q; want one each", by)
	}
	if n := testrouter.Value(t, r, "caddy_diffusion_hedges_total", launched) - before; n != 0 {
		t.Fatalf("%g copies of a first job running 2.5x the others' time", n)
	}
}

// A worker that breaks every answer it begins as a 200, each way a worker
// can (reset, closed short, truncated JSON), passes its health probes all
// along. Ejected at its third broken answer, it is back only when its
// ejection ends, however often its probes pass, and out again at its
// first answer back, for twice as long: beside two good workers it draws
// a few jobs of a stream.
func TestWorkerBreakingEveryAnswerDrawsFewJobs(t *testing.T) {
	// Jobs of tens of milliseconds, where the GPU's take seconds: jobs of
	// none would dwarf what a broken worker draws while it is back.
	const unitMs = 200
	third := 1.0 / 3
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "breaks", UnitMs: unitMs, CloseRate: third, ResetRate: third, TruncateRate: third},
		fakeworker.Config{Name: "good1", UnitMs: unitMs}, fakeworker.Config{Name: "good2", UnitMs: unitMs})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+
		"\n max_fails 3\n eject_time 1s\n max_eject_time 1m\n health_interval 100ms\n}")
	const run = 6 * time.Second // ejections of 1 s, 2 s and 4 s: it is back at 1 s and 3 s
	end := time.Now().Add(run)
	served := make(chan map[string]int, 1)
	go func() { served <- testrouter.SendImages(t, r, 6, func(int) bool { return time.Now().Before(end) }) }()
	bad := ws[0].URL()
	testrouter.WaitFor(t, func() bool { return r.Workers()[bad]["state"] == "ejected" })
	if got := ws[0].Stats().Broken; got > 4 {
		t.Errorf("the worker breaking every answer was first ejected after %d jobs; want out by its 4th", got)
	}
	by := <-served
	broken := ws[0].Stats().Broken
	jobs := broken + ws[1].Stats().Jobs + ws[2].Stats().Jobs
	t.Logf("the worker breaking every answer drew %d of %d jobs", broken, jobs)
	if by["breaks"] != 0 || broken*100 > jobs*5 {
		t.Fatalf("the worker breaking every answer drew %d of %d jobs in %v (answers by worker: %v); want at most 5%%", broken, jobs, run, by)
	}
}
