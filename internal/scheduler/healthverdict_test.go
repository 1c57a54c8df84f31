package scheduler

import (
	"context"
	"errors"
	"testing"
	"time"
)

var testHealth = &HealthConfig{
	Interval: 10 * time.Second, Timeout: 5 * time.Second, Fails: 3, Passes: 2, StallFactor: 5,
	MaxFails: 3, FailWindow: 30 * time.Second, EjectTime: 10 * time.Second, MaxEjectTime: 35 * time.Second, MaxEjectionPercent: 100,
}

var errProbe = errors.New("status 503")

func TestProbesTakeWorkerOutAndBringItBack(t *testing.T) {
	p, clock := poolOf(t, 1)
	w := p.workers[0]
	for i := range 3 {
		want := Unchanged
		if i == 2 {
			want = BecameUnhealthy
		}
		if got := p.RecordProbe("http://a:1", errProbe, testHealth); got != want {
			t.Fatalf("failed probe %d: %v", i+1, got)
		}
		clock.advance(testHealth.Interval)
	}
	if w.serving(p.now().UnixNano()) {
		t.Fatal("worker serves after 3 failed probes")
	}
	if p.RecordProbe("http://a:1", nil, testHealth) != Unchanged || p.RecordProbe("http://a:1", nil, testHealth) != BecameHealthy {
		t.Fatal("worker did not come back after 2 passed probes")
	}
}

func TestBusyWorkerIsNotDead(t *testing.T) {
	p, clock := poolOf(t, 1)
	cfg := config(LeastWork{}, 1)
	p.workers[0].load.speed.Observe(10, 10*time.Second, 0) // 1 unit per second
	tk, _ := choose(t, p, cfg, 60)                         // predicted to run a minute
	timeout := context.DeadlineExceeded
	for range 10 {
		clock.advance(10 * time.Second)
		if p.RecordProbe("http://a:1", timeout, testHealth) != Unchanged || p.workers[0].health.down {
			t.Fatal("a worker busy within twice its predicted time was marked down for slow probes")
		}
	}
	// 100 s into a 60 s job the worker is no longer excused, but the job
	// has overrun 5x only at 300 s: not yet suspect either.
	if stalled := p.CheckStalls(testHealth); len(stalled) != 0 {
		t.Fatalf("suspect at 100 s of a 60 s job: %v", stalled)
	}
	clock.advance(20 * time.Second)
	for range 3 {
		p.RecordProbe("http://a:1", timeout, testHealth)
	}
	if !p.workers[0].health.down {
		t.Fatal("timed-out probes past twice the predicted time do count")
	}
	p.Release(tk, End{Worker: Succeeded})
}

func TestStalledJobMakesWorkerSuspect(t *testing.T) {
	p, clock := poolOf(t, 2)
	cfg := config(LeastRequest{}, 0)
	for _, w := range p.workers {
		w.load.speed.Observe(10, 10*time.Second, 0)
	}
	stalled := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 2, Pin: "http://a:1"}}
	if err := p.Acquire(context.Background(), stalled); err != nil {
		t.Fatal(err)
	}
	clock.advance(6 * time.Second) // 3x its 2 s: not yet
	if len(p.CheckStalls(testHealth)) != 0 {
		t.Fatal("suspect before health_timeout and 5x the prediction")
	}
	clock.advance(5 * time.Second)
	if got := p.CheckStalls(testHealth); len(got) != 1 || got[0] != "http://a:1" {
		t.Fatalf("stalls: %v", got)
	}
	p.RecordProbe("http://a:1", nil, testHealth) // its /health still answers
	for range 5 {
		if _, w := choose(t, p, cfg, 1); w != "b" {
			t.Fatalf("a job went to the stalled worker %s", w)
		}
	}
	p.Release(stalled, End{Worker: Succeeded})
	if !p.workers[0].serving(p.now().UnixNano()) {
		t.Fatal("worker still suspect after its stalled job ended")
	}
}

// ejectingPool is poolOf for tests that eject workers: an ejection sets a
// timer on the real clock, which reads the fake one when it fires; stopping
// the pool with the test keeps it from firing later, unsynchronised with
// the test's last advance of the clock.
// placeable reports whether a new job would get a worker at once.
func placeable(p *Pool, cfg *Config) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	w, _ := p.chooseLocked(&Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 1}})
	return w != nil
}

func ejectingPool(t *testing.T, n int) (*Pool, *fakeClock) {
	t.Helper()
	p, clock := poolOf(t, n)
	t.Cleanup(func() { _ = p.Close() })
	return p, clock
}

// ejectingConfig is a config of strategy s that ejects workers as
// testHealth does, at most maxEjectionPercent of them at once.
func ejectingConfig(s Strategy, maxEjectionPercent int) *Config {
	cfg, hc := config(s, 0), *testHealth
	hc.MaxEjectionPercent = maxEjectionPercent
	cfg.Health = &hc
	return cfg
}

// serveAll runs n jobs on p's one worker, each ending with o.
func serveAll(t *testing.T, p *Pool, cfg *Config, o Evidence, n int) {
	t.Helper()
	for range n {
		tk, _ := choose(t, p, cfg, 1)
		p.Release(tk, End{Worker: o})
	}
}

// ejectedFor is how long p's first worker is still ejected for.
func ejectedFor(p *Pool) time.Duration {
	return time.Duration(p.workers[0].health.ejectedUntil - p.now().UnixNano())
}

// Each ejection of a worker lasts twice the one before, up to
// max_eject_time, until ten successes in a row wipe out its past
// ejections, as Envoy's outlier detection multiplies its base ejection
// time by the ejections.
func TestFailedRequestsEjectWithDoubling(t *testing.T) {
	p, clock := ejectingPool(t, 1)
	cfg := ejectingConfig(LeastRequest{}, 100)
	serveAll(t, p, cfg, Failed, 3)
	if d := ejectedFor(p); d != 10*time.Second {
		t.Fatalf("first ejection for %v; want 10s", d)
	}
	for _, want := range []time.Duration{20 * time.Second, 35 * time.Second, 35 * time.Second} {
		clock.advance(ejectedFor(p))
		serveAll(t, p, cfg, Failed, 1) // back on probation: out again at its first failure
		if d := ejectedFor(p); d != want {
			t.Fatalf("repeat ejection for %v; want %v", d, want)
		}
	}
	// Nine successes, a failure, nine more: no ten in a row, and the
	// worker is still the one ejected four times.
	clock.advance(ejectedFor(p))
	serveAll(t, p, cfg, Succeeded, 9)
	serveAll(t, p, cfg, Failed, 1)
	serveAll(t, p, cfg, Succeeded, 9)
	serveAll(t, p, cfg, Failed, 2)
	if d := ejectedFor(p); d != 35*time.Second {
		t.Fatalf("ejection after successes never ten in a row for %v; want max_eject_time, 35s", d)
	}
	clock.advance(ejectedFor(p))
	serveAll(t, p, cfg, Succeeded, 10)
	serveAll(t, p, cfg, Failed, 3)
	if d := ejectedFor(p); d != 10*time.Second {
		t.Fatalf("ejection after ten successes in a row for %v; want 10s again", d)
	}
	// Failures spread wider than the window do not add up.
	clock.advance(ejectedFor(p))
	serveAll(t, p, cfg, Succeeded, 1) // the probation ends
	for range 3 {
		serveAll(t, p, cfg, Failed, 1)
		clock.advance(20 * time.Second)
	}
	if ejectedFor(p) > 0 {
		t.Fatal("failures 20 s apart ejected the worker; the window is 30 s")
	}
}

// A passed probe does not end an ejection while other workers serve: it
// says the worker's HTTP server answers, not that its answers are whole.
// Back when its ejection ends, the worker is on probation: one job at a
// time, and out again at its first failure, until a job succeeds.
func TestEjectionOutlastsPassedProbesIntoProbation(t *testing.T) {
	p, clock := ejectingPool(t, 2)
	cfg := ejectingConfig(LeastRequest{}, 100)
	other := p.workers[1]
	other.health.down = true // the failures all go to the first
	serveAll(t, p, cfg, Failed, 3)
	w := p.Snapshot()[0]
	if w.State != Ejected || w.EjectedTill.IsZero() {
		t.Fatalf("after 3 failures the worker is %v until %v; want ejected", w.State, w.EjectedTill)
	}
	other.health.down = false
	for i := range 3 {
		clock.advance(3 * time.Second)
		p.RecordProbe(w.URL, nil, testHealth)
		if w := p.Snapshot()[0]; w.State != Ejected {
			t.Fatalf("%d s into a 10 s ejection, after a passed probe, the worker is %v; want still ejected", 3*(i+1), w.State)
		}
	}
	other.health.down = true // the probation below is the first worker's alone
	clock.advance(ejectedFor(p))
	if w := p.Snapshot()[0]; w.State != Serving || !w.Probation {
		t.Fatalf("after its ejection the worker is %v, probation %v; want serving on probation", w.State, w.Probation)
	}
	first, _ := choose(t, p, cfg, 1)
	if placeable(p, cfg) {
		t.Fatal("a worker on probation would take a second job beside its first")
	}
	p.Release(first, End{Worker: Failed})
	if w := p.Snapshot()[0]; w.State != Ejected {
		t.Fatalf("a worker on probation that failed its job is %v; want ejected again", w.State)
	}
	clock.advance(ejectedFor(p))
	serveAll(t, p, cfg, Succeeded, 1)
	if w := p.Snapshot()[0]; w.Probation {
		t.Fatal("a job that succeeded did not end the probation")
	}
	for range 2 {
		choose(t, p, cfg, 1)
	}
}

// ejectFirst ejects p's first worker, beside a second that serves, by
// failures ending with each of outcomes in turn, and fails t unless it is
// then ejected for want.
func ejectFirst(t *testing.T, p *Pool, cfg *Config, want time.Duration, outcomes ...Evidence) {
	t.Helper()
	other := p.workers[1]
	other.health.down = true // the failures all go to the first
	for _, o := range outcomes {
		serveAll(t, p, cfg, o, 1)
	}
	other.health.down = false
	if w := p.Snapshot()[0]; w.State != Ejected || ejectedFor(p) != want {
		t.Fatalf("after failures %v the worker is %v for %v; want ejected for %v", outcomes, w.State, ejectedFor(p), want)
	}
}

// passProbes records n passed probes of p's first worker, a second apart,
// and fails t unless the last ended its ejection into probation (back) or
// the worker is still ejected (!back).
func passProbes(t *testing.T, p *Pool, clock *fakeClock, n int, back bool) {
	t.Helper()
	change := Unchanged
	for range n {
		clock.advance(time.Second)
		change = p.RecordProbe("http://a:1", nil, testHealth)
	}
	w := p.Snapshot()[0]
	if back && (change != BackUp || w.State != Serving || !w.Probation) || !back && w.State != Ejected {
		t.Fatalf("after %d passed probes the worker is %v, probation %v (the last changed %v); want it back on probation: %v",
			n, w.State, w.Probation, change, back)
	}
}

// A worker ejected for connections it did not answer (refused, or closed
// before any byte of an answer) was down: health_passes passed probes
// end its ejection, into probation, as they bring an unhealthy worker
// back, however long its ejection was to last; a failed probe between
// them starts the count again. Its doubling is kept.
func TestEjectionOfAWorkerThatWasDownEndsOnPassedProbes(t *testing.T) {
	p, clock := ejectingPool(t, 2)
	cfg := ejectingConfig(LeastRequest{}, 100)
	// An answer it broke longer ago than fail_window is not among the
	// failures that eject it.
	serveAll(t, p, cfg, Failed, 1)
	clock.advance(testHealth.FailWindow + time.Second)
	ejectFirst(t, p, cfg, 10*time.Second, Unreachable, Unreachable, Unreachable)
	passProbes(t, p, clock, 1, false)
	p.RecordProbe("http://a:1", errProbe, testHealth)
	passProbes(t, p, clock, 1, false)
	passProbes(t, p, clock, 1, true)
	// On probation, out again at its first failure, for twice as long;
	// down again, it is back again on its passes.
	ejectFirst(t, p, cfg, 20*time.Second, Unreachable)
	passProbes(t, p, clock, 2, true)
}

// An ejection with an answer among its failures (a 5xx, an answer cut
// short or stalled, a job a copy overtook) holds against passed probes
// while other workers serve, whatever else failed: the worker answers
// /health and breaks its answers. Its doubling is kept, for an ejection
// of connections only that follows, too.
func TestEjectionWithABadAnswerHoldsAgainstPassedProbes(t *testing.T) {
	p, clock := ejectingPool(t, 2)
	cfg := ejectingConfig(LeastRequest{}, 100)
	ejectFirst(t, p, cfg, 10*time.Second, Unreachable, Failed, Unreachable)
	passProbes(t, p, clock, 9, false)
	clock.advance(ejectedFor(p))
	ejectFirst(t, p, cfg, 20*time.Second, Overtaken) // on probation: out again at its first failure
	passProbes(t, p, clock, 19, false)
	clock.advance(ejectedFor(p))
	ejectFirst(t, p, cfg, 35*time.Second, Unreachable) // max_eject_time
	passProbes(t, p, clock, 2, true)
}

// With no other worker serving, a passed probe ends an ejection into
// probation, as Envoy's panic threshold sends traffic to ejected hosts
// when too few are healthy: one job at a time on a worker that may be
// broken beats a queue waiting out an ejection that has grown to minutes.
func TestPassedProbeEndsTheEjectionOfTheLastWorker(t *testing.T) {
	p, _ := ejectingPool(t, 1)
	cfg := ejectingConfig(LeastRequest{}, 100)
	serveAll(t, p, cfg, Failed, 3)
	w := p.Snapshot()[0]
	if change := p.RecordProbe(w.URL, nil, testHealth); change != EjectionEnded {
		t.Fatalf("a passed probe of the only worker, ejected, changed %v; want its ejection ended", change)
	}
	if w := p.Snapshot()[0]; w.State != Serving || !w.Probation {
		t.Fatalf("after a passed probe the only worker is %v, probation %v; want serving on probation", w.State, w.Probation)
	}
	first, _ := choose(t, p, cfg, 1)
	if placeable(p, cfg) {
		t.Fatal("a worker on probation would take a second job beside its first")
	}
	p.Release(first, End{Worker: Failed})
	if w := p.Snapshot()[0]; w.State != Ejected || ejectedFor(p) != 20*time.Second {
		t.Fatalf("failing its job on probation, the worker is %v for %v; want ejected for 20s", w.State, ejectedFor(p))
	}
}

// An ejection runs its course only while other workers serve every kind
// of job the ejected one makes: the only video worker, beside image
// workers, has its ejection ended by a passed probe, as the last worker's
// is, while one of two video workers waits its ejection out.
func TestPassedProbeEndsTheEjectionOfTheLastWorkerOfAKind(t *testing.T) {
	for _, c := range []struct {
		other string
		want  HealthChange
	}{{"T2I", EjectionEnded}, {"T2V", Unchanged}} {
		p, _ := ejectingPool(t, 2)
		p.SetCapabilities("http://a:1", []string{"T2V"}, "video-model")
		p.SetCapabilities("http://b:1", []string{c.other}, "other-model")
		p.workers[0].health.ejectedUntil = p.now().Add(time.Minute).UnixNano()
		if change := p.RecordProbe("http://a:1", nil, testHealth); change != c.want {
			t.Errorf("a passed probe of an ejected video worker beside a %s worker changed %v; want %v", c.other, change, c.want)
		}
	}
}

// A job given to a worker on probation is told so: its worker's slot is
// to be released once its answer is known whole or broken, not as the
// answer begins, so that a second job waits for that verdict.
func TestJobOnProbationIsToldSo(t *testing.T) {
	p, clock := ejectingPool(t, 1)
	cfg := ejectingConfig(LeastRequest{}, 100)
	if tk, _ := choose(t, p, cfg, 1); tk.OnProbation() {
		t.Fatal("a job on a worker never ejected is on probation")
	} else {
		p.Release(tk, End{Worker: Failed})
	}
	serveAll(t, p, cfg, Failed, 2)
	clock.advance(ejectedFor(p))
	trial, _ := choose(t, p, cfg, 1)
	if !trial.OnProbation() {
		t.Fatal("the first job back from an ejection is not told its worker is on probation")
	}
	p.Release(trial, End{Worker: Succeeded})
	if tk, _ := choose(t, p, cfg, 1); tk.OnProbation() {
		t.Fatal("a job after a success is still told its worker is on probation")
	}
}

// A job its worker had before its ejection ends no probation by
// succeeding: its worker was released as its answer began, and the answer
// may yet break. Only a job given on probation ends it.
func TestEarlierJobEndsNoProbation(t *testing.T) {
	p, clock := ejectingPool(t, 1)
	cfg := ejectingConfig(LeastRequest{}, 100)
	earlier, _ := choose(t, p, cfg, 1)
	serveAll(t, p, cfg, Failed, 3)
	clock.advance(ejectedFor(p))
	p.Release(earlier, End{Worker: Succeeded})
	if w := p.Snapshot()[0]; !w.Probation {
		t.Fatal("a job from before the ejection ended the probation")
	}
	trial, _ := choose(t, p, cfg, 1)
	p.Release(trial, End{Worker: Failed})
	if w := p.Snapshot()[0]; w.State != Ejected || ejectedFor(p) != 20*time.Second {
		t.Fatalf("a worker on probation that failed its first job is %v for %v; want ejected for 20s", w.State, ejectedFor(p))
	}
}

// Never more than max_ejection_percent of the pool is out at once, but one
// worker always may be: jobs failing everywhere say more of the jobs than
// of the workers.
func TestEjectionsAreBoundedByMaxEjectionPercent(t *testing.T) {
	p, _ := ejectingPool(t, 4)
	cfg := ejectingConfig(&RoundRobin{}, 50)
	for range 4 * 3 { // three failures on each worker
		tk, _ := choose(t, p, cfg, 1)
		p.Release(tk, End{Worker: Failed})
	}
	ejected := 0
	for _, w := range p.Snapshot() {
		if w.State == Ejected {
			ejected++
		}
	}
	if ejected != 2 {
		t.Fatalf("%d of 4 workers ejected under max_ejection_percent 50; want 2", ejected)
	}
}

func TestOnlyWorkerFaultsCountAgainstIt(t *testing.T) {
	p, clock := ejectingPool(t, 1)
	cfg := ejectingConfig(LeastRequest{}, 100)
	good, _ := choose(t, p, cfg, 10)
	clock.advance(time.Second)
	p.Release(good, End{Worker: Succeeded})
	learned := p.Snapshot()[0].Speed
	for range 10 { // the worker refuses bad requests at once
		tk, _ := choose(t, p, cfg, 1e6)
		clock.advance(time.Millisecond)
		p.Release(tk, End{Worker: Refused})
	}
	w := p.Snapshot()[0]
	if w.State != Serving || w.Failures != 0 || w.Speed != learned {
		t.Fatalf("after 10 refused requests: %v, %d failures, speed %v (was %v); a 4xx says nothing of the worker", w.State, w.Failures, w.Speed, learned)
	}
	for range 3 {
		tk, _ := choose(t, p, cfg, 1)
		p.Release(tk, End{Worker: Failed})
	}
	if w := p.Snapshot()[0]; w.State != Ejected || w.Failures != 3 || w.Speed != learned {
		t.Fatalf("after 3 failures: %v, %d failures, speed %v; want ejected, 3, and the speed unlearned from them", w.State, w.Failures, w.Speed)
	}
}
