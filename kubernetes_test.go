package diffusionrouter_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
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
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/etcdtest"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/kubeapi"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// Workers found through the Kubernetes API: a stand-in for the API
// server (internal/testkit/kubeapi) serves the EndpointSlices of Service
// engines in namespace prod, each fake worker's own slice, since each
// listens on a port of its own on 127.0.0.1. The real API server refuses
// loopback endpoints: its tests run in a network namespace of their own
// (kubernetes_apiserver_test.go).

// conditions are an endpoint's ready, serving and terminating.
type conditions struct{ ready, serving, terminating bool }

var (
	ready       = conditions{true, true, false}
	notReady    = conditions{false, false, false}
	terminating = conditions{false, true, true}
)

// workerSlice is the slice engines-<uid> of Service engines in namespace
// ns that names w, of pod engine-<uid> (uid uid), in condition c.
func workerSlice(t *testing.T, ns string, w interface{ URL() string }, uid string, c conditions) *discoveryv1.EndpointSlice {
	t.Helper()
	host, port := hostPort(t, w.URL())
	return engineSlice(ns, "engines-"+uid, port, podEndpoint(ns, host, "engine-"+uid, uid, c))
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

// engineSlice is the slice name of Service engines in namespace ns, whose
// endpoints listen on port, named http.
func engineSlice(ns, name string, port int, endpoints ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
	portName, number, tcp := "http", int32(port), corev1.ProtocolTCP
	return &discoveryv1.EndpointSlice{
		TypeMeta:    metav1.TypeMeta{APIVersion: "discovery.k8s.io/v1", Kind: "EndpointSlice"},
		ObjectMeta:  metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{discoveryv1.LabelServiceName: "engines"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: &portName, Port: &number, Protocol: &tcp}},
		Endpoints:   endpoints,
	}
}

// podEndpoint is the endpoint of pod ns/pod (uid uid) at address, in
// condition c.
func podEndpoint(ns, address, pod, uid string, c conditions) discoveryv1.Endpoint {
	return discoveryv1.Endpoint{
		Addresses:  []string{address},
		Conditions: discoveryv1.EndpointConditions{Ready: &c.ready, Serving: &c.serving, Terminating: &c.terminating},
		TargetRef:  &corev1.ObjectReference{Kind: "Pod", Namespace: ns, Name: pod, UID: types.UID(uid)},
	}
}

// kubeSite is a router that follows Service engines of namespace ns
// through the API kubeconfig names.
func kubeSite(ns, kubeconfig string) string {
	return testrouter.MetricsSite("diffusion_router {\n workers_kubernetes {\n  namespace " + ns + "\n  service engines\n  port http\n  kubeconfig " + kubeconfig + "\n }\n}")
}

// sliceStore keeps a Service's EndpointSlices: the stand-in API server,
// or the real one.
type sliceStore interface {
	// Apply creates or changes a slice, as the EndpointSlice controller does.
	Apply(*discoveryv1.EndpointSlice)
	// Delete deletes the slice named name.
	Delete(name string)
}

// kubeSiteWith is a router that follows Service engines of namespace
// prod through api, with options in its block.
func kubeSiteWith(api *kubeapi.Server, options string) string {
	return strings.Replace(kubeSite("prod", api.Kubeconfig()), "diffusion_router {\n", "diffusion_router {\n"+options+"\n", 1)
}

// kubeRouter starts a stand-in API server whose slices name each of ws,
// ready, as pods engine-a, engine-b, ... of namespace prod, and a router
// that follows them with options in its block, and waits until they are
// its workers.
func kubeRouter(t *testing.T, options string, ws ...interface{ URL() string }) (*kubeapi.Server, *testrouter.Router) {
	t.Helper()
	api := kubeapi.Start(t, "prod")
	urls := make([]string, len(ws))
	for i, w := range ws {
		api.Apply(workerSlice(t, "prod", w, string(rune('a'+i)), ready))
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
	api := kubeapi.Start(t, "prod")
	r := testrouter.Start(t, kubeSite("prod", api.Kubeconfig()))
	conditionsFollowed(t, r, api, "prod", ws[0], ws[1])
}

// conditionsFollowed shows r following the conditions of the slices of a
// (pod a) and b (pod b) in namespace ns of store: both join, one not ready
// gets no job, one terminating gets jobs only when no ready worker is
// left, and a leaves with its slice. b is left not ready.
func conditionsFollowed(t *testing.T, r *testrouter.Router, store sliceStore, ns string, a, b *fakeworker.Worker) {
	t.Helper()
	store.Apply(workerSlice(t, ns, a, "a", ready))
	store.Apply(workerSlice(t, ns, b, "b", ready))
	waitForWorkers(t, r, a.URL(), b.URL())
	if w := r.Workers()[a.URL()]; w["source"] != "kubernetes" || w["namespace"] != ns || w["pod"] != "engine-a" {
		t.Fatalf("a in /workers: source %v, pod %v/%v; want kubernetes, %s/engine-a", w["source"], w["namespace"], w["pod"], ns)
	}
	testrouter.WaitFor(t, func() bool { return kubeSynced(t, r) == 1 })

	store.Apply(workerSlice(t, ns, b, "b", notReady))
	testrouter.WaitFor(t, func() bool { return r.Workers()[b.URL()]["state"] == "not_ready" })
	jobsServedBy(t, r, 4, a.Config().Name)

	store.Apply(workerSlice(t, ns, a, "a", terminating))
	store.Apply(workerSlice(t, ns, b, "b", ready))
	testrouter.WaitFor(t, func() bool {
		return r.Workers()[a.URL()]["state"] == "terminating" && r.Workers()[b.URL()]["state"] == "serving"
	})
	jobsServedBy(t, r, 4, b.Config().Name)
	store.Apply(workerSlice(t, ns, b, "b", notReady))
	testrouter.WaitFor(t, func() bool { return r.Workers()[b.URL()]["state"] == "not_ready" })
	jobsServedBy(t, r, 4, a.Config().Name) // the last resort

	store.Delete(workerSlice(t, ns, a, "a", ready).Name)
	waitForWorkers(t, r, b.URL())
}

// kubeSynced is what caddy_diffusion_discovery_synced says of r's
// Kubernetes lookups.
func kubeSynced(t *testing.T, r *testrouter.Router) float64 {
	t.Helper()
	return testrouter.Value(t, r, "caddy_diffusion_discovery_synced", map[string]string{"source": "kubernetes"})
}

// An API server that fails keeps the workers it last named: they serve
// on, discovery_synced reads 0 until it answers again.
func TestAnAPIOutageKeepsTheWorkers(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{})
	api, r := kubeRouter(t, "", ws[0])
	testrouter.WaitFor(t, func() bool { return kubeSynced(t, r) == 1 })

	api.Fail(500)
	testrouter.WaitFor(t, func() bool { return kubeSynced(t, r) == 0 })
	waitForWorkers(t, r, ws[0].URL())
	jobsServedBy(t, r, 3, "a")

	api.Fail(0)
	testrouter.WaitFor(t, func() bool { return kubeSynced(t, r) == 1 })
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
	api.Apply(workerSlice(t, "prod", c, "c", ready))
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

// Addresses the API server refuses to store, in slices an API could still
// send (a stand-in here): cloud metadata, link-local and unspecified
// endpoints are left out and logged, as DNS answers' are, while the
// worker beside them serves.
func TestEndpointsThatAreNeverWorkersAreLeftOut(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{})
	host, port := hostPort(t, ws[0].URL())
	api := kubeapi.Start(t, "prod")
	refused := []string{"169.254.169.254", "169.254.7.7", "0.0.0.0"}
	eps := []discoveryv1.Endpoint{podEndpoint("prod", host, "engine-a", "a", ready)}
	for i, address := range refused {
		eps = append(eps, podEndpoint("prod", address, fmt.Sprint("bad-", i), fmt.Sprint("bad-", i), ready))
	}
	api.Apply(engineSlice("prod", "engines", port, eps...))
	warnLog := t.TempDir() + "/warn.log"
	logs := "log warn {\n output file " + warnLog + "\n format json\n level WARN\n include http.handlers.diffusion_router\n}"
	r := testrouter.StartWith(t, logs, kubeSite("prod", api.Kubeconfig()))
	waitForWorkers(t, r, ws[0].URL())
	for _, address := range refused {
		hostport := net.JoinHostPort(address, strconv.Itoa(port))
		testrouter.WaitFor(t, func() bool { return logEntry(t, warnLog, "never a worker", hostport) != nil })
	}
	jobsServedBy(t, r, 3, "a")
	waitForWorkers(t, r, ws[0].URL())
}

// A config without the lookup stops its informer.
func TestUnloadStopsTheInformer(t *testing.T) {
	ws := namedWorkers(t, 2, fakeworker.Config{})
	_, r := kubeRouter(t, "", ws[0])
	r.Load("diffusion_router {\n workers " + ws[1].URL() + "\n}")
	waitForWorkers(t, r, ws[1].URL())
	for _, stack := range testkit.Stacks() {
		if strings.Contains(stack, "kubediscovery") || strings.Contains(stack, "client-go") {
			t.Fatalf("the unloaded config's informer still runs:\n%s", stack)
		}
	}
}

// A reload that keeps a lookup, whose new watch cannot list (here the
// kubeconfig at the same path now holds credentials the API server
// refuses, as after a bad rotation), reads out of sync: the router
// follows nothing new.
func TestAReloadWhoseWatchNeverListsReadsOutOfSync(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{})
	api := kubeapi.Start(t, "prod")
	api.Apply(workerSlice(t, "prod", ws[0], "a", ready))
	path := api.Kubeconfig()
	site := kubeSite("prod", path)
	r := testrouter.Start(t, site)
	waitForWorkers(t, r, ws[0].URL())
	testrouter.WaitFor(t, func() bool { return kubeSynced(t, r) == 1 })

	refusing := kubeapi.Start(t, "prod")
	refusing.Fail(403)
	rotated, err := os.ReadFile(refusing.Kubeconfig())
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, rotated, 0o600); err != nil {
		t.Fatal(err)
	}
	r.Load(site)
	testrouter.WaitFor(t, func() bool { return len(refusing.Requests()) >= 2 })
	testrouter.WaitFor(t, func() bool { return kubeSynced(t, r) == 0 })
}
