package kubediscovery

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/watchlist"
)

// bound is how long a test waits for what must happen: generous, as the
// machine is shared; nothing waits for it to pass when all is well.
const bound = 30 * time.Second

// watcher records what WatchWith tells its caller.
type watcher struct {
	t       *testing.T
	logs    *observer.ObservedLogs
	changed chan struct{}
	calling atomic.Int32 // calls of update or synced under way

	mu      sync.Mutex
	updates [][]Endpoint
	syncs   []bool
}

// watchFake runs WatchWith on client until the test ends.
func watchFake(t *testing.T, client kubernetes.Interface, c Config) *watcher {
	t.Helper()
	w, stop := follow(t, func(ctx context.Context, log *zap.Logger, w *watcher) error {
		return WatchWith(ctx, typed{client}, c, log, w.update, w.synced)
	})
	t.Cleanup(stop)
	return w
}

// follow runs watch in a goroutine, recording what it says; stop ends it
// and waits until it has returned.
func follow(t *testing.T, watch func(context.Context, *zap.Logger, *watcher) error) (w *watcher, stop func()) {
	core, logs := observer.New(zap.DebugLevel)
	w = &watcher{t: t, logs: logs, changed: make(chan struct{}, 1)}
	ctx, cancel := context.WithCancel(context.Background())
	ended := make(chan error, 1)
	go func() { ended <- watch(ctx, zap.New(core), w) }()
	return w, func() {
		cancel()
		select {
		case err := <-ended:
			if err != nil {
				t.Errorf("watching: %v", err)
			}
		case <-time.After(bound):
			t.Errorf("still watching %v after the context ended", bound)
		}
	}
}

// typed is API over a client-go clientset: the tests' fake one.
type typed struct{ kubernetes.Interface }

func (c typed) ListSlices(ctx context.Context, namespace string, opts metav1.ListOptions) (*discoveryv1.EndpointSliceList, error) {
	return c.DiscoveryV1().EndpointSlices(namespace).List(ctx, opts)
}

func (c typed) WatchSlices(ctx context.Context, namespace string, opts metav1.ListOptions) (watch.Interface, error) {
	return c.DiscoveryV1().EndpointSlices(namespace).Watch(ctx, opts)
}

// IsWatchListSemanticsUnSupported passes on that the fake clientset cannot
// stream a list, which the reflector would otherwise ask of it.
func (c typed) IsWatchListSemanticsUnSupported() bool {
	return watchlist.DoesClientNotSupportWatchListSemantics(c.Interface)
}

func (w *watcher) update(set []Endpoint) {
	w.record(func() { w.updates = append(w.updates, set) })
}

func (w *watcher) synced(in bool) {
	w.record(func() { w.syncs = append(w.syncs, in) })
}

// record adds a call, failing the test if another is under way.
func (w *watcher) record(add func()) {
	if w.calling.Add(1) != 1 {
		w.t.Error("update or synced called while another call was under way")
	}
	defer w.calling.Add(-1)
	w.mu.Lock()
	add()
	w.mu.Unlock()
	kick(w.changed)
}

// last is the last set given to update, and how many sets were given.
func (w *watcher) last() ([]Endpoint, int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.updates) == 0 {
		return nil, 0
	}
	return w.updates[len(w.updates)-1], len(w.updates)
}

// inSync is what synced last said (false before it said anything).
func (w *watcher) inSync() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.syncs) > 0 && w.syncs[len(w.syncs)-1]
}

// waitFor waits until ok holds of the watcher.
func (w *watcher) waitFor(what string, ok func() bool) {
	w.t.Helper()
	deadline := time.After(bound)
	for !ok() {
		select {
		case <-w.changed:
		case <-time.After(10 * time.Millisecond):
		case <-deadline:
			set, n := w.last()
			w.t.Fatalf("still waiting for %s after %v; %d updates, the last %v; synced %v", what, bound, n, set, w.inSync())
		}
	}
}

// waitKeys waits until the last update holds exactly these keys, in this
// order, and returns it.
func (w *watcher) waitKeys(keys ...string) []Endpoint {
	w.t.Helper()
	var set []Endpoint
	w.waitFor(fmt.Sprintf("an update of %v", keys), func() bool {
		var n int
		set, n = w.last()
		return n > 0 && slices.Equal(keysOf(set), keys)
	})
	return set
}

// waitSynced waits until synced last said in.
func (w *watcher) waitSynced(in bool) {
	w.t.Helper()
	w.waitFor(fmt.Sprintf("synced(%v)", in), func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		return len(w.syncs) > 0 && w.syncs[len(w.syncs)-1] == in
	})
}

// logged counts the logs at level whose message is msg.
func (w *watcher) logged(level zapcore.Level, msg string) int {
	return w.logs.FilterMessage(msg).FilterLevelExact(level).Len()
}

func keysOf(set []Endpoint) []string {
	keys := make([]string, len(set))
	for i, e := range set {
		keys[i] = e.Key
	}
	return keys
}

// sliceOf is a slice of svc in ns with these ports and endpoints.
func sliceOf(ns, name, svc string, ports []discoveryv1.EndpointPort, eps ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
	return &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: ns, Name: name,
			Labels: map[string]string{discoveryv1.LabelServiceName: svc, "app": svc},
		},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       ports,
		Endpoints:   eps,
	}
}

// tcp is a slice port; name "" leaves it unnamed.
func tcp(name string, port int32) discoveryv1.EndpointPort {
	p := discoveryv1.EndpointPort{Port: &port}
	if name != "" {
		p.Name = &name
	}
	return p
}

// http30000 is the one port most slices here have.
var http30000 = []discoveryv1.EndpointPort{tcp("http", 30000)}

// podAt is a ready endpoint of pod ns/name (uid "uid-<name>") at address.
func podAt(address, ns, name string) discoveryv1.Endpoint {
	return discoveryv1.Endpoint{
		Addresses: []string{address},
		TargetRef: &corev1.ObjectReference{Kind: "Pod", Namespace: ns, Name: name, UID: types.UID("uid-" + name)},
	}
}

// create adds objects through the clientset, as the EndpointSlice
// controller would.
func create(t *testing.T, client kubernetes.Interface, slices ...*discoveryv1.EndpointSlice) {
	t.Helper()
	for _, s := range slices {
		if _, err := client.DiscoveryV1().EndpointSlices(s.Namespace).Create(context.Background(), s, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}

// change updates a slice through the clientset.
func change(t *testing.T, client kubernetes.Interface, s *discoveryv1.EndpointSlice) {
	t.Helper()
	if _, err := client.DiscoveryV1().EndpointSlices(s.Namespace).Update(context.Background(), s, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}
