package diffusionrouter

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/examples/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

var testHealth = &healthConfig{
	interval: 10 * time.Second, timeout: 5 * time.Second, fails: 3, passes: 2, stallFactor: 5,
	maxFails: 3, failWindow: 30 * time.Second, ejectTime: 10 * time.Second, maxEjectTime: 35 * time.Second,
}

var errProbe = errors.New("status 503")

func TestProbesTakeWorkerOutAndBringItBack(t *testing.T) {
	p, clock := poolOf(t, 1)
	w := p.workers[0]
	for i := range 3 {
		want := unchanged
		if i == 2 {
			want = becameUnhealthy
		}
		if got := p.recordProbe("http://a:1", errProbe, testHealth); got != want {
			t.Fatalf("failed probe %d: %v", i+1, got)
		}
		clock.advance(testHealth.interval)
	}
	if w.serving(p.now().UnixNano()) {
		t.Fatal("worker serves after 3 failed probes")
	}
	if p.recordProbe("http://a:1", nil, testHealth) != unchanged || p.recordProbe("http://a:1", nil, testHealth) != becameHealthy {
		t.Fatal("worker did not come back after 2 passed probes")
	}
}

func TestBusyWorkerIsNotDead(t *testing.T) {
	p, clock := poolOf(t, 1)
	cfg := config(scheduler.LeastWork{}, 1)
	p.workers[0].load.speed.Observe(10, 10*time.Second, 0) // 1 unit per second
	tk, _ := choose(t, p, cfg, 60)                         // predicted to run a minute
	timeout := context.DeadlineExceeded
	for range 10 {
		clock.advance(10 * time.Second)
		if p.recordProbe("http://a:1", timeout, testHealth) != unchanged || p.workers[0].health.down {
			t.Fatal("a worker busy within twice its predicted time was marked down for slow probes")
		}
	}
	// 100 s into a 60 s job the worker is no longer excused, but the job
	// has overrun 5x only at 300 s: not yet suspect either.
	if stalled := p.checkStalls(testHealth); len(stalled) != 0 {
		t.Fatalf("suspect at 100 s of a 60 s job: %v", stalled)
	}
	clock.advance(20 * time.Second)
	for range 3 {
		p.recordProbe("http://a:1", timeout, testHealth)
	}
	if !p.workers[0].health.down {
		t.Fatal("timed-out probes past twice the predicted time do count")
	}
	p.release(tk, succeeded)
}

func TestStalledJobMakesWorkerSuspect(t *testing.T) {
	p, clock := poolOf(t, 2)
	cfg := config(scheduler.LeastRequest{}, 0)
	for _, w := range p.workers {
		w.load.speed.Observe(10, 10*time.Second, 0)
	}
	stalled := &ticket{pool: p, cfg: cfg, job: true, cost: 2, pin: "http://a:1"}
	if err := p.acquire(context.Background(), stalled); err != nil {
		t.Fatal(err)
	}
	clock.advance(6 * time.Second) // 3x its 2 s: not yet
	if len(p.checkStalls(testHealth)) != 0 {
		t.Fatal("suspect before health_timeout and 5x the prediction")
	}
	clock.advance(5 * time.Second)
	if got := p.checkStalls(testHealth); len(got) != 1 || got[0] != "http://a:1" {
		t.Fatalf("stalls: %v", got)
	}
	p.recordProbe("http://a:1", nil, testHealth) // its /health still answers
	for range 5 {
		if _, w := choose(t, p, cfg, 1); w != "b" {
			t.Fatalf("a job went to the stalled worker %s", w)
		}
	}
	p.release(stalled, succeeded)
	if !p.workers[0].serving(p.now().UnixNano()) {
		t.Fatal("worker still suspect after its stalled job ended")
	}
}

func TestFailedRequestsEjectWithDoubling(t *testing.T) {
	p, clock := poolOf(t, 1)
	cfg := config(scheduler.LeastRequest{}, 0)
	cfg.health = testHealth
	fail := func(n int) {
		for range n {
			tk, _ := choose(t, p, cfg, 1)
			p.release(tk, failed)
		}
	}
	ejectedFor := func() time.Duration { return time.Duration(p.workers[0].health.ejectedUntil - p.now().UnixNano()) }
	fail(3)
	if d := ejectedFor(); d != 10*time.Second {
		t.Fatalf("first ejection for %v; want 10s", d)
	}
	for _, want := range []time.Duration{20 * time.Second, 35 * time.Second, 35 * time.Second} {
		clock.advance(ejectedFor())
		fail(3)
		if d := ejectedFor(); d != want {
			t.Fatalf("repeat ejection for %v; want %v", d, want)
		}
	}
	clock.advance(ejectedFor())
	tk, _ := choose(t, p, cfg, 1)
	p.release(tk, succeeded) // a success resets the doubling
	fail(3)
	if d := ejectedFor(); d != 10*time.Second {
		t.Fatalf("ejection after a success for %v; want 10s again", d)
	}
	// Failures spread wider than the window do not add up.
	clock.advance(ejectedFor())
	for range 3 {
		fail(1)
		clock.advance(20 * time.Second)
	}
	if ejectedFor() > 0 {
		t.Fatal("failures 20 s apart ejected the worker; the window is 30 s")
	}
}

func TestHealthFailTakesWorkerOutAndBack(t *testing.T) {
	ws := namedWorkers(t, 2, fakeworker.Config{})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n health_interval 20ms\n health_fails 2\n health_passes 2\n}")
	b := ws[1].URL()
	ws[1].SetHealthFail(true)
	waitFor(t, func() bool { return workerStates(t, r)[b]["state"] == "unhealthy" })
	if rd := r.get("/readyz"); rd.status != 200 || rd.json(t)["serving_workers"] != 1.0 {
		t.Fatalf("readyz with one of two serving: %d %s", rd.status, rd.body)
	}
	for range 6 {
		if rp := r.post("/v1/images/generations", smallImage); rp.header.Get("X-Fake-Worker") != "a" {
			t.Fatalf("served by %q while b is unhealthy", rp.header.Get("X-Fake-Worker"))
		}
	}
	// With no worker serving, a job waits for one to come back.
	ws[0].SetHealthFail(true)
	waitFor(t, func() bool { return r.get("/readyz").status == 503 })
	expectStatus(t, "healthz", r.get("/healthz"), 200)
	done := make(chan reply)
	go func() { done <- r.post("/v1/images/generations", smallImage) }()
	waitFor(t, func() bool { return r.get("/health").json(t)["queued_requests"] == 1.0 })
	ws[1].SetHealthFail(false)
	if rp := <-done; rp.status != 200 || rp.header.Get("X-Fake-Worker") != "b" {
		t.Fatalf("waiting job: %d from %q", rp.status, rp.header.Get("X-Fake-Worker"))
	}
	if st := workerStates(t, r)[b]; st["state"] != "serving" || st["last_probe"] == nil {
		t.Fatalf("b after recovering: %v", st)
	}
}

func TestCrashLosesNoUnsentRequest(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "a"}, fakeworker.Config{Name: "b"}, fakeworker.Config{Name: "c", CrashAfter: 3})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n}")
	var mu sync.Mutex
	failures := 0
	var wg sync.WaitGroup
	for range 6 {
		wg.Go(func() {
			for range 15 {
				if rp := r.post("/v1/images/generations", smallImage); rp.status != 200 {
					mu.Lock()
					failures++
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	// The jobs c held when it crashed, and any that reached it as it went
	// down, run again on the others: none is lost.
	if failures > 0 {
		t.Fatalf("%d of 90 requests failed; the jobs the crashing worker held must run again elsewhere", failures)
	}
	// c crashed on the job after its third that ended (a hedge's copy
	// cancelled there ends one too): it served no more than 3.
	if n := ws[2].Stats().Jobs; n > 3 {
		t.Fatalf("c served %d jobs; it crashes after 3", n)
	}
}

func TestHangIsDetectedAsStall(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "a"}, fakeworker.Config{Name: "b", HangAfter: 1})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n policy round_robin\n health_interval 20ms\n health_timeout 50ms\n stall_factor 2\n}")
	for range 2 {
		expectStatus(t, "warm-up", r.post("/v1/images/generations", smallImage), 200)
	}
	// Round robin sends one of two jobs to each worker; b hangs on its second.
	hung := make(chan reply, 2)
	for range 2 {
		go func() { hung <- r.post("/v1/images/generations", smallImage) }()
	}
	if rp := <-hung; rp.header.Get("X-Fake-Worker") != "a" {
		t.Fatalf("the job that returned came from %q", rp.header.Get("X-Fake-Worker"))
	}
	waitFor(t, func() bool { return workerStates(t, r)[ws[1].URL()]["state"] == "suspect" })
	for range 6 {
		if rp := r.post("/v1/images/generations", smallImage); rp.header.Get("X-Fake-Worker") != "a" {
			t.Fatalf("served by %q while b is stalled", rp.header.Get("X-Fake-Worker"))
		}
	}
	ws[1].Close()
	<-hung
}

func TestBusyWorkerWithSlowProbesStaysServing(t *testing.T) {
	// Every probe takes 300 ms and times out at 50 ms, idle or busy: the
	// failures of the probes before the long job must not take the worker
	// out before it starts, hence health_fails 1000. What is checked is that
	// while the worker is busy no slow probe counts as a failure.
	ws := startWorkers(t, fakeworker.Config{Name: "busy", UnitMs: 500, HealthDelay: 300 * time.Millisecond})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n health_interval 30ms\n health_timeout 50ms\n health_fails 1000\n}")
	expectStatus(t, "learn the speed", r.post("/v1/images/generations", `{"response_format":"b64_json","prompt":"x","size":"512x512","num_inference_steps":1}`), 200)
	long := make(chan reply)
	go func() {
		long <- r.post("/v1/images/generations", `{"response_format":"b64_json","prompt":"x","size":"1024x1024","num_inference_steps":4}`)
	}() // 2 s
	u := ws[0].URL()
	var failures any // probe failures counted before the job started
	waitFor(t, func() bool {
		st := workerStates(t, r)[u]
		failures = st["probe_failures"]
		return st["active_requests"] == 1.0
	})
	probes := map[any]bool{}
	waitFor(t, func() bool {
		st := workerStates(t, r)[u]
		if st["state"] != "serving" || st["probe_failures"] != failures {
			t.Fatalf("busy worker with slow probes (%v probe failures before its job): %v", failures, st)
		}
		if st["last_error"] != "" {
			probes[st["last_probe"]] = true
		}
		return len(probes) >= 4
	})
	ws[0].Close()
	<-long
}

func TestDeadWorkerIsEjected(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "live"})
	dead := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	r := startRouter(t, "diffusion_router {\n workers "+dead+" "+ws[0].URL()+"\n policy round_robin\n max_fails 2\n eject_time 1m\n health_interval 1h\n}")
	for i := range 20 {
		expectStatus(t, fmt.Sprint("request ", i), r.post("/v1/images/generations", smallImage), 200)
	}
	st := workerStates(t, r)[dead]
	if st["failures"] != 2.0 || st["state"] != "ejected" || st["ejected_until"] == nil {
		t.Fatalf("dead worker after 20 requests: %v; want ejected after 2 failures and tried no more", st)
	}
}

func TestRetryOnListedStatus(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "flaky", FailRate: 1}, fakeworker.Config{Name: "good"})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n policy round_robin\n retry_on 500\n max_fails 100\n}")
	for range 6 {
		rp := r.post("/v1/images/generations", smallImage)
		if rp.status != 200 || rp.header.Get("X-Fake-Worker") != "good" {
			t.Fatalf("%d from %q; a 500 listed in retry_on goes to another worker", rp.status, rp.header.Get("X-Fake-Worker"))
		}
	}
}

func TestReloadsLeaveNoGoroutines(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{})
	site := "diffusion_router {\n workers " + urlsOf(ws) + "\n health_interval 5ms\n}"
	r := startRouter(t, site)
	// Once the worker has been probed the config has started all it starts.
	waitFor(t, func() bool { return workerStates(t, r)[ws[0].URL()]["last_probe"] != nil })
	client.CloseIdleConnections()
	before, beforePkg := runtime.NumGoroutine(), len(packageGoroutines())
	for i := range 20 {
		r.load(site + fmt.Sprintf("\n# reload %d", i))
	}
	// A goroutine left by each reload would add 20; the tolerance covers a
	// probe in flight and connections that come and go.
	const tolerance = 5
	var after int
	var pkg map[string]string
	if !waitUntilOr(30*time.Second, func() bool {
		client.CloseIdleConnections()
		after, pkg = runtime.NumGoroutine(), packageGoroutines()
		return after <= before+tolerance && len(pkg) <= beforePkg+2
	}) {
		t.Fatalf("after 20 reloads %d goroutines (%d before), %d of this package (%d before); this package's, by creator:\n%s",
			after, before, len(pkg), beforePkg, describeGoroutines(pkg))
	}
}

func TestPassedProbeEndsEjection(t *testing.T) {
	p, _ := poolOf(t, 1)
	cfg := config(scheduler.LeastRequest{}, 0)
	cfg.health = testHealth
	for range 3 {
		tk, _ := choose(t, p, cfg, 1)
		p.release(tk, failed)
	}
	w := p.snapshot()[0]
	if w.State != ejected || w.EjectedTill.IsZero() {
		t.Fatalf("after 3 failures the worker is %v until %v; want ejected", w.State, w.EjectedTill)
	}
	if change := p.recordProbe(w.URL, nil, testHealth); change != ejectionEnded {
		t.Fatalf("a passed probe of an ejected worker changed %v; want its ejection ended", change)
	}
	if w := p.snapshot()[0]; w.State != serving || !w.EjectedTill.IsZero() {
		t.Fatalf("after a passed probe the worker is %v until %v; want serving", w.State, w.EjectedTill)
	}
}

func TestOnlyWorkerFaultsCountAgainstIt(t *testing.T) {
	p, clock := poolOf(t, 1)
	cfg := config(scheduler.LeastRequest{}, 0)
	cfg.health = testHealth
	good, _ := choose(t, p, cfg, 10)
	clock.advance(time.Second)
	p.release(good, succeeded)
	learned := p.snapshot()[0].Speed
	for range 10 { // the worker refuses bad requests at once
		tk, _ := choose(t, p, cfg, 1e6)
		clock.advance(time.Millisecond)
		p.release(tk, refused)
	}
	w := p.snapshot()[0]
	if w.State != serving || w.Failures != 0 || w.Speed != learned {
		t.Fatalf("after 10 refused requests: %v, %d failures, speed %v (was %v); a 4xx says nothing of the worker", w.State, w.Failures, w.Speed, learned)
	}
	for range 3 {
		tk, _ := choose(t, p, cfg, 1)
		p.release(tk, failed)
	}
	if w := p.snapshot()[0]; w.State != ejected || w.Failures != 3 || w.Speed != learned {
		t.Fatalf("after 3 failures: %v, %d failures, speed %v; want ejected, 3, and the speed unlearned from them", w.State, w.Failures, w.Speed)
	}
}

func TestOutcomeOfAnAnswer(t *testing.T) {
	live, gone := context.Background(), canceledContext()
	for _, tc := range []struct {
		ctx    context.Context
		err    error
		status int
		want   outcome
	}{
		{live, nil, 200, succeeded},
		{live, nil, 400, refused},
		{live, nil, 422, refused},
		{live, nil, 500, failed},
		{live, nil, 502, failed},
		{live, errors.New("reset"), 0, failed},
		{gone, nil, 500, abandoned},
	} {
		if got := outcomeOf(tc.ctx, tc.err, tc.status); got != tc.want {
			t.Errorf("outcomeOf(%d, %v) = %v; want %v", tc.status, tc.err, got, tc.want)
		}
	}
}

func canceledContext() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}

func TestFailingWorkersGetLittleAndShowIt(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "always500", FailRate: 1}, fakeworker.Config{Name: "flaky", FailRate: 0.3, Seed: 7},
		fakeworker.Config{Name: "good1"}, fakeworker.Config{Name: "good2"})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n max_fails 3\n eject_time 1m\n}")
	var mu sync.Mutex
	by := map[string]int{}
	var wg sync.WaitGroup
	for range 6 {
		wg.Go(func() {
			for range 20 {
				rp := r.post("/v1/images/generations", smallImage)
				mu.Lock()
				by[rp.header.Get("X-Fake-Worker")]++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	// A worker that fails every job fails fast, so it looks free: it must
	// not draw the traffic, and three failures eject it.
	if n := by["always500"]; n > 12 {
		t.Fatalf("the worker failing every job answered %d of 120 requests (%v)", n, by)
	}
	states := workerStates(t, r)
	if st := states[ws[0].URL()]; st["state"] != "ejected" || st["failures"].(float64) < 3 {
		t.Fatalf("the worker failing every job shows %v", st)
	}
	if st := states[ws[1].URL()]; st["failures"] == 0.0 {
		t.Fatalf("the worker failing 30%% of its jobs shows no failure: %v (served %v)", st, by)
	}
}
