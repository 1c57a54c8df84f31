package diffusionrouter_test

import (
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
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

// workerSlice is the slice of Service engines in namespace ns that names
// w, of pod uid, in condition c.
func workerSlice(t *testing.T, ns string, w *fakeworker.Worker, uid string, c conditions) *discoveryv1.EndpointSlice {
	t.Helper()
	u, err := url.Parse(w.URL())
	if err != nil {
		t.Fatal(err)
	}
	port, _ := strconv.Atoi(u.Port())
	name, number, tcp := "http", int32(port), corev1.ProtocolTCP
	return &discoveryv1.EndpointSlice{
		TypeMeta:    metav1.TypeMeta{APIVersion: "discovery.k8s.io/v1", Kind: "EndpointSlice"},
		ObjectMeta:  metav1.ObjectMeta{Namespace: ns, Name: "engines-" + w.Config().Name, Labels: map[string]string{discoveryv1.LabelServiceName: "engines"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: &name, Port: &number, Protocol: &tcp}},
		Endpoints: []discoveryv1.Endpoint{{
			Addresses:  []string{u.Hostname()},
			Conditions: discoveryv1.EndpointConditions{Ready: &c.ready, Serving: &c.serving, Terminating: &c.terminating},
			TargetRef:  &corev1.ObjectReference{Kind: "Pod", Namespace: ns, Name: "engine-" + uid, UID: types.UID(uid)},
		}},
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
	api := kubeapi.Start(t, "prod")
	api.Apply(workerSlice(t, "prod", ws[0], "a", ready))
	r := testrouter.Start(t, kubeSite("prod", api.Kubeconfig()))
	waitForWorkers(t, r, ws[0].URL())
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
