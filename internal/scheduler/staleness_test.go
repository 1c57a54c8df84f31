package scheduler

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"testing"
)

// maxStale is the version policy of max staleness k.
func maxStale(t *testing.T, k int) VersionPolicy {
	t.Helper()
	pol, err := Staleness(k)
	if err != nil {
		t.Fatal(err)
	}
	return pol
}

// servedUnder gives four jobs under pol a worker each, at once, and
// returns the host letters of the workers they went to.
func servedUnder(t *testing.T, p *Pool, pol VersionPolicy) []string {
	t.Helper()
	cfg := config(LeastRequest{}, 0)
	hosts := map[string]bool{}
	var held []*Ticket
	for range 4 {
		tk := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 1, Staleness: pol}}
		if err := p.Acquire(context.Background(), tk); err != nil {
			t.Fatalf("acquire: %v", err)
		}
		hosts[tk.worker.dial[:1]] = true
		held = append(held, tk)
	}
	for _, tk := range held {
		p.Release(tk, End{Worker: Succeeded})
	}
	return slices.Sorted(maps.Keys(hosts))
}

// updateOnly records an update from disk to version that only the workers
// named loaded: the others serve the weights they had, as after a
// trainer's declaration that names some workers.
func updateOnly(p *Pool, version string, urls ...string) {
	u := Update{Path: DiskUpdatePath, Version: version, Mode: ModeRolling}
	p.BeginUpdate(u)
	for _, url := range urls {
		p.FinishUpdate(url, version, true, true)
	}
	p.EndUpdate(u, true)
}

func TestTheFleetKeepsItsLastVersionsInOrder(t *testing.T) {
	p, _ := poolOf(t, 1)
	for i := range MaxStaleness + 2 {
		applyUpdate(p, DiskUpdatePath, fmt.Sprint("v", i), `{"model_path":"/ckpt"}`)
	}
	applyUpdate(p, DiskUpdatePath, fmt.Sprint("v", MaxStaleness+1), `{"model_path":"/ckpt"}`) // the same again
	applyUpdate(p, "/v1/set_lora", fmt.Sprint("v", MaxStaleness+1, "+lora:x"), `{"lora_nickname":"x","lora_path":"/lora/x"}`)
	p.EndUpdate(Update{Path: DiskUpdatePath, Version: "failed"}, false)

	got := p.fleet.versions
	if len(got) != MaxStaleness+1 || got[0] != "v1" || got[len(got)-1] != fmt.Sprint("v", MaxStaleness+1) {
		t.Fatalf("after %d updates the fleet keeps %d versions, %s to %s; want the last %d, v1 to v%d",
			MaxStaleness+2, len(got), got[0], got[len(got)-1], MaxStaleness+1, MaxStaleness+1)
	}
	for i, v := range got {
		if v != fmt.Sprint("v", i+1) {
			t.Fatalf("version %d is %s; want v%d (in the order learned, a repeat, a LoRA call and a failed update adding none)", i, v, i+1)
		}
	}
}

// A policy admits the workers on the last k+1 versions the fleet has had;
// a worker two updates behind serves max-staleness:2 but not 1, and jobs
// without a policy go anywhere, as before.
func TestStalenessAcrossUpdates(t *testing.T) {
	p, _ := poolOf(t, 2)
	if got := servedUnder(t, p, maxStale(t, 0)); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("before any update, latest ran on %v; want every worker: nothing says which version is newer", got)
	}
	applyUpdate(p, DiskUpdatePath, "v1", `{"model_path":"/ckpt/1"}`)
	updateOnly(p, "v2", "http://a:1")
	for _, tc := range []struct {
		pol  VersionPolicy
		want []string
	}{
		{maxStale(t, 0), []string{"a"}},
		{maxStale(t, 1), []string{"a", "b"}},
		{VersionPolicy{}, []string{"a", "b"}},
	} {
		if got := servedUnder(t, p, tc.pol); !slices.Equal(got, tc.want) {
			t.Fatalf("a on v2, b on v1: jobs under %+v ran on %v; want %v", tc.pol, got, tc.want)
		}
	}
	updateOnly(p, "v3", "http://a:1")
	for k, want := range map[int][]string{0: {"a"}, 1: {"a"}, 2: {"a", "b"}} {
		if got := servedUnder(t, p, maxStale(t, k)); !slices.Equal(got, want) {
			t.Fatalf("a on v3, b on v1: max-staleness:%d ran on %v; want %v", k, got, want)
		}
	}
	p.fleet.versions = []string{"v3"} // b's v1 is no longer among the versions the fleet remembers
	if got := servedUnder(t, p, maxStale(t, MaxStaleness)); !slices.Equal(got, []string{"a"}) {
		t.Fatalf("max-staleness:%d ran on %v; want a alone, b being on no version the fleet has had", MaxStaleness, got)
	}
}

// During a rolling update its target is the newest version: a worker
// still on the one before is one behind.
func TestTheRollingUpdatesTargetIsTheNewest(t *testing.T) {
	p, _ := poolOf(t, 2)
	applyUpdate(p, DiskUpdatePath, "v1", `{"model_path":"/ckpt/1"}`)
	p.BeginUpdate(Update{Path: DiskUpdatePath, Version: "v2", Mode: ModeRolling})
	p.FinishUpdate("http://a:1", "v2", true, true)
	if got := servedUnder(t, p, maxStale(t, 0)); !slices.Equal(got, []string{"a"}) {
		t.Fatalf("latest ran on %v while b is still on v1; want a, on the update's target", got)
	}
	if got := servedUnder(t, p, maxStale(t, 1)); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("max-staleness:1 ran on %v; want both", got)
	}
}

// A job no worker is fresh enough for waits, counted once as held back
// however often dispatch passes it over, and runs once a worker reaches
// a version its policy admits.
func TestAJobWaitsForAFreshWorker(t *testing.T) {
	p, _ := poolOf(t, 2)
	applyUpdate(p, DiskUpdatePath, "v1", `{"model_path":"/ckpt/1"}`)
	update := Update{Path: DiskUpdatePath, Version: "v2", Mode: ModeRolling}
	p.BeginUpdate(update)
	p.SetStates([]string{"http://a:1"}, Updating) // b serves v1 meanwhile

	cfg := config(LeastWork{}, 0)
	latest := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 1, Staleness: maxStale(t, 0)}}
	done := make(chan error, 1)
	go func() { done <- p.Acquire(context.Background(), latest) }()
	waitQueued(t, p, 1)
	for range 3 { // other jobs come and go on b, passing the waiting one
		if got := servedUnder(t, p, VersionPolicy{}); !slices.Equal(got, []string{"b"}) {
			t.Fatalf("jobs without a policy ran on %v; want b", got)
		}
	}
	if held := p.HeldBack(); held["latest"] != 1 || held["max_staleness"] != 0 {
		t.Fatalf("jobs held back: %v; want the one of latest", held)
	}

	p.FinishUpdate("http://a:1", "v2", true, true)
	if err := <-done; err != nil || latest.ServedBy() != "http://a:1" || latest.ServedVersion() != "v2" {
		t.Fatalf("the waiting job got %q on %q (%v); want a, on v2", latest.ServedBy(), latest.ServedVersion(), err)
	}
	if !latest.HeldByPolicy() {
		t.Fatal("the job does not know its policy held it back")
	}
	p.Release(latest, End{Worker: Succeeded})
	p.EndUpdate(update, true)
	if held := p.HeldBack(); held["latest"] != 1 {
		t.Fatalf("jobs held back after the update: %v; want still 1", held)
	}
}

// Every waiting job a stale worker could have taken counts as held back,
// once, though a dispatch pass asks about the first of them only: they
// wait for the same workers.
func TestEveryJobAStaleWorkerCouldTakeCountsAsHeldBack(t *testing.T) {
	p, _ := poolOf(t, 2)
	applyUpdate(p, DiskUpdatePath, "v1", `{"model_path":"/ckpt/1"}`)
	updateOnly(p, "v2", "http://a:1") // b stays on v1: too stale for latest
	cfg := config(LeastWork{}, 1)
	busy := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 100, Staleness: maxStale(t, 0)}}
	if err := p.Acquire(context.Background(), busy); err != nil || busy.ServedBy() != "http://a:1" {
		t.Fatalf("the first job of latest got %q (%v); want a", busy.ServedBy(), err)
	}
	waiting := make([]*Ticket, 3)
	done := make(chan error, len(waiting))
	for i := range waiting {
		waiting[i] = &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 1, Staleness: maxStale(t, 0)}}
		go func() { done <- p.Acquire(context.Background(), waiting[i]) }()
		waitQueued(t, p, i+1)
	}
	if held := p.HeldBack(); held["latest"] != 3 {
		t.Fatalf("with b free, jobs held back: %v; want the 3 of latest waiting", held)
	}
	p.Release(busy, End{Worker: Succeeded})
	for range waiting {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		p.mu.Lock()
		var running *Ticket
		for _, tk := range waiting {
			if tk.worker != nil {
				running = tk
			}
		}
		p.mu.Unlock()
		p.Release(running, End{Worker: Succeeded})
	}
	for _, tk := range waiting {
		if !tk.HeldByPolicy() || tk.ServedBy() != "http://a:1" {
			t.Fatalf("a job held back %v, served by %q; want held back, then served by a", tk.HeldByPolicy(), tk.ServedBy())
		}
	}
	if held := p.HeldBack(); held["latest"] != 3 {
		t.Fatalf("jobs held back once served: %v; want still 3", held)
	}
}

// The versions outlive a restart, and a standby follows them; an update
// in progress as the record was written counts as learned by the router
// that takes it over; a record written before versions were kept reads
// back with none.
func TestTheVersionsOutliveTheProcess(t *testing.T) {
	before, _ := poolOf(t, 2)
	applyUpdate(before, DiskUpdatePath, "v1", `{"model_path":"/ckpt/1"}`)
	applyUpdate(before, DiskUpdatePath, "v2", `{"model_path":"/ckpt/2"}`)
	rec := throughStorage(t, before.Record())

	after, _ := poolOf(t, 2)
	after.Restore(rec)
	standby, _ := poolOf(t, 2)
	standby.Mirror(rec)
	for name, p := range map[string]*Pool{"restarted": after, "standby": standby} {
		if got := p.fleet.versions; !slices.Equal(got, []string{"v1", "v2"}) {
			t.Fatalf("%s router's versions: %v; want v1, v2", name, got)
		}
	}

	leader, _ := midUpdate(t)
	taker, _ := poolOf(t, 2)
	taker.Inherit(throughStorage(t, leader.Record()))
	if got := taker.fleet.versions; !slices.Equal(got, []string{"step-1", "step-2"}) {
		t.Fatalf("versions after taking over an update to step-2: %v; want step-1, step-2", got)
	}

	rec.Versions = nil
	old, _ := poolOf(t, 2)
	old.Restore(throughStorage(t, rec))
	if got := old.fleet.versions; len(got) != 0 || old.Stats().Version != "v2" {
		t.Fatalf("a record without versions read back versions %v, weights %q; want none, v2", got, old.Stats().Version)
	}
	if got := servedUnder(t, old, maxStale(t, 0)); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("with no versions known, latest ran on %v; want every worker", got)
	}
}
