package diffusionrouter_test

import (
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

func TestHealthFailTakesWorkerOutAndBack(t *testing.T) {
	ws := namedWorkers(t, 2, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n health_interval 20ms\n health_fails 2\n health_passes 2\n}")
	b := ws[1].URL()
	ws[1].SetHealthFail(true)
	testrouter.WaitFor(t, func() bool { return r.Workers()[b]["state"] == "unhealthy" })
	if rd := r.Get("/readyz"); rd.Status != 200 || rd.JSON(t)["serving_workers"] != 1.0 {
		t.Fatalf("readyz with one of two serving: %d %s", rd.Status, rd.Body)
	}
	for range 6 {
		if rp := r.Post("/v1/images/generations", testrouter.SmallImage); rp.Header.Get("X-Fake-Worker") != "a" {
			t.Fatalf("served by %q while b is unhealthy", rp.Header.Get("X-Fake-Worker"))
		}
	}
	// With no worker serving, a job waits for one to come back.
	ws[0].SetHealthFail(true)
	testrouter.WaitFor(t, func() bool { return r.Get("/readyz").Status == 503 })
	testrouter.ExpectStatus(t, "healthz", r.Get("/healthz"), 200)
	done := make(chan testrouter.Reply)
	go func() { done <- r.Post("/v1/images/generations", testrouter.SmallImage) }()
	testrouter.WaitFor(t, func() bool { return r.Get("/health").JSON(t)["queued_requests"] == 1.0 })
	ws[1].SetHealthFail(false)
	if rp := <-done; rp.Status != 200 || rp.Header.Get("X-Fake-Worker") != "b" {
		t.Fatalf("waiting job: %d from %q", rp.Status, rp.Header.Get("X-Fake-Worker"))
	}
	if st := r.Workers()[b]; st["state"] != "serving" || st["last_probe"] == nil {
		t.Fatalf("b after recovering: %v", st)
	}
}

func TestCrashLosesNoUnsentRequest(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a"}, fakeworker.Config{Name: "b"}, fakeworker.Config{Name: "c", CrashAfter: 3})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	var mu sync.Mutex
	failures := 0
	var wg sync.WaitGroup
	for range 6 {
		wg.Go(func() {
			for range 15 {
				if rp := r.Post("/v1/images/generations", testrouter.SmallImage); rp.Status != 200 {
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

// Hedging off, so that the hung job stays on b: a copy winning on a would
// end it, and b's suspicion with the next probe (hedges have tests of
// their own).
func TestHangIsDetectedAsStall(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a"}, fakeworker.Config{Name: "b", HangAfter: 1})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n policy round_robin\n health_interval 20ms\n health_timeout 50ms\n stall_factor 2\n hedge_after off\n}")
	for range 2 {
		testrouter.ExpectStatus(t, "warm-up", r.Post("/v1/images/generations", testrouter.SmallImage), 200)
	}
	// Round robin sends one of two jobs to each worker; b hangs on its second.
	hung := make(chan testrouter.Reply, 2)
	for range 2 {
		go func() { hung <- r.Post("/v1/images/generations", testrouter.SmallImage) }()
	}
	if rp := <-hung; rp.Header.Get("X-Fake-Worker") != "a" {
		t.Fatalf("the job that returned came from %q", rp.Header.Get("X-Fake-Worker"))
	}
	testrouter.WaitFor(t, func() bool { return r.Workers()[ws[1].URL()]["state"] == "suspect" })
	for range 6 {
		if rp := r.Post("/v1/images/generations", testrouter.SmallImage); rp.Header.Get("X-Fake-Worker") != "a" {
			t.Fatalf("served by %q while b is stalled", rp.Header.Get("X-Fake-Worker"))
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
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "busy", UnitMs: 500, HealthDelay: 300 * time.Millisecond})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n health_interval 30ms\n health_timeout 50ms\n health_fails 1000\n}")
	testrouter.ExpectStatus(t, "learn the speed", r.Post("/v1/images/generations", `{"response_format":"b64_json","prompt":"x","size":"512x512","num_inference_steps":1}`), 200)
	long := make(chan testrouter.Reply)
	go func() {
		long <- r.Post("/v1/images/generations", `{"response_format":"b64_json","prompt":"x","size":"1024x1024","num_inference_steps":4}`)
	}() // 2 s
	u := ws[0].URL()
	var failures any // probe failures counted before the job started
	testrouter.WaitFor(t, func() bool {
		st := r.Workers()[u]
		failures = st["probe_failures"]
		return st["active_requests"] == 1.0
	})
	probes := map[any]bool{}
	testrouter.WaitFor(t, func() bool {
		st := r.Workers()[u]
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
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "live"})
	dead := fmt.Sprintf("http://127.0.0.1:%d", testrouter.Port(t))
	r := testrouter.Start(t, "diffusion_router {\n workers "+dead+" "+ws[0].URL()+"\n policy round_robin\n max_fails 2\n eject_time 1m\n health_interval 1h\n}")
	for i := range 20 {
		testrouter.ExpectStatus(t, fmt.Sprint("request ", i), r.Post("/v1/images/generations", testrouter.SmallImage), 200)
	}
	st := r.Workers()[dead]
	if st["failures"] != 2.0 || st["state"] != "ejected" || st["ejected_until"] == nil {
		t.Fatalf("dead worker after 20 requests: %v; want ejected after 2 failures and tried no more", st)
	}
}

func TestRetryOnListedStatus(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "flaky", FailRate: 1}, fakeworker.Config{Name: "good"})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n policy round_robin\n retry_on 500\n max_fails 100\n}")
	for range 6 {
		rp := r.Post("/v1/images/generations", testrouter.SmallImage)
		if rp.Status != 200 || rp.Header.Get("X-Fake-Worker") != "good" {
			t.Fatalf("%d from %q; a 500 listed in retry_on goes to another worker", rp.Status, rp.Header.Get("X-Fake-Worker"))
		}
	}
}

func TestReloadsLeaveNoGoroutines(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{})
	site := "diffusion_router {\n workers " + testrouter.URLs(ws) + "\n health_interval 5ms\n}"
	r := testrouter.Start(t, site)
	// Once the worker has been probed the config has started all it starts.
	testrouter.WaitFor(t, func() bool { return r.Workers()[ws[0].URL()]["last_probe"] != nil })
	testrouter.Client.CloseIdleConnections()
	before, beforePkg := runtime.NumGoroutine(), len(testrouter.RouterGoroutines())
	for i := range 20 {
		r.Load(site + fmt.Sprintf("\n# reload %d", i))
	}
	// A goroutine left by each reload would add 20; the tolerance covers a
	// probe in flight and connections that come and go.
	const tolerance = 5
	var after int
	var pkg map[string]string
	if !testkit.WaitUntil(30*time.Second, func() bool {
		testrouter.Client.CloseIdleConnections()
		after, pkg = runtime.NumGoroutine(), testrouter.RouterGoroutines()
		return after <= before+tolerance && len(pkg) <= beforePkg+2
	}) {
		t.Fatalf("after 20 reloads %d goroutines (%d before), %d of this package (%d before); this package's, by creator:\n%s",
			after, before, len(pkg), beforePkg, testrouter.DescribeGoroutines(pkg))
	}
}

func TestFailingWorkersGetLittleAndShowIt(t *testing.T) {
	// One failing worker at a time: a job that fails on two workers is the
	// job's fault, and the first one's failure is taken back.
	for _, bad := range []fakeworker.Config{
		{Name: "always500", FailRate: 1},
		// Seed 13 fails the flaky worker's first two jobs: a worker that
		// fails 30% of its jobs may draw only a few of them.
		{Name: "flaky", FailRate: 0.3, Seed: 13},
	} {
		t.Run(bad.Name, func(t *testing.T) {
			ws := testrouter.StartWorkers(t, bad, fakeworker.Config{Name: "good1"}, fakeworker.Config{Name: "good2"})
			r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n max_fails 3\n eject_time 1m\n}")
			by := testrouter.SendImages(t, r, 6, func(sent int) bool { return sent < 20 })
			st := r.Workers()[ws[0].URL()]
			// What the worker failing every job drew: it may fail its
			// first jobs and then be passed over, short of max_fails.
			drew := float64(ws[0].Stats().Failed)
			switch {
			case by[bad.Name] > 12 && bad.FailRate == 1:
				// A worker that fails every job fails fast, so it looks
				// free: it must not draw the traffic.
				t.Fatalf("the worker failing every job answered %d of 120 requests (%v)", by[bad.Name], by)
			case bad.FailRate == 1 && drew >= 3 && st["state"] != "ejected",
				bad.FailRate == 1 && st["failures"].(float64) < min(drew, 3):
				t.Fatalf("the worker failing every job failed %g jobs and shows %v", drew, st)
			case st["failures"] == 0.0:
				t.Fatalf("the worker failing some of its jobs shows no failure: %v (served %v)", st, by)
			}
		})
	}
}

// A worker that crashed and was started again on its address serves
// again once its probes pass: the jobs it refused while down eject it,
// and an ejection for connections it did not answer ends on
// health_passes passed probes, not at eject_time (a minute here). It gets
// a job within health_passes × health_interval + 1 s of its restart.
// When a weight update ran while it was down, it gets that job after its
// catch-up has brought it to the update's weights, and serves on them.
func TestWorkerBackFromACrashServesAgain(t *testing.T) {
	const interval, passes = 250 * time.Millisecond, 2
	for _, missed := range []bool{false, true} {
		t.Run(fmt.Sprintf("missed an update: %v", missed), func(t *testing.T) {
			ws := namedWorkers(t, 2, fakeworker.Config{})
			r := testrouter.Start(t, fmt.Sprintf("diffusion_router {\n workers %s\n policy round_robin\n"+
				" health_interval %v\n health_passes %d\n eject_time 1m\n}", testrouter.URLs(ws), interval, passes))
			b := testrouter.Member{Name: "b", Worker: ws[1]}
			url := b.URL()
			b.Crash()
			crashed := time.Now()
			for i := range 6 { // round robin sends b every other job: 3 failures eject it
				testrouter.ExpectStatus(t, fmt.Sprint("job ", i, " beside the crashed worker"), r.Post("/v1/images/generations", testrouter.SmallImage), 200)
			}
			if st := r.Workers()[url]; st["ejected_until"] == nil {
				t.Fatalf("the crashed worker after 6 jobs: %v; want it ejected", st)
			}
			if missed {
				if rp := r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/8","weight_version":"step-8"}`); rp.Status != 502 {
					t.Fatalf("update with the crashed worker: %d %s; want 502", rp.Status, rp.Body)
				}
			}
			time.Sleep(time.Until(crashed.Add(time.Second)))
			b, err := b.Restart()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(b.Close)
			restarted := time.Now()
			bound := passes*interval + time.Second
			for {
				rp := r.Post("/v1/images/generations", testrouter.SmallImage)
				testrouter.ExpectStatus(t, "job after the restart", rp, 200)
				if rp.Header.Get("X-Fake-Worker") == "b" {
					break
				}
				if time.Since(restarted) > bound {
					t.Fatalf("the restarted worker served no job within %v: %v", bound, r.Workers()[url])
				}
				time.Sleep(10 * time.Millisecond)
			}
			if jobs := b.Stats().JobsOn; missed && (len(jobs) != 1 || jobs["/ckpt/8"] != 1) {
				t.Fatalf("the restarted worker served jobs on %v; want one, on the update it missed, /ckpt/8", jobs)
			}
		})
	}
}
