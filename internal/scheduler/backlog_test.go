package scheduler

import (
	"context"
	"testing"
	"time"
)

// learnSpeeds gives p's workers, in joining order, these learned speeds.
func learnSpeeds(p *Pool, speeds ...float64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, w := range p.workers {
		w.load.speed.Observe(speeds[i], time.Second, 0)
	}
	p.refreshDefaultSpeedLocked()
}

func TestBacklogPlaysTheQueueOutOnTheWorkersThatFreeFirst(t *testing.T) {
	p, clock := poolOf(t, 2)
	learnSpeeds(p, 2, 1) // a does 2 units a second, b 1
	cfg := config(LeastWork{}, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, on := choose(t, p, cfg, 4); on != "a" { // a: done in 2 s
		t.Fatalf("first job went to %s; want a, the faster", on)
	}
	choose(t, p, cfg, 5) // b: done in 5 s
	for _, cost := range []float64{2, 2, 3} {
		enqueue(t, p, cfg, cost, ctx)
	}
	// a frees first each time: 2+1 s, 3+1 s, then 4 s < b's 5 s: 4+1.5 s.
	if got, want := p.Backlog(), 5500*time.Millisecond; got != want {
		t.Fatalf("backlog %v; want %v", got, want)
	}
	clock.advance(time.Second)
	if got, want := p.Backlog(), 4500*time.Millisecond; got != want {
		t.Fatalf("a second later, backlog %v; want %v", got, want)
	}
}

func TestBacklogOfAnIdlePoolIsZero(t *testing.T) {
	p, _ := poolOf(t, 3)
	if got := p.Backlog(); got != 0 {
		t.Fatalf("backlog %v; want 0", got)
	}
}

func TestBacklogCountsPinnedJobsOnTheirWorker(t *testing.T) {
	p, _ := poolOf(t, 2)
	learnSpeeds(p, 1, 1)
	cfg := config(LeastWork{}, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	choose(t, p, cfg, 1) // a
	choose(t, p, cfg, 1) // b
	for range 3 {
		tk := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 2, Pin: "http://b:1"}}
		n := queued(p)
		go func() { _ = p.Acquire(ctx, tk) }()
		waitQueued(t, p, n+1)
	}
	// All three wait for b, however soon a frees: 1 + 3×2 s.
	if got, want := p.Backlog(), 7*time.Second; got != want {
		t.Fatalf("backlog %v; want %v", got, want)
	}
}
