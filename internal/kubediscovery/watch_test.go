package kubediscovery

import (
	"context"
	"slices"
	"testing"

	"go.uber.org/zap/zapcore"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/utils/ptr"
)

// A Service's two slices make one set: an endpoint named by both (as
// while the controller moves it between slices) counts once, another
// Service's slice in the namespace counts not at all, and the set is in a
// stable order with each pod's namespace and name.
func TestServiceSlices(t *testing.T) {
	client := fake.NewClientset(
		sliceOf("prod", "engines-a", "engines", http30000, podAt("10.0.0.2", "prod", "engine-b"), podAt("10.0.0.1", "prod", "engine-a")),
		sliceOf("prod", "engines-b", "engines", http30000, podAt("10.0.0.2", "prod", "engine-b"), podAt("10.0.0.3", "prod", "engine-c")),
		sliceOf("prod", "other-a", "other", http30000, podAt("10.0.0.9", "prod", "other")),
	)
	w := watchFake(t, client, Config{Namespace: "prod", Service: "engines"})
	set := w.waitKeys("uid-engine-a", "uid-engine-b", "uid-engine-c")
	want := Endpoint{Key: "uid-engine-a", Address: "10.0.0.1", Port: 30000, Namespace: "prod", Pod: "engine-a", Ready: true, Serving: true}
	if set[0] != want {
		t.Errorf("first endpoint %+v, want %+v", set[0], want)
	}
	if got := set[1].HostPort(); got != "10.0.0.2:30000" {
		t.Errorf("second endpoint at %s, want 10.0.0.2:30000", got)
	}
	w.waitSynced(true)

	create(t, client, sliceOf("prod", "engines-c", "engines", http30000, podAt("10.0.0.4", "prod", "engine-d")))
	w.waitKeys("uid-engine-a", "uid-engine-b", "uid-engine-c", "uid-engine-d")
	if err := client.DiscoveryV1().EndpointSlices("prod").Delete(context.Background(), "engines-b", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	// engine-b stays: engines-a names it too.
	w.waitKeys("uid-engine-a", "uid-engine-b", "uid-engine-d")
}

// A selector follows every slice whose labels it matches, whichever
// Service they belong to; a slice of another Service added later that does
// not match stays out.
func TestSelector(t *testing.T) {
	a := sliceOf("prod", "engines-a", "engines", http30000, podAt("10.0.0.1", "prod", "engine-a"))
	b := sliceOf("prod", "canary-a", "canary", http30000, podAt("10.0.0.2", "prod", "canary-a"))
	b.Labels["app"] = "engines"
	client := fake.NewClientset(a, b)
	w := watchFake(t, client, Config{Namespace: "prod", Selector: "app=engines"})
	w.waitKeys("uid-canary-a", "uid-engine-a")

	create(t, client,
		sliceOf("prod", "other-a", "other", http30000, podAt("10.0.0.3", "prod", "other-a")),
		sliceOf("prod", "engines-b", "engines", http30000, podAt("10.0.0.4", "prod", "engine-b")))
	w.waitKeys("uid-canary-a", "uid-engine-a", "uid-engine-b")
}

// A namespace keeps the same Service's slices in other namespaces out;
// without one, every namespace counts.
func TestNamespace(t *testing.T) {
	slices := []*discoveryv1.EndpointSlice{
		sliceOf("prod", "engines-a", "engines", http30000, podAt("10.0.0.1", "prod", "engine-a")),
		sliceOf("dev", "engines-a", "engines", http30000, podAt("10.1.0.1", "dev", "engine-a")),
	}
	dev := slices[1].Endpoints[0].TargetRef
	dev.UID = "uid-dev-engine-a"

	w := watchFake(t, fake.NewClientset(slices[0].DeepCopy(), slices[1].DeepCopy()), Config{Namespace: "prod", Service: "engines"})
	w.waitKeys("uid-engine-a")

	w = watchFake(t, fake.NewClientset(slices[0], slices[1]), Config{Service: "engines"})
	set := w.waitKeys("uid-dev-engine-a", "uid-engine-a")
	if set[0].Namespace != "dev" || set[1].Namespace != "prod" {
		t.Errorf("namespaces %q and %q, want dev and prod", set[0].Namespace, set[1].Namespace)
	}
}

// The port is chosen by number or by name among a slice's TCP ports, or is
// its only one; a slice where it matches nothing gives no endpoint and is
// logged once, at warn.
func TestPort(t *testing.T) {
	udp := corev1.ProtocolUDP
	dns := discoveryv1.EndpointPort{Name: ptr.To("dns"), Port: ptr.To[int32](53), Protocol: &udp}
	two := []discoveryv1.EndpointPort{tcp("http", 30000), tcp("metrics", 9090), dns}
	for _, tc := range []struct {
		name  string
		ports []discoveryv1.EndpointPort
		port  string
		want  int // 0: no endpoint
	}{
		{"by name", two, "http", 30000},
		{"by number", two, "9090", 9090},
		{"by number with a leading zero", two, "09090", 9090},
		{"the only TCP port", []discoveryv1.EndpointPort{tcp("", 8000), dns}, "", 8000},
		{"several and none configured", two, "", 0},
		{"a name that matches nothing", two, "grpc", 0},
		{"a number that matches nothing", two, "8080", 0},
		{"a UDP port's name", two, "dns", 0},
		{"no ports", nil, "", 0},
		{"a port without a number", []discoveryv1.EndpointPort{{Name: ptr.To("http")}}, "http", 0},
		// Ports the API server refuses to store.
		{"port 0", []discoveryv1.EndpointPort{tcp("http", 0)}, "http", 0},
		{"port 70000", []discoveryv1.EndpointPort{tcp("http", 70000)}, "", 0},
		{"a negative port", []discoveryv1.EndpointPort{tcp("http", -1)}, "http", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client := fake.NewClientset(sliceOf("prod", "engines-a", "engines", tc.ports, podAt("10.0.0.1", "prod", "engine-a")))
			w := watchFake(t, client, Config{Namespace: "prod", Service: "engines", Port: tc.port})
			if tc.want == 0 {
				w.waitKeys()
				w.waitFor("the slice logged as left out", func() bool {
					return w.logged(zapcore.WarnLevel, "kubernetes: EndpointSlice left out") == 1
				})
				return
			}
			set := w.waitKeys("uid-engine-a")
			if set[0].Port != tc.want {
				t.Errorf("port %d, want %d", set[0].Port, tc.want)
			}
		})
	}
}

// A slice left out is logged once, not at every change of the others.
func TestLeftOutLoggedOnce(t *testing.T) {
	bad := sliceOf("prod", "engines-a", "engines", nil, podAt("10.0.0.1", "prod", "engine-a"))
	good := sliceOf("prod", "engines-b", "engines", http30000, podAt("10.0.0.2", "prod", "engine-b"))
	client := fake.NewClientset(bad, good)
	w := watchFake(t, client, Config{Namespace: "prod", Service: "engines"})
	w.waitKeys("uid-engine-b")
	good.Endpoints = append(good.Endpoints, podAt("10.0.0.3", "prod", "engine-c"))
	change(t, client, good)
	w.waitKeys("uid-engine-b", "uid-engine-c")
	if n := w.logged(zapcore.WarnLevel, "kubernetes: EndpointSlice left out"); n != 1 {
		t.Errorf("the slice without a port logged %d times, want once", n)
	}
}

// Under IPv4 the Service's IPv6 and FQDN slices are left out, and logged
// at info (a dual-stack Service always has both families); under IPv6
// only the IPv6 slice counts.
func TestAddressType(t *testing.T) {
	v4 := sliceOf("prod", "engines-v4", "engines", http30000, podAt("10.0.0.1", "prod", "engine-a"))
	v6 := sliceOf("prod", "engines-v6", "engines", http30000, podAt("fd00::1", "prod", "engine-a"))
	v6.AddressType = discoveryv1.AddressTypeIPv6
	v6.Endpoints[0].TargetRef.UID = "uid-engine-a-v6"
	fqdn := sliceOf("prod", "engines-fqdn", "engines", http30000, discoveryv1.Endpoint{Addresses: []string{"engine.example"}})
	fqdn.AddressType = discoveryv1.AddressTypeFQDN

	w := watchFake(t, fake.NewClientset(v4.DeepCopy(), v6.DeepCopy(), fqdn.DeepCopy()), Config{Namespace: "prod", Service: "engines"})
	w.waitKeys("uid-engine-a")
	w.waitFor("the IPv6 and FQDN slices logged", func() bool {
		return w.logged(zapcore.InfoLevel, "kubernetes: EndpointSlice left out") == 2
	})

	w = watchFake(t, fake.NewClientset(v4, v6, fqdn), Config{Namespace: "prod", Service: "engines", AddressType: "IPv6"})
	set := w.waitKeys("uid-engine-a-v6")
	if set[0].HostPort() != "[fd00::1]:30000" {
		t.Errorf("IPv6 endpoint at %s", set[0].HostPort())
	}
}

// Conditions follow the API's defaults: no ready means ready, no serving
// means as ready, no terminating means not terminating.
func TestConditions(t *testing.T) {
	at := func(addr, pod string, ready, serving, terminating *bool) discoveryv1.Endpoint {
		e := podAt(addr, "prod", pod)
		e.Conditions = discoveryv1.EndpointConditions{Ready: ready, Serving: serving, Terminating: terminating}
		return e
	}
	yes, no := ptr.To(true), ptr.To(false)
	client := fake.NewClientset(sliceOf("prod", "engines-a", "engines", http30000,
		at("10.0.0.1", "a-unset", nil, nil, nil),
		at("10.0.0.2", "b-ready", yes, nil, no),
		at("10.0.0.3", "c-terminating", no, yes, yes),
		at("10.0.0.4", "d-not-ready", no, nil, nil),
		at("10.0.0.5", "e-terminated", no, no, yes),
	))
	w := watchFake(t, client, Config{Namespace: "prod", Service: "engines"})
	set := w.waitKeys("uid-a-unset", "uid-b-ready", "uid-c-terminating", "uid-d-not-ready", "uid-e-terminated")
	want := [][3]bool{{true, true, false}, {true, true, false}, {false, true, true}, {false, false, false}, {false, false, true}}
	for i, e := range set {
		if got := [3]bool{e.Ready, e.Serving, e.Terminating}; got != want[i] {
			t.Errorf("%s: ready, serving, terminating %v, want %v", e.Pod, got, want[i])
		}
	}
}

// A pod replaced at the same address is a new worker: its key is the new
// pod's uid. An endpoint without a targetRef is keyed by address and port.
func TestKeys(t *testing.T) {
	s := sliceOf("prod", "engines-a", "engines", http30000, podAt("10.0.0.1", "prod", "engine-a"),
		discoveryv1.Endpoint{Addresses: []string{"10.0.0.7", "10.0.0.8"}})
	client := fake.NewClientset(s)
	w := watchFake(t, client, Config{Namespace: "prod", Service: "engines"})
	set := w.waitKeys("10.0.0.7:30000", "uid-engine-a")
	if set[0].Pod != "" || set[0].Namespace != "" || set[0].Address != "10.0.0.7" {
		t.Errorf("endpoint without a targetRef: %+v", set[0])
	}

	s.Endpoints[0].TargetRef.UID = "uid-engine-a-2"
	change(t, client, s)
	set = w.waitKeys("10.0.0.7:30000", "uid-engine-a-2")
	if set[1].HostPort() != "10.0.0.1:30000" || set[1].Pod != "engine-a" {
		t.Errorf("replaced pod: %+v", set[1])
	}
}

// Two pods' endpoints at one address (a pod replaced at its address while
// the old one terminates) give one endpoint: the more ready one, the
// first of equals.
func TestOneEndpointPerAddress(t *testing.T) {
	old, replacement := podAt("10.0.0.1", "prod", "engine-a"), podAt("10.0.0.1", "prod", "engine-a-2")
	old.Conditions = discoveryv1.EndpointConditions{Ready: ptr.To(false), Serving: ptr.To(false), Terminating: ptr.To(true)}
	replacement.Conditions.Ready = ptr.To(false)
	s := sliceOf("prod", "engines-a", "engines", http30000, old, replacement)
	client := fake.NewClientset(s)
	w := watchFake(t, client, Config{Namespace: "prod", Service: "engines"})
	w.waitKeys("uid-engine-a")

	s.Endpoints[1].Conditions.Ready = ptr.To(true)
	change(t, client, s)
	if set := w.waitKeys("uid-engine-a-2"); !set[0].Ready || set[0].Pod != "engine-a-2" {
		t.Errorf("the address's endpoint: %+v; want engine-a-2, ready", set[0])
	}
}

// A slice deleted takes its endpoints with it; the last one deleted leaves
// an empty set, which is given (the Service really has no endpoints).
func TestSliceDeleted(t *testing.T) {
	client := fake.NewClientset(
		sliceOf("prod", "engines-a", "engines", http30000, podAt("10.0.0.1", "prod", "engine-a")),
		sliceOf("prod", "engines-b", "engines", http30000, podAt("10.0.0.2", "prod", "engine-b")),
	)
	w := watchFake(t, client, Config{Namespace: "prod", Service: "engines"})
	w.waitKeys("uid-engine-a", "uid-engine-b")
	for _, name := range []string{"engines-a", "engines-b"} {
		if err := client.DiscoveryV1().EndpointSlices("prod").Delete(context.Background(), name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	w.waitKeys()
	if !w.inSync() {
		t.Error("out of sync after deletions")
	}
}

// A Service with no slices gives an empty set once the informer has
// listed, then its first slice.
func TestNoSlicesYet(t *testing.T) {
	client := fake.NewClientset()
	w := watchFake(t, client, Config{Namespace: "prod", Service: "engines"})
	w.waitKeys()
	w.waitSynced(true)
	create(t, client, sliceOf("prod", "engines-a", "engines", http30000, podAt("10.0.0.1", "prod", "engine-a")))
	w.waitKeys("uid-engine-a")
	_, n := w.last()
	if n != 2 {
		t.Errorf("%d updates, want 2 (empty, then the slice)", n)
	}
}

// A change that leaves the set as it was (a label added to a slice) makes
// no update.
func TestUnchangedSetNotGiven(t *testing.T) {
	s := sliceOf("prod", "engines-a", "engines", http30000, podAt("10.0.0.1", "prod", "engine-a"))
	client := fake.NewClientset(s)
	w := watchFake(t, client, Config{Namespace: "prod", Service: "engines"})
	w.waitKeys("uid-engine-a")
	s.Labels["team"] = "rollout"
	change(t, client, s)
	s.Endpoints = append(s.Endpoints, podAt("10.0.0.2", "prod", "engine-b"))
	change(t, client, s)
	w.waitKeys("uid-engine-a", "uid-engine-b")
	w.mu.Lock()
	defer w.mu.Unlock()
	if n := len(w.updates); n != 2 {
		t.Errorf("%d updates, want 2: the label changed nothing", n)
	}
	if slices.Contains(w.syncs, false) {
		t.Errorf("synced said false: %v", w.syncs)
	}
}
