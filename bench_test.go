package diffusionrouter

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// benchPool is a pool of n workers with learned, varied speeds, on a fixed
// clock.
func benchPool(b *testing.B, n int) *pool {
	p := newPool("bench")
	at := time.Unix(1_000_000, 0)
	p.now = func() time.Time { return at }
	urls := make([]string, n)
	for i := range urls {
		urls[i] = fmt.Sprintf("http://10.0.%d.%d:30000", i/256, i%256)
	}
	p.declare(urls)
	for i, w := range p.workers {
		w.load.speed.Observe(1+float64(i%4), time.Second, 0) // that many units a second
	}
	return p
}

// fleetSizes are the pool sizes the routing benchmarks measure: a large
// fleet today, and eight times that.
var fleetSizes = []int{1024, 8192}

// BenchmarkDecision measures one least_work decision among n workers with
// max_inflight 1, each worker with a job but the free ones: "busy" leaves
// 16 free, as under rollout load, where the queue is rarely empty; "half"
// leaves half and "idle" all of them free, the worst case.
func BenchmarkDecision(b *testing.B) {
	for _, n := range fleetSizes {
		for _, bc := range []struct {
			name string
			free int
		}{{"busy", 16}, {"half", n / 2}, {"idle", n}} {
			b.Run(fmt.Sprintf("%d/%s", n, bc.name), func(b *testing.B) {
				p := benchPool(b, n)
				cfg := &dispatchConfig{strategy: scheduler.LeastWork{}, maxInflight: 1, maxQueue: 10, order: scheduler.FIFO{}}
				for _, w := range p.workers[bc.free:] {
					p.assignLocked(&ticket{pool: p, cfg: cfg, job: true, cost: 10}, w)
				}
				t := &ticket{pool: p, cfg: cfg, job: true, cost: 20}
				b.ReportAllocs()
				b.ResetTimer()
				for b.Loop() {
					p.mu.Lock()
					if w, _ := p.chooseLocked(t); w == nil {
						b.Fatal("no worker")
					}
					p.mu.Unlock()
				}
			})
		}
	}
}

// BenchmarkAcquireRelease measures a job's whole claim on a pool of n idle
// workers: choose, claim, release (with speed learning).
func BenchmarkAcquireRelease(b *testing.B) {
	for _, n := range fleetSizes {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			p := benchPool(b, n)
			cfg := &dispatchConfig{strategy: scheduler.LeastWork{}, maxInflight: 1, maxQueue: 10, order: scheduler.FIFO{}}
			ctx := context.Background()
			b.ReportAllocs()
			for b.Loop() {
				t := ticket{pool: p, cfg: cfg, job: true, cost: 20}
				if err := p.acquire(ctx, &t); err != nil {
					b.Fatal(err)
				}
				p.release(&t, succeeded)
			}
		})
	}
}

// BenchmarkDrain fills a queue with 10,000 waiting jobs and drains it.
func BenchmarkDrain(b *testing.B) {
	for b.Loop() {
		drainQueue(b, 10_000)
	}
}

// BenchmarkServeHTTP measures the router's own work on a zero-cost job,
// with reverse_proxy replaced by a handler that writes a worker's answer:
// what the router adds to every job, without the network.
func BenchmarkServeHTTP(b *testing.B) {
	ctx, err := caddy.ProvisionContext(&caddy.Config{})
	if err != nil {
		b.Fatal(err)
	}
	urls := []string{"http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.0.3:30000", "http://10.0.0.4:30000"}
	h := &Handler{Pool: "bench-serve", Workers: urls, PersistOff: true}
	if err := h.Provision(ctx); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = h.Cleanup() })
	h.pool.store.markReady() // as the health app's start does
	h.logger = zap.NewNop()  // as at the level WARN that examples/bench/wrk runs at
	for _, u := range urls {
		h.pool.setCapabilities(u, []string{"T2I"}, "fake/diffusion-model")
	}
	answer := []byte(`{"id":"3f1c2f9e-6a0b-4c1e-9d3a-2b7e8f0a1c5d","created":1,"data":[{"b64_json":"iVBORw0KGgo="}]}`)
	worker := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(answer)))
		w.WriteHeader(http.StatusOK)
		_, err := w.Write(answer)
		return err
	})
	body := `{"prompt":"x","size":"1x1","num_inference_steps":1,"response_format":"b64_json"}`
	b.ReportAllocs()
	for b.Loop() {
		r := httptest.NewRequest(http.MethodPost, "/v1/images/generations", strings.NewReader(body))
		r.Header.Set("Content-Type", "application/json")
		repl := caddy.NewReplacer()
		rctx := context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl)
		rctx = context.WithValue(rctx, caddyhttp.VarsCtxKey, map[string]any{})
		w := httptest.NewRecorder()
		if err := h.ServeHTTP(w, r.WithContext(rctx), worker); err != nil || w.Code != http.StatusOK {
			b.Fatal(w.Code, err, w.Body.String())
		}
	}
}
