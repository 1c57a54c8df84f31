package scheduler

import (
	"context"
	"testing"
	"time"
)

func TestRemovedWorkerKeepsItsJobsWhenItReturns(t *testing.T) {
	p, _ := poolOf(t, 1)
	cfg := config(LeastWork{}, 1)
	running, _ := choose(t, p, cfg, 10)
	u := running.servedBy
	if !p.Remove(u) {
		t.Fatal("remove failed")
	}
	if _, _, err := p.Register(u, 4096); err != nil {
		t.Fatal(err)
	}
	if info, _ := p.Worker(u); info.Inflight != 1 {
		t.Fatalf("back in the pool, the worker has %d jobs in flight; want the 1 still running", info.Inflight)
	}
	waiting := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 1}}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := p.Acquire(ctx, waiting); err == nil {
		t.Fatal("a second job went to a worker still running its first (max_inflight 1)")
	}
	p.Release(running, End{Worker: Succeeded})
	if info, _ := p.Worker(u); info.Inflight != 0 {
		t.Fatalf("after its job ended the worker has %d in flight", info.Inflight)
	}
}
