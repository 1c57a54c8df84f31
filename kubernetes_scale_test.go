package diffusionrouter_test

import (
	"fmt"
	"net"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	discoveryv1 "k8s.io/api/discovery/v1"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/kubeapi"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// Bad input from the Kubernetes API breaks nothing: a Service of more
// endpoints than the pool may hold, an endpoint that flaps. Every address
// is on 127.0.0.0/8, so that a probe of an endpoint with nothing behind it
// is refused at once and never leaves the machine.

// heapAfterGC is the live heap, in bytes, once a collection has run.
func heapAfterGC() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// manySlices are the slices of a Service of perSlice×len(ports) endpoints,
// slice s at ports[s]. Their pods sort after engine-*, so that the
// workers named first are the real ones the test puts before them; the
// others are at addresses of 127.10.0.0/12 where nothing listens.
func manySlices(ports []int, perSlice int) []*discoveryv1.EndpointSlice {
	out := make([]*discoveryv1.EndpointSlice, len(ports))
	for s, port := range ports {
		eps := make([]discoveryv1.Endpoint, perSlice)
		for i := range eps {
			n := s*perSlice + i
			address := fmt.Sprintf("127.%d.%d.%d", 10+s, i/250, i%250+1)
			eps[i] = podEndpoint("prod", address, fmt.Sprintf("worker-%05d", n), fmt.Sprintf("uid-%05d", n), ready)
		}
		out[s] = engineSlice("prod", fmt.Sprintf("engines-%d", s), port, eps...)
	}
	return out
}

// Ten thousand endpoints over ten slices: the pool takes max_workers of
// them, the first in the order of their pods, and logs that it left the
// rest out; it answers as it does with a few, and the real workers among
// those it took serve.
func TestTenThousandEndpointsFillThePoolToMaxWorkers(t *testing.T) {
	const maxWorkers, perSlice, sliceCount = 50, 1000, 10
	ws := namedWorkers(t, 2, fakeworker.Config{})
	a, b := ws[0], ws[1]
	aHost, aPort := hostPort(t, a.URL())
	bHost, bPort := hostPort(t, b.URL())
	ports := []int{aPort, bPort}
	for len(ports) < sliceCount {
		ports = append(ports, testrouter.Port(t))
	}
	all := manySlices(ports, perSlice)
	all[0].Endpoints[0] = podEndpoint("prod", aHost, "engine-a", "a", ready)
	all[1].Endpoints[0] = podEndpoint("prod", bHost, "engine-b", "b", ready)

	heapBefore, goroutinesBefore := heapAfterGC(), runtime.NumGoroutine()
	api := kubeapi.Start(t, "prod")
	for _, s := range all {
		api.Apply(s)
	}
	warnLog := t.TempDir() + "/warn.log"
	logs := "log warn {\n output file " + warnLog + "\n format json\n level WARN\n include http.handlers.diffusion_router\n}"
	r := testrouter.StartWith(t, logs, kubeSiteWith(api, fmt.Sprintf(" max_workers %d\n health_interval 1s", maxWorkers)))

	testrouter.WaitFor(t, func() bool { return len(r.Workers()) == maxWorkers })
	workers := r.Workers()
	for _, w := range []string{a.URL(), b.URL()} {
		if workers[w] == nil {
			t.Fatalf("the pool of %d workers left out %s, which sorts first", len(workers), w)
		}
	}
	testrouter.WaitFor(t, func() bool {
		return logEntry(t, warnLog, "left out: the pool has max_workers workers", fmt.Sprintf(`"left_out":%d`, perSlice*sliceCount-maxWorkers)) != nil
	})
	for _, path := range []string{"/workers", "/health"} {
		start := time.Now()
		testrouter.ExpectStatus(t, path, r.Get(path), http.StatusOK)
		took := time.Since(start)
		t.Logf("%s answered in %v", path, took)
		if took > 2*time.Second {
			t.Errorf("%s took %v with %d endpoints named", path, took, perSlice*sliceCount)
		}
	}
	for i := range 20 {
		rp := r.Post("/v1/images/generations", testrouter.SmallImage)
		testrouter.ExpectStatus(t, fmt.Sprint("job ", i), rp, http.StatusOK)
		if by := rp.Header.Get("X-Fake-Worker"); by != "a" && by != "b" {
			t.Fatalf("job %d served by %q", i, by)
		}
	}

	// A slice whose endpoints are all left out changes nothing: each
	// change is logged with what it leaves out.
	api.Delete("engines-9")
	testrouter.WaitFor(t, func() bool {
		return logEntry(t, warnLog, "left out: the pool has max_workers workers", fmt.Sprintf(`"left_out":%d`, perSlice*(sliceCount-1)-maxWorkers)) != nil
	})
	if n := len(r.Workers()); n != maxWorkers {
		t.Fatalf("the pool has %d workers after a slice left out went; want %d", n, maxWorkers)
	}
	heap, goroutines := heapAfterGC(), runtime.NumGoroutine()
	t.Logf("heap %d MB → %d MB, goroutines %d → %d", heapBefore>>20, heap>>20, goroutinesBefore, goroutines)
	if heap > heapBefore+64<<20 {
		t.Errorf("the heap grew from %d MB to %d MB", heapBefore>>20, heap>>20)
	}
	if goroutines > goroutinesBefore+4*maxWorkers {
		t.Errorf("goroutines went from %d to %d", goroutinesBefore, goroutines)
	}
}

// flapTime is how long an endpoint flaps in TestAFlappingEndpointLosesNoJob:
// the minute, a few seconds under -short.
func flapTime() time.Duration {
	if testing.Short() {
		return 5 * time.Second
	}
	return time.Minute
}

// An endpoint that flips between ready and not ready every 100 ms beside a
// steady one: every job sent all along is answered 200, and once the
// flapping ends neither goroutines nor the heap have grown.
func TestAFlappingEndpointLosesNoJob(t *testing.T) {
	ws := namedWorkers(t, 2, fakeworker.Config{UnitMs: 2})
	steady, flapping := ws[0], ws[1]
	api, r := kubeRouter(t, "", steady, flapping)
	testrouter.WaitFor(t, func() bool {
		return r.Workers()[steady.URL()]["state"] == "serving" && r.Workers()[flapping.URL()]["state"] == "serving"
	})
	testrouter.ExpectStatus(t, "a job before the flapping", r.Post("/v1/images/generations", testrouter.SmallImage), http.StatusOK)

	routerBefore, goroutinesBefore, heapBefore := testrouter.RouterGoroutines(), runtime.NumGoroutine(), heapAfterGC()
	var flappingEnded atomic.Bool
	served := make(chan map[string]int)
	go func() {
		// Rollout jobs: the router remembers no id of theirs, as it does an
		// image's (up to 100,000 of them), so that the heap shows what the
		// flapping leaves.
		served <- testrouter.SendJobs(t, r, 4, "/rollout/generate", `{"prompt":"a cat","seed":1,"width":8,"height":8,"num_inference_steps":1}`,
			func(int) bool { return !flappingEnded.Load() })
	}()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	flips, heaps := 0, []uint64{heapBefore}
	for quarter := range 4 {
		for end := time.Now().Add(flapTime() / 4); time.Now().Before(end); flips++ {
			<-tick.C
			c := ready
			if flips%2 == 0 {
				c = notReady
			}
			api.Apply(workerSlice(t, "prod", flapping, "b", c))
		}
		if quarter > 0 { // the first quarter fills what the router keeps of recent jobs
			heaps = append(heaps, heapAfterGC())
		}
	}
	api.Apply(workerSlice(t, "prod", flapping, "b", ready))
	flappingEnded.Store(true)
	t.Logf("%d flips; jobs, all answered 200, by worker: %v", flips, <-served)

	testrouter.WaitFor(t, func() bool { return r.Workers()[flapping.URL()]["state"] == "serving" })
	testrouter.WaitNoNewRouterGoroutines(t, "a minute of flapping", routerBefore)
	goroutines, heap := runtime.NumGoroutine(), heapAfterGC()
	heaps = append(heaps, heap)
	t.Logf("goroutines %d → %d; heap (MB) before, after each quarter from the second, settled: %v", goroutinesBefore, goroutines, mb(heaps))
	if goroutines > goroutinesBefore+50 {
		t.Errorf("goroutines went from %d to %d", goroutinesBefore, goroutines)
	}
	if heap > heaps[1]+16<<20 {
		t.Errorf("the heap grew from %d MB after half the flapping to %d MB", heaps[1]>>20, heap>>20)
	}
}

// mb is each of sizes in whole megabytes.
func mb(sizes []uint64) []uint64 {
	out := make([]uint64, len(sizes))
	for i, s := range sizes {
		out[i] = s >> 20
	}
	return out
}

// countedWorker is a fake worker that records the path of each request it
// is sent, in order.
type countedWorker struct {
	*fakeworker.Worker
	url  string
	srv  *http.Server
	mu   sync.Mutex
	sent []string
}

// startCounted starts a counted fake worker named name on addr
// (127.0.0.1:0 for a free port), until the test ends.
func startCounted(t *testing.T, name, addr string) *countedWorker {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	c := &countedWorker{Worker: fakeworker.New(fakeworker.Config{Name: name, UnitMs: 1}), url: "http://" + ln.Addr().String()}
	c.srv = &http.Server{Handler: http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		c.mu.Lock()
		c.sent = append(c.sent, r.URL.Path)
		c.mu.Unlock()
		c.Handler().ServeHTTP(rw, r)
	}), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = c.srv.Serve(ln) }()
	t.Cleanup(c.Close)
	return c
}

// URL is the worker's base URL.
func (c *countedWorker) URL() string { return c.url }

// Close stops the worker; its address is free once it returns.
func (c *countedWorker) Close() {
	_ = c.srv.Close()
	c.Worker.Close()
}

// paths returns the paths of the requests the worker was sent so far.
func (c *countedWorker) paths() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.sent)
}

// count is how many requests the worker was sent to path.
func (c *countedWorker) count(path string) int {
	n := 0
	for _, p := range c.paths() {
		if p == path {
			n++
		}
	}
	return n
}

// A pod replaced at its address (a new targetRef.uid at the same address
// and port) is a new worker: the new process, on its initial weights, is
// brought to the weights of the last update before its first job, and
// every job runs on those; later changes of the slices leave it be. So
// too while the old pod's endpoint is still listed, terminating, at the
// same address (hostNetwork pods on one node). The pod that stays (the
// same uid, its conditions changing) is no new worker: it gets no second
// update.
func TestAPodReplacedAtItsAddressIsCaughtUpBeforeItsFirstJob(t *testing.T) {
	oldPodGone := func(string) []discoveryv1.Endpoint { return nil }
	oldPodTerminating := func(host string) []discoveryv1.Endpoint {
		return []discoveryv1.Endpoint{podEndpoint("prod", host, "engine-a", "a", conditions{false, false, true})}
	}
	for name, oldPod := range map[string]func(host string) []discoveryv1.Endpoint{"old pod gone": oldPodGone, "old pod terminating": oldPodTerminating} {
		t.Run(name, func(t *testing.T) { replacePod(t, oldPod) })
	}
}

// replacePod replaces pod a at its address, its old pod's endpoints then
// those oldPod returns, and checks what TestAPodReplacedAtItsAddressIsCaughtUpBeforeItsFirstJob says.
func replacePod(t *testing.T, oldPod func(host string) []discoveryv1.Endpoint) {
	const update, generation, step1 = "/update_weights_from_disk", "/v1/images/generations", "/ckpt/step-1"
	a := startCounted(t, "a", "127.0.0.1:0")
	b := startCounted(t, "b", "127.0.0.1:0")
	api, r := kubeRouter(t, " health_interval 200ms", a, b)
	testrouter.ExpectStatus(t, "update", r.Post(update, `{"model_path":"`+step1+`"}`), http.StatusOK)
	if a.Weights() != step1 || b.Weights() != step1 {
		t.Fatalf("after the update a runs %s, b %s; want %s", a.Weights(), b.Weights(), step1)
	}
	bIs := func(c conditions, state string) {
		api.Apply(workerSlice(t, "prod", b, "b", c))
		testrouter.WaitFor(t, func() bool { return r.Workers()[b.URL()]["state"] == state })
	}

	// As Kubernetes does it: the old pod is out of service before its
	// address goes to the new one.
	api.Apply(workerSlice(t, "prod", a, "a", notReady))
	testrouter.WaitFor(t, func() bool { return r.Workers()[a.URL()]["state"] == "not_ready" })
	bIs(notReady, "not_ready")
	a.Close()
	replaced := startCounted(t, "a", strings.TrimPrefix(a.URL(), "http://"))
	host, port := hostPort(t, replaced.URL())
	api.Apply(engineSlice("prod", "engines-a", port, append(oldPod(host), podEndpoint("prod", host, "engine-a-2", "a-2", ready))...))
	bIs(ready, "serving")
	stop, _ := load(t, r, 4)
	testrouter.WaitFor(t, func() bool { return replaced.count(generation) >= 3 && b.count(generation) >= 3 })
	for range 2 {
		bIs(notReady, "not_ready")
		bIs(ready, "serving")
	}
	for _, s := range stop() {
		testrouter.ExpectStatus(t, "a job after the replacement", testrouter.Reply{Status: s.status}, http.StatusOK)
	}
	for name, w := range map[string]*countedWorker{"replaced": replaced, "other": b} {
		if on := w.Stats().JobsOn; len(on) != 1 || on[step1] == 0 {
			t.Fatalf("the %s pod ran jobs on %v; want all on %s", name, on, step1)
		}
	}
	sent := replaced.paths()
	caughtUp, firstJob := slices.Index(sent, update), slices.Index(sent, generation)
	if caughtUp < 0 || caughtUp > firstJob || replaced.count(update) != 1 {
		t.Fatalf("the replaced pod was sent %v; want one %s, before its first job", sent, update)
	}
	if w := r.Workers()[replaced.URL()]; w["pod"] != "engine-a-2" || w["state"] != "serving" {
		t.Fatalf("the replaced pod in /workers: %v, %v; want engine-a-2, serving", w["pod"], w["state"])
	}
	if n := b.count(update); n != 1 {
		t.Fatalf("the pod that stayed was sent %d updates; want the one the router sent all", n)
	}
}
