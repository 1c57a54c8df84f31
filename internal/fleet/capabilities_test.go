package fleet

import (
	"context"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// modelsWorker answers GET /v1/models with status and body, and counts
// the calls.
func modelsWorker(t *testing.T, status int, body string) (*httptest.Server, *atomic.Int32) {
	t.Helper()
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/models" {
			http.NotFound(w, r)
			return
		}
		calls.Add(1)
		w.WriteHeader(status)
		_, _ = w.Write([]byte(body))
	}))
	t.Cleanup(srv.Close)
	return srv, &calls
}

const wanModels = `{"object":"list","data":[{"id":"Wan-AI/Wan2.1-T2V-1.3B","task_type":"T2V"}]}`

// newProbingFleet returns the fleet of a pool that declares urls.
func newProbingFleet(t *testing.T, urls ...string) (*Fleet, *scheduler.Pool) {
	t.Helper()
	p := scheduler.New(t.Name(), zap.NewNop())
	f := New(p, zap.NewNop())
	t.Cleanup(func() { _ = p.Close(); f.Close() })
	p.Declare(urls)
	return f, p
}

func TestWelcomeLearnsWhatAWorkerMakes(t *testing.T) {
	srv, _ := modelsWorker(t, http.StatusOK, wanModels)
	f, p := newProbingFleet(t, srv.URL)
	f.Welcome(context.Background(), srv.URL)
	info, _ := p.Worker(srv.URL)
	if !slices.Equal(info.TaskTypes, []string{"T2V"}) || info.Version != "Wan-AI/Wan2.1-T2V-1.3B" || info.State != scheduler.Serving {
		t.Fatalf("after a welcome the worker makes %v, has weights %q and is %v; want [T2V], the model id, serving", info.TaskTypes, info.Version, info.State)
	}
}

func TestWelcomeLeavesOutAWorkerThatDoesNotAnswer(t *testing.T) {
	srv, _ := modelsWorker(t, http.StatusInternalServerError, `{"error":"boom"}`)
	f, p := newProbingFleet(t, srv.URL)
	f.Welcome(context.Background(), srv.URL)
	if info, _ := p.Worker(srv.URL); info.State != scheduler.Unhealthy || info.LastError != "status=500" || info.TaskTypes != nil {
		t.Fatalf("a worker whose /v1/models fails is %v (%q), makes %v; want unhealthy, status=500, unknown", info.State, info.LastError, info.TaskTypes)
	}
}

func TestWelcomeCutShortSaysNothingOfTheWorker(t *testing.T) {
	srv, _ := modelsWorker(t, http.StatusOK, wanModels)
	f, p := newProbingFleet(t, srv.URL)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	f.Welcome(ctx, srv.URL)
	if info, _ := p.Worker(srv.URL); info.State != scheduler.Serving {
		t.Fatalf("a welcome cut short left the worker %v (%q); want serving", info.State, info.LastError)
	}
}

func TestProbeUnknownAsksOnlyTheWorkersNotKnownYet(t *testing.T) {
	srv, calls := modelsWorker(t, http.StatusOK, wanModels)
	f, p := newProbingFleet(t, srv.URL)
	f.ProbeUnknown(context.Background())
	f.ProbeUnknown(context.Background())
	if n := calls.Load(); n != 1 || !p.CanServe(request.VideoTask) {
		t.Fatalf("two rounds asked the worker %d times and the pool can serve video: %v; want once, true", n, p.CanServe(request.VideoTask))
	}
}

// Jobs that arrive together while a worker's first probe is under way
// wait for it: the second must not be judged with the worker unknown,
// which would tell a video job that no worker makes videos.
func TestRequestsDuringAProbeWaitForIt(t *testing.T) {
	called, answer := make(chan struct{}), make(chan struct{})
	var once sync.Once
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		once.Do(func() { close(called) })
		<-answer
		_, _ = w.Write([]byte(wanModels))
	}))
	t.Cleanup(srv.Close)
	f, p := newProbingFleet(t, srv.URL)
	first := make(chan struct{})
	go func() {
		defer close(first)
		f.ProbeUnknown(context.Background())
	}()
	<-called
	second := make(chan bool)
	go func() {
		f.ProbeUnknown(context.Background())
		second <- p.CanServe(request.VideoTask)
	}()
	time.Sleep(50 * time.Millisecond) // the second request arrives while the probe runs
	close(answer)
	if !<-second {
		t.Fatal("a request that came during the probe was judged before it ended: no worker makes videos")
	}
	<-first
}
