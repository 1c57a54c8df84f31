package kubediscovery

import (
	"context"
	"fmt"
	"runtime"
	"testing"
	"time"

	"go.uber.org/zap"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/utils/ptr"
)

// Ten thousand endpoints over ten slices make one set of ten thousand:
// bounding it is the caller's (max_workers).
func TestTenThousandEndpoints(t *testing.T) {
	client := fake.NewClientset()
	for s := range 10 {
		eps := make([]discoveryv1.Endpoint, 1000)
		for i := range eps {
			eps[i] = podAt(fmt.Sprintf("10.%d.%d.%d", s, i/250, i%250+1), "prod", fmt.Sprintf("engine-%d-%d", s, i))
		}
		create(t, client, sliceOf("prod", fmt.Sprintf("engines-%d", s), "engines", http30000, eps...))
	}
	w := watchFake(t, client, Config{Namespace: "prod", Service: "engines"})
	w.waitFor("ten thousand endpoints", func() bool {
		set, _ := w.last()
		return len(set) == 10000
	})
	set, _ := w.last()
	seen := map[string]bool{}
	for _, e := range set {
		if seen[e.Key] || !e.Ready {
			t.Fatalf("endpoint %+v repeated or not ready", e)
		}
		seen[e.Key] = true
	}
}

// An endpoint flipping between ready and not ready in bursts: the last
// state arrives, bursts make fewer updates than flips, and the goroutines
// do not grow with the flips.
func TestFlapping(t *testing.T) {
	s := sliceOf("prod", "engines-a", "engines", http30000, podAt("10.0.0.1", "prod", "engine-a"), podAt("10.0.0.2", "prod", "engine-b"))
	client := fake.NewClientset(s)
	w := watchFake(t, client, Config{Namespace: "prod", Service: "engines"})
	w.waitKeys("uid-engine-a", "uid-engine-b")
	base := runtime.NumGoroutine()
	flips, most := 0, base
	for burst := range 50 {
		for range 10 {
			flips++
			s.Endpoints[0].Conditions.Ready = ptr.To(flips%2 == 0)
			change(t, client, s)
		}
		if burst%10 == 0 {
			most = max(most, runtime.NumGoroutine())
		}
	}
	// 500 flips end ready, the way they began: flip once more to see it.
	s.Endpoints[0].Conditions.Ready = ptr.To(false)
	change(t, client, s)
	w.waitFor("the last flip", func() bool {
		set, _ := w.last()
		return len(set) == 2 && !set[0].Ready
	})
	_, n := w.last()
	if n > flips {
		t.Errorf("%d updates for %d flips: no coalescing", n, flips)
	}
	if most > base+10 {
		t.Errorf("goroutines grew from %d to %d while flipping", base, most)
	}
	t.Logf("%d flips, %d updates, goroutines %d then at most %d", flips, n, base, most)
}

// When its context ends WatchWith returns, and every goroutine it started
// (the informer's, the watch's) has ended.
func TestStopsWithItsContext(t *testing.T) {
	before := runtime.NumGoroutine()
	client := fake.NewClientset(sliceOf("prod", "engines-a", "engines", http30000, podAt("10.0.0.1", "prod", "engine-a")))
	w, stop := follow(t, func(ctx context.Context, log *zap.Logger, w *watcher) error {
		return WatchWith(ctx, typed{client}, Config{Namespace: "prod", Service: "engines"}, log, w.update, w.synced)
	})
	w.waitSynced(true)
	if during := runtime.NumGoroutine(); during <= before {
		t.Fatalf("%d goroutines while watching, %d before: nothing started?", during, before)
	}
	stop()
	deadline := time.Now().Add(bound)
	for runtime.NumGoroutine() > before {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Fatalf("%d goroutines left, %d before:\n%s", runtime.NumGoroutine(), before, buf[:runtime.Stack(buf, true)])
		}
		time.Sleep(10 * time.Millisecond)
	}
}
