package diffusionrouter

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

var testHealth = &healthConfig{
	interval: 10 * time.Second, timeout: 5 * time.Second, fails: 3, passes: 2, stallFactor: 5,
	maxFails: 3, failWindow: 30 * time.Second, ejectTime: 10 * time.Second, maxEjectTime: 35 * time.Second,
}

var errProbe = errors.New("status 503")

func TestProbesTakeWorkerOutAndBringItBack(t *testing.T) {
	p, clock := poolOf(t, 1)
	w := p.workers[0]
	for i := range 3 {
		want := unchanged
		if i == 2 {
			want = becameUnhealthy
		}
		if got := p.recordProbe("http://a:1", errProbe, testHealth); got != want {
			t.Fatalf("failed probe %d: %v", i+1, got)
		}
		clock.advance(testHealth.interval)
	}
	if w.serving(p.now().UnixNano()) {
		t.Fatal("worker serves after 3 failed probes")
	}
	if p.recordProbe("http://a:1", nil, testHealth) != unchanged || p.recordProbe("http://a:1", nil, testHealth) != becameHealthy {
		t.Fatal("worker did not come back after 2 passed probes")
	}
}

func TestBusyWorkerIsNotDead(t *testing.T) {
	p, clock := poolOf(t, 1)
	cfg := config(scheduler.LeastWork{}, 1)
	p.workers[0].load.speed.Observe(10, 10*time.Second, 0) // 1 unit per second
	tk, _ := choose(t, p, cfg, 60)                         // predicted to run a minute
	timeout := context.DeadlineExceeded
	for range 10 {
		clock.advance(10 * time.Second)
		if p.recordProbe("http://a:1", timeout, testHealth) != unchanged || p.workers[0].health.down {
			t.Fatal("a worker busy within twice its predicted time was marked down for slow probes")
		}
	}
	// 100 s into a 60 s job the worker is no longer excused, but the job
	// has overrun 5x only at 300 s: not yet suspect either.
	if stalled := p.checkStalls(testHealth); len(stalled) != 0 {
		t.Fatalf("suspect at 100 s of a 60 s job: %v", stalled)
	}
	clock.advance(20 * time.Second)
	for range 3 {
		p.recordProbe("http://a:1", timeout, testHealth)
	}
	if !p.workers[0].health.down {
		t.Fatal("timed-out probes past twice the predicted time do count")
	}
	p.release(tk, succeeded)
}

func TestStalledJobMakesWorkerSuspect(t *testing.T) {
	p, clock := poolOf(t, 2)
	cfg := config(scheduler.LeastRequest{}, 0)
	for _, w := range p.workers {
		w.load.speed.Observe(10, 10*time.Second, 0)
	}
	stalled := &ticket{pool: p, cfg: cfg, job: true, cost: 2, pin: "http://a:1"}
	if err := p.acquire(context.Background(), stalled); err != nil {
		t.Fatal(err)
	}
	clock.advance(6 * time.Second) // 3x its 2 s: not yet
	if len(p.checkStalls(testHealth)) != 0 {
		t.Fatal("suspect before health_timeout and 5x the prediction")
	}
	clock.advance(5 * time.Second)
	if got := p.checkStalls(testHealth); len(got) != 1 || got[0] != "http://a:1" {
		t.Fatalf("stalls: %v", got)
	}
	p.recordProbe("http://a:1", nil, testHealth) // its /health still answers
	for range 5 {
		if _, w := choose(t, p, cfg, 1); w != "b" {
			t.Fatalf("a job went to the stalled worker %s", w)
		}
	}
	p.release(stalled, succeeded)
	if !p.workers[0].serving(p.now().UnixNano()) {
		t.Fatal("worker still suspect after its stalled job ended")
	}
}

// ejectingPool is poolOf for tests that eject workers: an ejection sets a
// timer on the real clock, which reads the fake one when it fires; stopping
// the pool with the test keeps it from firing later, unsynchronised with
// the test's last advance of the clock.
func ejectingPool(t *testing.T, n int) (*pool, *fakeClock) {
	t.Helper()
	p, clock := poolOf(t, n)
	t.Cleanup(func() { _ = p.Destruct() })
	return p, clock
}

func TestFailedRequestsEjectWithDoubling(t *testing.T) {
	p, clock := ejectingPool(t, 1)
	cfg := config(scheduler.LeastRequest{}, 0)
	cfg.health = testHealth
	fail := func(n int) {
		for range n {
			tk, _ := choose(t, p, cfg, 1)
			p.release(tk, failed)
		}
	}
	ejectedFor := func() time.Duration { return time.Duration(p.workers[0].health.ejectedUntil - p.now().UnixNano()) }
	fail(3)
	if d := ejectedFor(); d != 10*time.Second {
		t.Fatalf("first ejection for %v; want 10s", d)
	}
	for _, want := range []time.Duration{20 * time.Second, 35 * time.Second, 35 * time.Second} {
		clock.advance(ejectedFor())
		fail(3)
		if d := ejectedFor(); d != want {
			t.Fatalf("repeat ejection for %v; want %v", d, want)
		}
	}
	clock.advance(ejectedFor())
	tk, _ := choose(t, p, cfg, 1)
	p.release(tk, succeeded) // a success resets the doubling
	fail(3)
	if d := ejectedFor(); d != 10*time.Second {
		t.Fatalf("ejection after a success for %v; want 10s again", d)
	}
	// Failures spread wider than the window do not add up.
	clock.advance(ejectedFor())
	for range 3 {
		fail(1)
		clock.advance(20 * time.Second)
	}
	if ejectedFor() > 0 {
		t.Fatal("failures 20 s apart ejected the worker; the window is 30 s")
	}
}

func TestPassedProbeEndsEjection(t *testing.T) {
	p, _ := ejectingPool(t, 1)
	cfg := config(scheduler.LeastRequest{}, 0)
	cfg.health = testHealth
	for range 3 {
		tk, _ := choose(t, p, cfg, 1)
		p.release(tk, failed)
	}
	w := p.snapshot()[0]
	if w.State != ejected || w.EjectedTill.IsZero() {
		t.Fatalf("after 3 failures the worker is %v until %v; want ejected", w.State, w.EjectedTill)
	}
	if change := p.recordProbe(w.URL, nil, testHealth); change != ejectionEnded {
		t.Fatalf("a passed probe of an ejected worker changed %v; want its ejection ended", change)
	}
	if w := p.snapshot()[0]; w.State != serving || !w.EjectedTill.IsZero() {
		t.Fatalf("after a passed probe the worker is %v until %v; want serving", w.State, w.EjectedTill)
	}
}

func TestOnlyWorkerFaultsCountAgainstIt(t *testing.T) {
	p, clock := ejectingPool(t, 1)
	cfg := config(scheduler.LeastRequest{}, 0)
	cfg.health = testHealth
	good, _ := choose(t, p, cfg, 10)
	clock.advance(time.Second)
	p.release(good, succeeded)
	learned := p.snapshot()[0].Speed
	for range 10 { // the worker refuses bad requests at once
		tk, _ := choose(t, p, cfg, 1e6)
		clock.advance(time.Millisecond)
		p.release(tk, refused)
	}
	w := p.snapshot()[0]
	if w.State != serving || w.Failures != 0 || w.Speed != learned {
		t.Fatalf("after 10 refused requests: %v, %d failures, speed %v (was %v); a 4xx says nothing of the worker", w.State, w.Failures, w.Speed, learned)
	}
	for range 3 {
		tk, _ := choose(t, p, cfg, 1)
		p.release(tk, failed)
	}
	if w := p.snapshot()[0]; w.State != ejected || w.Failures != 3 || w.Speed != learned {
		t.Fatalf("after 3 failures: %v, %d failures, speed %v; want ejected, 3, and the speed unlearned from them", w.State, w.Failures, w.Speed)
	}
}

func TestOutcomeOfAnAnswer(t *testing.T) {
	live, gone := context.Background(), canceledContext()
	for _, tc := range []struct {
		ctx    context.Context
		err    error
		status int
		want   outcome
	}{
		{live, nil, 200, succeeded},
		{live, nil, 400, refused},
		{live, nil, 422, refused},
		{live, nil, 500, failed},
		{live, nil, 502, failed},
		{live, errors.New("reset"), 0, failed},
		{gone, nil, 500, abandoned},
	} {
		if got := outcomeOf(tc.ctx, tc.err, tc.status); got != tc.want {
			t.Errorf("outcomeOf(%d, %v) = %v; want %v", tc.status, tc.err, got, tc.want)
		}
	}
}

func canceledContext() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}
