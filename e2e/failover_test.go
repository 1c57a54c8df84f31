package e2e

import (
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/etcdtest"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// Failover of a pool's active router, killed with SIGKILL while it serves.

// Two routers behind one Caddy reverse_proxy that checks /readyz: the
// active one is killed mid-batch, the standby leads within lease_ttl + 1 s,
// and a client that retries as miles does loses no request.
func TestFailoverUnderLoadLosesNoRequest(t *testing.T) {
	if testing.Short() {
		t.Skip("builds Caddy and runs two routers as processes")
	}
	etcd := etcdtest.Start(t)
	var cfgs []fakeworker.Config
	for i := range 3 {
		cfgs = append(cfgs, fakeworker.Config{Name: fmt.Sprintf("w%d", i), UnitMs: 400}) // 50 ms a job
	}
	workers := testrouter.StartWorkers(t, cfgs...)
	bin := buildCaddy(t)
	a, aProcess := startHAProcess(t, bin, etcd, workers)
	testrouter.WaitFor(t, func() bool { return leads(t, a) })
	b, bProcess := startHAProcess(t, bin, etcd, workers)
	testrouter.WaitFor(t, func() bool { return standingOf(t, b.Get("/health")).names(a.Base) })
	front := testrouter.Start(t, fmt.Sprintf("reverse_proxy %s %s {\n lb_policy first\n health_uri /readyz\n health_interval 200ms\n health_timeout 1s\n}", a.Base, b.Base))

	const jobs, clients = 240, 6
	queue := make(chan int, jobs)
	for i := range jobs {
		queue <- i
	}
	close(queue)
	var miles testkit.Miles
	var done, lost atomic.Int64
	byWorker := map[string]int{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			for range queue {
				status, header, text := miles.Post(front.Base+"/v1/images/generations", testrouter.SmallImage)
				mu.Lock()
				if status == http.StatusOK {
					byWorker[header.Get("X-Fake-Worker")]++
				} else {
					lost.Add(1)
					t.Errorf("a job was lost after 60 attempts: %d %.200s", status, text)
				}
				mu.Unlock()
				done.Add(1)
			}
		})
	}
	if !testkit.WaitUntil(60*time.Second, func() bool { return done.Load() >= jobs/3 }) {
		t.Fatalf("only %d of %d jobs done within 60 s", done.Load(), jobs)
	}
	aProcess.kill() // SIGKILL: no resignation, the lease runs out
	killed := time.Now()
	if !testkit.WaitUntil(haLeaseTTL+time.Second, func() bool { return standingOf(t, b.Get("/health")).Leading }) {
		bProcess.fail("the standby did not lead within lease_ttl + 1 s of the leader's kill")
	}
	led := time.Since(killed)
	testrouter.WaitFor(t, func() bool { return b.Get("/readyz").Status == http.StatusOK })
	ready := time.Since(killed)
	finished := make(chan struct{})
	go func() { wg.Wait(); close(finished) }()
	select {
	case <-finished:
	case <-time.After(3 * time.Minute):
		t.Fatalf("%d of %d jobs done 3 minutes after the kill", done.Load(), jobs)
	}
	t.Logf("the standby led %v and was ready %v after the kill; %d requests retried; jobs by worker %v",
		led.Round(time.Millisecond), ready.Round(time.Millisecond), miles.Retries(), byWorker)
	if lost.Load() != 0 {
		t.Fatalf("%d of %d jobs lost", lost.Load(), jobs)
	}
	if miles.Retries() == 0 {
		t.Fatal("no request was retried: the kill came after the batch, and the test shows nothing")
	}
}

// An update in progress when the active router is killed: the caller's
// retry on the new leader is finished there, no job is answered from the
// old weights meanwhile, and a worker the dead router had updated is not
// called again.
func TestUpdateInterruptedByAFailoverIsFinished(t *testing.T) {
	if testing.Short() {
		t.Skip("builds Caddy and runs two routers as processes")
	}
	etcd := etcdtest.Start(t)
	// An update holds "quick" 0.5 s and "slow" 3 s.
	workers := testrouter.StartWorkers(t, fakeworker.Config{Name: "quick"}, fakeworker.Config{Name: "slow", UnitMs: 600})
	quick, slow := workers[0], workers[1]
	bin := buildCaddy(t)
	a, aProcess := startHAProcess(t, bin, etcd, workers)
	testrouter.WaitFor(t, func() bool { return leads(t, a) })
	b, bProcess := startHAProcess(t, bin, etcd, workers)
	testrouter.WaitFor(t, func() bool { return standingOf(t, b.Get("/health")).names(a.Base) })

	const update = `{"model_path":"/ckpt/2"}`
	go func() {
		_, _ = http.Post(a.Base+"/update_weights_from_disk", "application/json", strings.NewReader(update))
	}()
	// Killed once the record says the update runs and quick has it.
	if !testkit.WaitUntil(30*time.Second, func() bool {
		v := etcdValue(t, etcd, haRecordKey)
		return strings.Contains(v, `"updating"`) && strings.Contains(v, quick.URL()+`","weight_version":"/ckpt/2"`)
	}) {
		aProcess.fail("the record never showed the update under way: %s", etcdValue(t, etcd, haRecordKey))
	}
	aProcess.kill()
	const oldWeights = "fake/diffusion-model"
	onOld := map[*fakeworker.Worker]int{}
	for _, w := range workers {
		onOld[w] = w.Stats().JobsOn[oldWeights]
	}
	testrouter.WaitFor(t, func() bool { return leads(t, b) })
	if v, _ := b.Get("/health").JSON(t)["weight_version"].(string); v != "/ckpt/2" {
		bProcess.fail("the new leader's weight version is %q; want the update it inherited, /ckpt/2", v)
	}

	// Jobs meanwhile: none from the old weights.
	var miles testkit.Miles
	for range 10 {
		_, header, _ := miles.Post(b.Base+"/v1/images/generations", testrouter.SmallImage)
		if v := header.Get("X-Weight-Version"); v != "/ckpt/2" || header.Get("X-Fake-Worker") != "quick" {
			bProcess.fail("a job during the inherited update was answered by %s on %q; want quick on /ckpt/2",
				header.Get("X-Fake-Worker"), v)
		}
	}
	status, _, text := miles.Post(b.Base+"/update_weights_from_disk", update)
	if status != http.StatusOK || !strings.Contains(text, "already on weight version /ckpt/2") {
		bProcess.fail("the retried update: %d %s; want 200, quick already on it", status, text)
	}
	if quick.Weights() != "/ckpt/2" || slow.Weights() != "/ckpt/2" {
		t.Fatalf("after the retried update the workers run %q and %q; want /ckpt/2 on both", quick.Weights(), slow.Weights())
	}
	testrouter.WaitFor(t, func() bool { return b.Workers()[slow.URL()]["state"] == "serving" })
	seen := map[string]bool{}
	testrouter.WaitFor(t, func() bool {
		_, header, _ := miles.Post(b.Base+"/v1/images/generations", testrouter.SmallImage)
		if v := header.Get("X-Weight-Version"); v != "/ckpt/2" {
			t.Fatalf("a job after the retried update was answered on %q", v)
		}
		seen[header.Get("X-Fake-Worker")] = true
		return seen["slow"]
	})
	for _, w := range workers {
		if n := w.Stats().JobsOn[oldWeights] - onOld[w]; n != 0 {
			t.Errorf("%s ran %d jobs on the old weights after the leader's kill", w.URL(), n)
		}
	}
}

// An active router told to stop (SIGTERM, as a rolling update sends)
// resigns at once rather than once its jobs have ended: the standby leads
// while the old router still finishes the job it holds.
func TestStoppingRouterHandsOverBeforeItsJobsEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("builds Caddy and runs two routers as processes")
	}
	etcd := etcdtest.Start(t)
	// testrouter.SmallImage costs 0.125: 10 s on "slow".
	workers := testrouter.StartWorkers(t, fakeworker.Config{Name: "slow", UnitMs: 80000}, fakeworker.Config{Name: "quick"})
	bin := buildCaddy(t)
	slow, quick := workers[:1], workers[1].URL()
	a, aProcess := startHAProcess(t, bin, etcd, slow)
	testrouter.WaitFor(t, func() bool { return leads(t, a) })
	b, bProcess := startHAProcess(t, bin, etcd, slow)
	testrouter.WaitFor(t, func() bool { return standingOf(t, b.Get("/health")).names(a.Base) })
	held := testrouter.BusyWith(t, a, slow[0].URL(), testrouter.SmallImage)

	aProcess.terminate()
	stopped := time.Now()
	if !testkit.WaitUntil(5*time.Second, func() bool { return b.Get("/readyz").Status == http.StatusOK }) {
		bProcess.fail("the standby was not ready within 5 s of the active router's SIGTERM, while that router drains a 10 s job")
	}
	t.Logf("the standby led %v after the SIGTERM", time.Since(stopped).Round(time.Millisecond))
	select {
	case rp := <-held:
		t.Fatalf("the held job ended (%d) before the standby led; the test shows nothing", rp.Status)
	default:
	}
	testrouter.ExpectStatus(t, "registration on the new leader", b.Post("/workers", `{"url":"`+quick+`"}`), http.StatusOK)
	testrouter.ExpectStatus(t, "a job on the new leader", b.Post("/v1/images/generations", `{"response_format":"b64_json","prompt":"a cat","size":"64x64","num_inference_steps":1}`), http.StatusOK)
	select {
	case rp := <-held:
		testrouter.ExpectStatus(t, "the job the stopping router held", rp, http.StatusOK)
	case <-time.After(30 * time.Second):
		aProcess.fail("the job the stopping router held did not end within 30 s")
	}
}
