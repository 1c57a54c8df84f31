package diffusionrouter

import (
	"context"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

func TestRemovedWorkerKeepsItsJobsWhenItReturns(t *testing.T) {
	p, _ := poolOf(t, 1)
	cfg := config(scheduler.LeastWork{}, 1)
	running, _ := choose(t, p, cfg, 10)
	u := running.servedBy
	if !p.remove(u) {
		t.Fatal("remove failed")
	}
	if _, _, err := p.register(u, defaultMaxWorkers); err != nil {
		t.Fatal(err)
	}
	if info, _ := p.worker(u); info.Inflight != 1 {
		t.Fatalf("back in the pool, the worker has %d jobs in flight; want the 1 still running", info.Inflight)
	}
	waiting := &ticket{pool: p, cfg: cfg, job: true, cost: 1}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := p.acquire(ctx, waiting); err == nil {
		t.Fatal("a second job went to a worker still running its first (max_inflight 1)")
	}
	p.release(running, succeeded)
	if info, _ := p.worker(u); info.Inflight != 0 {
		t.Fatalf("after its job ended the worker has %d in flight", info.Inflight)
	}
}
