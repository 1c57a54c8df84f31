package scheduler

import (
	"context"
	"testing"
	"time"
)

// A job given to a worker before any speed is learned is predicted at the
// speed assumed until then; once other workers complete their first jobs
// its prediction follows what they taught, and so do the hedge's wait and
// the stall verdict on a worker that never answers it.
func TestDuePredictedAnewOnceSpeedsAreLearned(t *testing.T) {
	p, clock := poolOf(t, 4)
	cfg := config(LeastWork{}, 1)
	byWorker := map[string]*Ticket{}
	for range 4 {
		tk, w := choose(t, p, cfg, 20) // a 20-step 1024x1024 image each
		byWorker[w] = tk
	}
	hung := byWorker["d"]
	if got := hung.Due(); got != 20*time.Second {
		t.Fatalf("due before anything is learned: %v; want 20 s at 1 unit/s", got)
	}
	clock.advance(time.Second)
	for _, w := range []string{"a", "b", "c"} {
		p.Release(byWorker[w], End{Worker: Succeeded}) // 20 units/s
	}
	if got := hung.Due(); got != time.Second {
		t.Fatalf("due once the others answered in 1 s: %v; want 1 s", got)
	}
	clock.advance(3 * time.Second) // 4 s in: within 5x its 1 s and health_timeout
	if stalled := p.CheckStalls(testHealth); len(stalled) != 0 {
		t.Fatalf("suspect at 4 s: %v", stalled)
	}
	clock.advance(2 * time.Second)
	if stalled := p.CheckStalls(testHealth); len(stalled) != 1 || stalled[0] != "http://d:1" {
		t.Fatalf("stalls at 6 s, beyond 5x the 1 s predicted now: %v; want d", stalled)
	}
	p.Release(hung, End{Worker: Overtaken})
	if got := hung.Due(); got != 0 {
		t.Fatalf("due once released: %v; want 0", got)
	}
}

// A hedged copy's answer may be the one whose image id the router
// remembers: the copy is its tenant's job as much as the original.
func TestAHedgedCopyIsItsTenantsJob(t *testing.T) {
	p, _ := poolOf(t, 2)
	tk := &Ticket{pool: p, cfg: config(LeastWork{}, 1), Request: Request{Job: true, Cost: 20, Tenant: "team-a"}}
	if err := p.Acquire(context.Background(), tk); err != nil {
		t.Fatal(err)
	}
	c := p.HedgeCopy(tk)
	if c == nil {
		t.Fatal("no copy on the idle worker")
	}
	if c.Tenant != "team-a" {
		t.Fatalf("the copy's tenant is %q; want team-a", c.Tenant)
	}
}

// A drain hands out no job, a hedge's copy included: a copy would hold
// the drain up, on a worker about to change its weights.
func TestNoCopyWhileADrainIsOn(t *testing.T) {
	p, _ := poolOf(t, 2)
	tk := &Ticket{pool: p, cfg: config(LeastWork{}, 1), Request: Request{Job: true, Cost: 20}}
	if err := p.Acquire(context.Background(), tk); err != nil {
		t.Fatal(err)
	}
	p.HoldJobs()
	if c := p.HedgeCopy(tk); c != nil {
		t.Fatalf("a copy went to %s while a drain was on", c.ServedBy())
	}
	p.ReleaseJobs()
	if c := p.HedgeCopy(tk); c == nil {
		t.Fatal("no copy on the idle worker once the drain was over")
	}
}
