package kubediscovery

import (
	"net"
	"os"
	"slices"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap/zapcore"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

const (
	outOfSync  = "kubernetes API: out of sync with the EndpointSlices; keeping the last endpoints while the informer retries"
	backInSync = "kubernetes API: in sync with the EndpointSlices again"
)

// api is a fake clientset whose lists the test can make fail and whose
// watches the test drives itself.
type api struct {
	*fake.Clientset
	listFails atomic.Pointer[error] // nil: lists answer
	lists     atomic.Int32          // lists that failed
	watches   chan *watch.RaceFreeFakeWatcher
	refuse    atomic.Bool // watches refused as by a server that is down
	refused   atomic.Int32
}

func newAPI(objects ...runtime.Object) *api {
	a := &api{Clientset: fake.NewClientset(objects...), watches: make(chan *watch.RaceFreeFakeWatcher, 100)}
	a.PrependReactor("list", "endpointslices", func(k8stesting.Action) (bool, runtime.Object, error) {
		if err := a.listFails.Load(); err != nil {
			a.lists.Add(1)
			return true, nil, *err
		}
		return false, nil, nil
	})
	a.PrependWatchReactor("endpointslices", func(k8stesting.Action) (bool, watch.Interface, error) {
		if a.refuse.Load() {
			a.refused.Add(1)
			return true, nil, &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
		}
		w := watch.NewRaceFreeFake()
		a.watches <- w
		return true, w, nil
	})
	return a
}

func (a *api) failLists(err error) { a.listFails.Store(&err) }

// watchingEngineA follows a Service of one slice, one endpoint, until it
// is in sync, and returns the informer's watch.
func watchingEngineA(t *testing.T) (*api, *watcher, *watch.RaceFreeFakeWatcher) {
	t.Helper()
	a := newAPI(sliceOf("prod", "engines-a", "engines", http30000, podAt("10.0.0.1", "prod", "engine-a")))
	w := watchFake(t, a, Config{Namespace: "prod", Service: "engines"})
	w.waitKeys("uid-engine-a")
	w.waitSynced(true)
	return a, w, a.nextWatch(t)
}

// nextWatch is the informer's next watch.
func (a *api) nextWatch(t *testing.T) *watch.RaceFreeFakeWatcher {
	t.Helper()
	select {
	case w := <-a.watches:
		return w
	case <-time.After(bound):
		t.Fatalf("no watch after %v", bound)
		return nil
	}
}

// A watch ended by 410 Gone, then lists refused with 403 while the
// informer retries: synced says false, the warning is logged once, and the
// set stands (no update at all, let alone an empty one). When lists answer
// again, the set is what they say and synced says true, logged at info.
func TestWatchExpiredAndListsForbidden(t *testing.T) {
	a, w, first := watchingEngineA(t)

	a.failLists(apierrors.NewForbidden(schema.GroupResource{Group: "discovery.k8s.io", Resource: "endpointslices"}, "", nil))
	first.Error(&metav1.Status{Status: metav1.StatusFailure, Code: 410, Reason: metav1.StatusReasonExpired, Message: "too old resource version"})
	w.waitSynced(false)
	w.waitFor("two lists refused", func() bool { return a.lists.Load() >= 2 })
	if set, n := w.last(); n != 1 || len(set) != 1 {
		t.Errorf("%d updates during the outage, the last %v; want the first set only", n, set)
	}
	if n := w.logged(zapcore.WarnLevel, outOfSync); n != 1 {
		t.Errorf("outage logged %d times at warn, want once", n)
	}

	create(t, a, sliceOf("prod", "engines-b", "engines", http30000, podAt("10.0.0.2", "prod", "engine-b")))
	a.listFails.Store(nil)
	w.waitKeys("uid-engine-a", "uid-engine-b")
	w.waitSynced(true)
	if n := w.logged(zapcore.InfoLevel, backInSync); n != 1 {
		t.Errorf("recovery logged %d times, want once", n)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if want := []bool{true, false, true}; !slices.Equal(w.syncs, want) {
		t.Errorf("synced said %v, want %v", w.syncs, want)
	}
}

// A server that goes down under a watch: the reflector retries the refused
// watch by itself, without listing and without calling the watch error
// handler, and synced still says false until a watch opens again. The
// watch that reopens delivers what changed meanwhile.
func TestWatchRefused(t *testing.T) {
	a, w, first := watchingEngineA(t)
	// An event first: a watch closed before any is "very short", which
	// makes the reflector list again rather than watch again.
	b := sliceOf("prod", "engines-b", "engines", http30000, podAt("10.0.0.2", "prod", "engine-b"))
	first.Add(b)
	w.waitKeys("uid-engine-a", "uid-engine-b")

	a.refuse.Store(true)
	first.Stop()
	w.waitSynced(false)
	w.waitFor("two watches refused", func() bool { return a.refused.Load() >= 2 })
	if a.lists.Load() != 0 {
		t.Error("the informer listed")
	}
	if _, n := w.last(); n != 2 {
		t.Errorf("%d updates, want 2: the outage changed the set", n)
	}

	a.refuse.Store(false)
	second := a.nextWatch(t)
	w.waitSynced(true)
	second.Delete(b)
	w.waitKeys("uid-engine-a")
	if n := w.logged(zapcore.WarnLevel, outOfSync); n != 1 {
		t.Errorf("outage logged %d times at warn, want once", n)
	}
}

// Lists that fail from the start: nothing is given (there is nothing to
// keep), synced never says true, and the failure is logged; the first list
// that answers brings the set.
func TestAPIDownAtStart(t *testing.T) {
	a := newAPI(sliceOf("prod", "engines-a", "engines", http30000, podAt("10.0.0.1", "prod", "engine-a")))
	a.failLists(apierrors.NewUnauthorized("token expired"))
	w := watchFake(t, a, Config{Namespace: "prod", Service: "engines"})
	w.waitFor("the failure logged", func() bool { return w.logged(zapcore.WarnLevel, outOfSync) == 1 })
	if _, n := w.last(); n != 0 || w.inSync() {
		t.Errorf("%d updates and synced %v before any list answered", n, w.inSync())
	}
	a.listFails.Store(nil)
	w.waitKeys("uid-engine-a")
	w.waitSynced(true)
}

// A watch ended by 410 Gone while lists answer: synced says false until
// the informer has listed again, the set stands meanwhile, and the list
// brings what changed.
func TestWatchExpired(t *testing.T) {
	a, w, first := watchingEngineA(t)

	create(t, a, sliceOf("prod", "engines-b", "engines", http30000, podAt("10.0.0.2", "prod", "engine-b")))
	first.Error(&metav1.Status{Status: metav1.StatusFailure, Code: 410, Reason: metav1.StatusReasonExpired, Message: "too old resource version"})
	w.waitKeys("uid-engine-a", "uid-engine-b")
	w.waitSynced(true)
	w.mu.Lock()
	defer w.mu.Unlock()
	if want := []bool{true, false, true}; !slices.Equal(w.syncs, want) {
		t.Errorf("synced said %v, want %v", w.syncs, want)
	}
	if len(w.updates) != 2 {
		t.Errorf("%d updates, want 2: the expired watch changed the set", len(w.updates))
	}
}
