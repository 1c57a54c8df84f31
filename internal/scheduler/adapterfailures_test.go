package scheduler

import (
	"context"
	"errors"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// brokenPool returns a pool of n workers with adapter a declared, whose
// logs are kept, and its switcher; the workers named in broken cannot
// have their adapter read.
func brokenPool(t *testing.T, n int, broken ...string) (*Pool, *fakeSwitcher, *observer.ObservedLogs) {
	t.Helper()
	p, clock := poolOf(t, n)
	t.Cleanup(func() { _ = p.Close() })
	core, logs := observer.New(zap.InfoLevel)
	p.logger = zap.New(core)
	sw := &fakeSwitcher{pool: p, clock: clock, took: time.Second, active: map[string]Adapter{}, broken: map[string]bool{}}
	for _, u := range broken {
		sw.broken[u] = true
	}
	p.DeclareAdapters([]Adapter{{Name: "a", Path: "/l/a"}}, placementConfig(time.Second))
	p.UseSwitcher(sw)
	return p, sw, logs
}

// tickUntil moves the pool's clock on a second at a time, letting the
// calls each tick starts end, until cond holds; it fails the test after
// ten minutes of the pool's time.
func tickUntil(t *testing.T, p *Pool, sw *fakeSwitcher, what string, cond func() bool) {
	t.Helper()
	for range 600 {
		if cond() {
			return
		}
		tick(p, sw.clock, time.Second)
		waitFor(t, "the calls of the tick to end", func() bool { return !calling(p) })
	}
	t.Fatalf("%s never happened", what)
}

// calling reports whether a call to some worker's adapter is under way.
func calling(p *Pool) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, w := range p.workers {
		if w.adapter.calling {
			return true
		}
	}
	return false
}

// ended returns what Acquire returned for a job, or fails the test when it
// has not returned yet.
func ended(t *testing.T, done chan error) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("the job still waits")
		return nil
	}
}

// warnings counts the log entries at warn level.
func warnings(logs *observer.ObservedLogs) int {
	return logs.FilterLevelExact(zapcore.WarnLevel).Len()
}

func TestAWorkerWhoseAdapterCannotBeReadIsOutAfterThreeFailures(t *testing.T) {
	p, sw, logs := brokenPool(t, 1, "http://a:1")
	tk, done := adapterJob(t, p, config(LeastWork{}, 1), "")
	tickUntil(t, p, sw, "three failed reads", func() bool { return p.Snapshot()[0].AdapterFailures >= FailuresOut })
	tick(p, sw.clock, time.Second)
	err := ended(t, done)
	if u, ok := errors.AsType[*UnservableAdapterError](CancelledBy(tk.ctx)); !ok || u.Name != "" {
		t.Fatalf("a base job on the only worker, whose adapter cannot be read: %v, cause %v; want it ended as unservable", err, CancelledBy(tk.ctx))
	}
	if msg := CancelledBy(tk.ctx).Error(); msg != "no worker can serve the base weights now: every worker that could failed 3 LoRA calls in a row (http://a:1: list_loras: 500)" {
		t.Fatalf("error %q", msg)
	}
	if w := p.Snapshot()[0]; w.AdapterOut != OutUnreadable || p.ServingCount() != 0 {
		t.Fatalf("worker out %q, %d serving; want it out as unreadable and none serving", w.AdapterOut, p.ServingCount())
	}
	tickUntil(t, p, sw, "two more failed reads", func() bool { return p.Snapshot()[0].AdapterFailures >= FailuresOut+2 })
	if n := warnings(logs); n != 2 {
		t.Fatalf("%d warnings for 5 failed reads; want 2: the first, and the one that took the worker out", n)
	}

	sw.mu.Lock()
	sw.broken = map[string]bool{}
	sw.mu.Unlock()
	tickUntil(t, p, sw, "the adapter read again", func() bool { return p.Snapshot()[0].AdapterState == "ready" })
	if w := p.Snapshot()[0]; w.AdapterOut != "" || w.AdapterFailures != 0 || p.ServingCount() != 1 {
		t.Fatalf("after a read that worked: out %q, %d failures, %d serving", w.AdapterOut, w.AdapterFailures, p.ServingCount())
	}
	if logs.FilterMessage("the worker's LoRA adapter can be read again").Len() != 1 {
		t.Fatalf("the way back was not logged once: %v", logs.All())
	}
	next, done := adapterJob(t, p, config(LeastWork{}, 1), "")
	if got := servedWith(t, sw, next, done); got != "" {
		t.Fatalf("a base job ran on %q", got)
	}
}

func TestJobsGoToTheWorkersWhoseAdapterCanBeRead(t *testing.T) {
	p, sw, _ := brokenPool(t, 2, "http://a:1")
	tickUntil(t, p, sw, "a out", func() bool { return p.Snapshot()[0].AdapterOut == OutUnreadable })
	for range 3 {
		tk, done := adapterJob(t, p, config(LeastWork{}, 1), "")
		servedWith(t, sw, tk, done)
		if tk.servedBy != "http://b:1" {
			t.Fatalf("a base job went to %s", tk.servedBy)
		}
		p.Release(tk, End{Worker: Succeeded})
	}
	if n := p.ServingCount(); n != 1 {
		t.Fatalf("%d workers serving; want b alone", n)
	}
}

func TestAWorkerWhoseSwitchesFailIsOutButServesTheBase(t *testing.T) {
	p, sw, logs := brokenPool(t, 1)
	sw.mu.Lock()
	sw.failing = 100
	sw.mu.Unlock()
	cfg := config(LeastWork{}, 1)
	tk, done := adapterJob(t, p, cfg, "a")
	tickUntil(t, p, sw, "the job of a ended", func() bool { return len(done) > 0 })
	err := ended(t, done)
	if u, ok := errors.AsType[*UnservableAdapterError](CancelledBy(tk.ctx)); !ok || u.Name != "a" {
		t.Fatalf("a job of a, which the only worker failed to switch to 3 times: %v, cause %v", err, CancelledBy(tk.ctx))
	}
	if msg := CancelledBy(tk.ctx).Error(); msg != `no worker can serve adapter "a" now: every worker that could failed 3 LoRA calls in a row (http://a:1: switch to a: /v1/set_lora answered 500)` {
		t.Fatalf("error %q", msg)
	}
	if tried := 100 - sw.failing; tried != FailuresOut {
		t.Fatalf("%d switches tried; want %d, then none", tried, FailuresOut)
	}
	if w := p.Snapshot()[0]; w.AdapterOut != OutSwitches || w.AdapterState != "ready" || p.ServingCount() != 1 {
		t.Fatalf("worker out %q, adapter %s, %d serving; want out for its switches, on the base weights, serving", w.AdapterOut, w.AdapterState, p.ServingCount())
	}
	base, done := adapterJob(t, p, cfg, "")
	if got := servedWith(t, sw, base, done); got != "" {
		t.Fatalf("a base job ran on %q", got)
	}
	p.Release(base, End{Worker: Succeeded})
	if _, done := adapterJob(t, p, cfg, "a"); ended(t, done) == nil {
		t.Fatal("a job of a arriving while the worker is out got it")
	}
	if n := warnings(logs); n != 2 {
		t.Fatalf("%d warnings for 3 failed switches; want 2: the first, and the one that took the worker out", n)
	}

	sw.mu.Lock()
	sw.failing = 0
	sw.mu.Unlock()
	tickUntil(t, p, sw, "the worker's time out ended", func() bool { return p.Snapshot()[0].AdapterOut == "" })
	tk, done = adapterJob(t, p, cfg, "a")
	if got := servedWith(t, sw, tk, done); got != "a" {
		t.Fatalf("the job of a after the worker's time out ran on %q", got)
	}
	if w := p.Snapshot()[0]; w.AdapterOut != "" || w.AdapterFailures != 0 {
		t.Fatalf("after a switch that worked: out %q, %d failures", w.AdapterOut, w.AdapterFailures)
	}
}

// TestASwitchIsBoundedByTheSwitchTimeout checks that a switch that never
// answers fails once SwitchTimeout passes, rather than holding the worker.
func TestASwitchIsBoundedByTheSwitchTimeout(t *testing.T) {
	p, _ := poolOf(t, 1)
	t.Cleanup(func() { _ = p.Close() })
	sw := &hangingSwitcher{}
	cfg := placementConfig(time.Second)
	cfg.SwitchTimeout = 50 * time.Millisecond
	p.DeclareAdapters([]Adapter{{Name: "a", Path: "/l/a"}}, cfg)
	p.UseSwitcher(sw)
	_, _ = adapterJob(t, p, config(LeastWork{}, 1), "a")
	waitFor(t, "the switch to fail", func() bool { return p.Adapters()[1].Failures == 1 })
	if w := p.Snapshot()[0]; w.AdapterError != "switch to a: context deadline exceeded" {
		t.Fatalf("the switch failed with %q", w.AdapterError)
	}
}

// hangingSwitcher is a worker on the base weights whose switches never
// answer: they end only when their context does.
type hangingSwitcher struct{}

func (*hangingSwitcher) Active(context.Context, string) (string, string, error) { return "", "", nil }

func (*hangingSwitcher) Switch(ctx context.Context, _ string, _ *Adapter, _ bool) (int, string, error) {
	<-ctx.Done()
	return 502, ctx.Err().Error(), ctx.Err()
}
