package diffusionrouter_test

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/ha"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/etcdtest"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/kubeapi"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// Workers found through the Kubernetes API: a stand-in for the API
// server (internal/testkit/kubeapi) serves the EndpointSlices of Service
// engines in namespace prod, each fake worker's own slice, since each
// listens on a port of its own on 127.0.0.1. The real API server's tests,
// which refuse loopback endpoints, run in a network namespace (e2e).

// conditions are an endpoint's ready, serving and terminating.
type conditions struct{ ready, serving, terminating bool }

var (
	ready       = conditions{true, true, false}
	notReady    = conditions{false, false, false}
	terminating = conditions{false, true, true}
)

// workerSlice is the slice of Service engines that names w, of pod uid,
// in condition c.
func workerSlice(t *testing.T, w interface{ URL() string }, uid string, c conditions) *discoveryv1.EndpointSlice {
	t.Helper()
	host, port := hostPort(t, w.URL())
	return engineSlice("engines-"+uid, port, podEndpoint(host, "engine-"+uid, uid, c))
}

// hostPort splits a worker's URL into its host and port.
func hostPort(t *testing.T, workerURL string) (string, int) {
	t.Helper()
	u, err := url.Parse(workerURL)
	if err != nil {
		t.Fatal(err)
	}
	port, err := strconv.Atoi(u.Port())
	if err != nil {
		t.Fatal(err)
	}
	return u.Hostname(), port
}

// engineSlice is the slice name of Service engines in namespace prod,
// whose endpoints listen on port, named http.
func engineSlice(name string, port int, endpoints ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
	portName, number, tcp := "http", int32(port), corev1.ProtocolTCP
	return &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "prod", Name: name, Labels: map[string]string{discoveryv1.LabelServiceName: "engines"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: &portName, Port: &number, Protocol: &tcp}},
		Endpoints:   endpoints,
	}
}

// podEndpoint is the endpoint of pod (uid uid) at address, in condition c.
func podEndpoint(address, pod, uid string, c conditions) discoveryv1.Endpoint {
	return discoveryv1.Endpoint{
		Addresses:  []string{address},
		Conditions: discoveryv1.EndpointConditions{Ready: &c.ready, Serving: &c.serving, Terminating: &c.terminating},
		TargetRef:  &corev1.ObjectReference{Kind: "Pod", Namespace: "prod", Name: pod, UID: types.UID(uid)},
	}
}

// kubeSite is a router that follows Service engines through api.
func kubeSite(api *kubeapi.Server) string {
	return testrouter.MetricsSite("diffusion_router {\n workers_kubernetes {\n  namespace prod\n  service engines\n  port http\n  kubeconfig " + api.Kubeconfig() + "\n }\n}")
}

// kubeSiteWith is kubeSite with more options in the router's block.
func kubeSiteWith(api *kubeapi.Server, options string) string {
	return strings.Replace(kubeSite(api), "diffusion_router {\n", "diffusion_router {\n"+options+"\n", 1)
}

// kubeRouter starts a stand-in API server whose slices name each of ws,
// ready, as pods engine-a, engine-b, ..., and a router that follows them
// with options in its block, and waits until they are its workers.
func kubeRouter(t *testing.T, options string, ws ...interface{ URL() string }) (*kubeapi.Server, *testrouter.Router) {
	t.Helper()
	api := kubeapi.Start(t, "prod")
	urls := make([]string, len(ws))
	for i, w := range ws {
		api.Apply(workerSlice(t, w, string(rune('a'+i)), ready))
		urls[i] = w.URL()
	}
	r := testrouter.Start(t, kubeSiteWith(api, options))
	waitForWorkers(t, r, urls...)
	return api, r
}

// jobsServedBy sends n small jobs and fails t unless the worker named want
// serves each.
func jobsServedBy(t *testing.T, r *testrouter.Router, n int, want string) {
	t.Helper()
	for i := range n {
		jobOn(t, r, want, fmt.Sprint("job ", i))
	}
}

// The pool follows the slices as they change: endpoints join as
// workers (source kubernetes, with their pod), one not ready gets no job,
// one terminating gets jobs only when no ready worker is left, and one
// whose slice is gone leaves.
func TestWorkersFollowAServicesEndpointSlices(t *testing.T) {
	ws := namedWorkers(t, 2, fakeworker.Config{})
	a, b := ws[0], ws[1]
	api, r := kubeRouter(t, "", a, b)
	if w := r.Workers()[a.URL()]; w["source"] != "kubernetes" || w["namespace"] != "prod" || w["pod"] != "engine-a" {
		t.Fatalf("a in /workers: source %v, pod %v/%v; want kubernetes, prod/engine-a", w["source"], w["namespace"], w["pod"])
	}
	testrouter.WaitFor(t, func() bool {
		return testrouter.Value(t, r, "caddy_diffusion_discovery_synced", map[string]string{"source": "kubernetes"}) == 1
	})

	api.Apply(workerSlice(t, b, "b", notReady))
	testrouter.WaitFor(t, func() bool { return r.Workers()[b.URL()]["state"] == "not_ready" })
	jobsServedBy(t, r, 4, "a")

	api.Apply(workerSlice(t, a, "a", terminating))
	api.Apply(workerSlice(t, b, "b", ready))
	testrouter.WaitFor(t, func() bool {
		return r.Workers()[a.URL()]["state"] == "terminating" && r.Workers()[b.URL()]["state"] == "serving"
	})
	jobsServedBy(t, r, 4, "b")
	api.Apply(workerSlice(t, b, "b", notReady))
	testrouter.WaitFor(t, func() bool { return r.Workers()[b.URL()]["state"] == "not_ready" })
	jobsServedBy(t, r, 4, "a") // the last resort

	api.Delete("engines-a")
	waitForWorkers(t, r, b.URL())
}

// An API server that fails keeps the workers it last named: they serve
// on, discovery_synced reads 0 until it answers again.
func TestAnAPIOutageKeepsTheWorkers(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{})
	api, r := kubeRouter(t, "", ws[0])
	synced := func() float64 {
		return testrouter.Value(t, r, "caddy_diffusion_discovery_synced", map[string]string{"source": "kubernetes"})
	}
	testrouter.WaitFor(t, func() bool { return synced() == 1 })

	api.Fail(500)
	testrouter.WaitFor(t, func() bool { return synced() == 0 })
	waitForWorkers(t, r, ws[0].URL())
	jobsServedBy(t, r, 3, "a")

	api.Fail(0)
	testrouter.WaitFor(t, func() bool { return synced() == 1 })
	waitForWorkers(t, r, ws[0].URL())
}

// Without a kubeconfig the router reaches the API as the pod's service
// account; outside a cluster that fails as Caddy starts the config,
// naming the option, and nothing is left running.
func TestInClusterModeOutsideAClusterFailsTheStart(t *testing.T) {
	raw, err := testrouter.AdaptSite(testrouter.Port(t), testrouter.OwnStorage(t), "diffusion_router {\n workers_kubernetes {\n  service engines\n }\n}")
	if err != nil {
		t.Fatal(err)
	}
	err = caddy.Load(raw, true)
	if err == nil {
		_ = caddy.Stop()
		t.Fatal("the config started outside a cluster with no kubeconfig")
	}
	if !strings.Contains(err.Error(), "workers_kubernetes (discovery.kubernetes)") || !strings.Contains(err.Error(), "in-cluster") {
		t.Fatalf("the start failed with %v; want the option and in-cluster mode named", err)
	}
}

// With ha etcd, a standby follows the slices (its /workers names the
// workers they name, as they change) but calls none of them; once it
// leads it probes them and serves.
func TestAStandbyFollowsTheSlicesButCallsNoWorker(t *testing.T) {
	etcd := etcdtest.Start(t)
	ctx, resign := context.WithCancel(context.Background())
	t.Cleanup(resign)
	leader, err := ha.Campaign(ctx, ha.Config{Endpoints: []string{etcd.Endpoint}, KeyPrefix: "/diffusion-router",
		Pool: "default", LeaseTTL: 2 * time.Second, Identity: "http://router-0.test:8080"})
	if err != nil {
		t.Fatal(err)
	}
	testrouter.WaitFor(t, leader.Leading)
	a, b, c := startCounted(t, "a", "127.0.0.1:0"), startCounted(t, "b", "127.0.0.1:0"), startCounted(t, "c", "127.0.0.1:0")
	api, r := kubeRouter(t, " health_interval 200ms\n ha etcd "+etcd.Endpoint+" {\n  lease_ttl 2s\n }", a, b)
	api.Apply(workerSlice(t, c, "c", ready))
	api.Delete("engines-b")
	waitForWorkers(t, r, a.URL(), c.URL())
	if w := r.Workers()[c.URL()]; w["source"] != "kubernetes" || w["pod"] != "engine-c" {
		t.Fatalf("c in the standby's /workers: source %v, pod %v; want kubernetes, engine-c", w["source"], w["pod"])
	}
	testrouter.ExpectStatus(t, "the standby's /readyz", r.Get("/readyz"), http.StatusServiceUnavailable)
	time.Sleep(time.Second) // five health intervals, in which a leader probes every worker
	for _, w := range []*countedWorker{a, b, c} {
		if sent := w.paths(); len(sent) != 0 {
			t.Fatalf("the standby sent %s %v; a standby calls no worker", w.URL(), sent)
		}
	}

	resign()
	testrouter.WaitFor(t, func() bool { return r.Get("/readyz").Status == http.StatusOK })
	rp := r.Post("/v1/images/generations", testrouter.SmallImage)
	testrouter.ExpectStatus(t, "the first job once it leads", rp, http.StatusOK)
	if by := rp.Header.Get("X-Fake-Worker"); by != "a" && by != "c" {
		t.Fatalf("the first job once it leads was served by %q", by)
	}
	if n := b.count("/health"); n != 0 {
		t.Fatalf("the router probed b, whose slice went, %d times", n)
	}
}
