package control

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/fleet"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// testClock is a clock the test moves.
type testClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *testClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *testClock) advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// metricsWorker is a worker whose /metrics counts its scrapes; each
// waits for gate to close, when it has one.
type metricsWorker struct {
	*httptest.Server
	scrapes atomic.Int64
}

func startMetricsWorker(t *testing.T, gate <-chan struct{}) *metricsWorker {
	t.Helper()
	w := &metricsWorker{}
	w.Server = httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			http.NotFound(rw, r)
			return
		}
		w.scrapes.Add(1)
		if gate != nil {
			<-gate
		}
		_, _ = rw.Write([]byte("sglang:num_running_reqs 1\n"))
	}))
	t.Cleanup(w.Close)
	return w
}

// metricsAPI is the control API over a pool of ws, its shared answers
// dated by clock.
func metricsAPI(t *testing.T, clock *testClock, ws ...*metricsWorker) *API {
	t.Helper()
	p := scheduler.New(t.Name(), zap.NewNop())
	t.Cleanup(func() { _ = p.Close() })
	var urls []string
	for _, w := range ws {
		urls = append(urls, w.URL)
	}
	p.Declare(urls)
	return &API{Pool: p, Fleet: fleet.New(p, zap.NewNop()), Logger: zap.NewNop(), EngineMetrics: &SharedAnswer{Now: clock.Now}}
}

// scrapeEngineMetrics asks a for /engine_metrics and checks that every
// worker's sample is in the answer.
func scrapeEngineMetrics(t *testing.T, a *API, ws []*metricsWorker) {
	rec := httptest.NewRecorder()
	a.Mux().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/engine_metrics", nil))
	if rec.Code != http.StatusOK {
		t.Errorf("/engine_metrics: %d %s", rec.Code, rec.Body)
		return
	}
	for _, w := range ws {
		if want := `worker_addr="` + strings.TrimPrefix(w.URL, "http://") + `"} 1`; !strings.Contains(rec.Body.String(), want) {
			t.Errorf("/engine_metrics lacks %s:\n%s", want, rec.Body)
		}
	}
}

// expectScrapes fails unless every worker was scraped n times.
func expectScrapes(t *testing.T, when string, ws []*metricsWorker, n int64) {
	t.Helper()
	for _, w := range ws {
		if got := w.scrapes.Load(); got != n {
			t.Fatalf("%s: worker %s scraped %d times; want %d", when, w.URL, got, n)
		}
	}
}

// /engine_metrics is open to anyone, and each answer calls every worker:
// however many ask, concurrently or one after another, the workers are
// called once per 5 s, and every caller within that time gets the answer
// of that one round.
func TestEngineMetricsCallTheWorkersOncePerFiveSeconds(t *testing.T) {
	gate := make(chan struct{})
	ws := []*metricsWorker{startMetricsWorker(t, gate), startMetricsWorker(t, gate)}
	clock := &testClock{now: time.Unix(1e9, 0)}
	a := metricsAPI(t, clock, ws...)

	// 20 callers at once, the workers' answers held until the first round
	// has reached them: the others wait for that round, or come after it.
	var wg sync.WaitGroup
	for range 20 {
		wg.Go(func() { scrapeEngineMetrics(t, a, ws) })
	}
	for ws[0].scrapes.Load() == 0 || ws[1].scrapes.Load() == 0 {
		time.Sleep(time.Millisecond) // until the round reached both: no timing decides the outcome
	}
	close(gate)
	wg.Wait()
	expectScrapes(t, "20 concurrent callers", ws, 1)

	// One after another, within the 5 s.
	for range 10 {
		scrapeEngineMetrics(t, a, ws)
		clock.advance(400 * time.Millisecond)
	}
	expectScrapes(t, "10 callers one after another within 5 s", ws, 1)

	clock.advance(time.Second) // 5 s since the round began
	scrapeEngineMetrics(t, a, ws)
	expectScrapes(t, "a caller 5 s after the first round", ws, 2)
	scrapeEngineMetrics(t, a, ws)
	expectScrapes(t, "a caller right after it", ws, 2)
}
