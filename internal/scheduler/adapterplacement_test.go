package scheduler

import (
	"context"
	"errors"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/request"
)

// fakeSwitcher is a fleet of sglang-diffusion workers as placement sees
// them: each has one adapter active, "" for the base weights, and a
// switch takes the clock forward by its switch time.
type fakeSwitcher struct {
	pool  *Pool
	clock *fakeClock
	took  time.Duration // each switch's time

	mu       sync.Mutex
	active   map[string]Adapter // by worker URL
	switches int
	broken   map[string]bool // workers whose /v1/list_loras fails
	failing  int             // switches to fail, the next ones first
	gate     chan struct{}   // when set, a switch waits for it to close
}

func (s *fakeSwitcher) Active(_ context.Context, u string) (string, string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.broken[u] {
		return "", "", errors.New("list_loras: 500")
	}
	a := s.active[u]
	return a.Name, a.Path, nil
}

func (s *fakeSwitcher) Switch(_ context.Context, u string, a *Adapter, _ bool) (int, string, error) {
	if s.gate != nil {
		<-s.gate
	}
	s.pool.mu.Lock()
	s.clock.advance(s.took)
	s.pool.mu.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.failing > 0 {
		s.failing--
		return 500, "Failed to set LoRA adapter: no such file", errors.New("/v1/set_lora answered 500")
	}
	s.switches++
	if a == nil {
		delete(s.active, u)
	} else {
		s.active[u] = *a
	}
	return 200, "ok", nil
}

// holding is the adapter worker u has active.
func (s *fakeSwitcher) holding(u string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.active[u].Name
}

// holdSwitches makes s's switches wait until the function returned is
// called, as it is at the latest when the test ends.
func holdSwitches(t *testing.T, s *fakeSwitcher) (release func()) {
	s.gate = make(chan struct{})
	release = sync.OnceFunc(func() { close(s.gate) })
	t.Cleanup(release) // before the pool closes, which waits for the switches
	return release
}

func (s *fakeSwitcher) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.switches
}

// placedPool returns a pool of n workers on base weights with adapters
// a, b, c, d declared, switches of 5 s, and the switcher.
func placedPool(t *testing.T, n int) (*Pool, *fakeSwitcher) {
	t.Helper()
	p, clock := poolOf(t, n)
	t.Cleanup(func() { _ = p.Close() })
	sw := &fakeSwitcher{pool: p, clock: clock, took: 5 * time.Second, active: map[string]Adapter{}, broken: map[string]bool{}}
	for _, u := range workerURLs(p) {
		p.SetCapabilities(u, []string{"T2I"}, "m") // the base weights' version: m
	}
	p.DeclareAdapters([]Adapter{{Name: "a", Path: "/l/a"}, {Name: "b", Path: "/l/b"}, {Name: "c", Path: "/l/c"}, {Name: "d", Path: "/l/d"}},
		placementConfig(5*time.Second))
	p.UseSwitcher(sw)
	waitFor(t, "every worker's adapter read back", func() bool { return allStates(p, "ready") })
	return p, sw
}

// placementConfig is the default placement with switches assumed to take
// switchPrior.
func placementConfig(switchPrior time.Duration) PlacementConfig {
	return PlacementConfig{SwitchPrior: switchPrior, MaxSwitches: DefaultMaxSwitches, Turn: DefaultTurn,
		SwitchTimeout: DefaultSwitchTimeout, Retry: DefaultRetry}
}

// allStates reports whether every worker's adapter is in state.
func allStates(p *Pool, state string) bool {
	for _, w := range p.Snapshot() {
		if w.AdapterState != state {
			return false
		}
	}
	return true
}

// holders counts the ready workers holding each adapter.
func holders(p *Pool) map[string]int {
	out := map[string]int{}
	for _, w := range p.Snapshot() {
		if w.AdapterState == "ready" {
			out[w.Adapter]++
		}
	}
	return out
}

// waitFor waits, within a generous bound, until cond holds.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// adapterJob starts acquiring a worker for a job of adapter name.
func adapterJob(t *testing.T, p *Pool, cfg *Config, name string) (*Ticket, chan error) {
	t.Helper()
	tk := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 1}}
	if err := p.ResolveAdapter(tk, name); err != nil {
		t.Fatal(err)
	}
	ctx := tk.WithCancel(context.Background()) // as the router's jobs are
	done := make(chan error, 1)
	go func() { done <- p.Acquire(ctx, tk) }()
	return tk, done
}

// served waits for a job's worker and returns the adapter that worker
// holds by the fake fleet's account.
func servedWith(t *testing.T, sw *fakeSwitcher, tk *Ticket, done chan error) string {
	t.Helper()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		for _, w := range sw.pool.Snapshot() {
			t.Logf("%s: %q %s inflight %d", w.URL, w.Adapter, w.AdapterState, w.Inflight)
		}
		t.Fatal("the job got no worker")
	}
	sw.mu.Lock()
	defer sw.mu.Unlock()
	return sw.active[tk.servedBy].Name
}

func TestEachJobRunsOnAWorkerHoldingItsAdapter(t *testing.T) {
	p, sw := placedPool(t, 2)
	cfg := config(LeastWork{}, 1)
	for _, name := range []string{"a", "b", "a", "b", ""} {
		tk, done := adapterJob(t, p, cfg, name)
		if got := servedWith(t, sw, tk, done); got != name {
			t.Fatalf("a job for adapter %q ran on a worker holding %q", name, got)
		}
		if name != "" && !strings.HasSuffix(tk.ServedVersion(), "+lora:"+name+"@0") {
			t.Fatalf("weight version %q; want it to name adapter %s at publish 0", tk.ServedVersion(), name)
		}
		p.Release(tk, End{Worker: Succeeded})
	}
	if sw.count() < 2 {
		t.Fatalf("%d switches; want at least one to each adapter", sw.count())
	}
}

func TestAnUndeclaredAdapterIsRefusedNamingTheDeclaredOnes(t *testing.T) {
	p, _ := placedPool(t, 1)
	err := p.ResolveAdapter(&Ticket{}, "z")
	if err == nil || err.Error() != `adapter "z" is not served here; declared adapters: a, b, c, d` {
		t.Fatalf("err = %v", err)
	}
}

func TestWorkersStayWhereTheyAreWhileDemandIsBalanced(t *testing.T) {
	p, sw := placedPool(t, 2)
	cfg := config(LeastWork{}, 1)
	for _, name := range []string{"a", "b"} {
		tk, done := adapterJob(t, p, cfg, name)
		servedWith(t, sw, tk, done)
	}
	switched := sw.count()
	// Both adapters have as much work waiting as the other: nobody moves.
	for range 5 {
		for _, name := range []string{"a", "b"} {
			adapterJob(t, p, cfg, name)
		}
	}
	waitFor(t, "the jobs to wait", func() bool { return queued(p) >= 8 })
	for range 30 {
		tick(p, sw.clock, time.Second)
	}
	if sw.count() != switched {
		t.Fatalf("%d switches while demand was balanced; want none", sw.count()-switched)
	}
	finishJobs(p)
}

// tick moves the pool's clock on by d and lets placement look again.
func tick(p *Pool, clock *fakeClock, d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	clock.advance(d)
	p.dispatchLocked()
}

// holdEach gives each adapter named a worker of its own, through one job
// each, released at once.
func holdEach(t *testing.T, p *Pool, sw *fakeSwitcher, cfg *Config, names ...string) {
	t.Helper()
	var jobs []*Ticket
	for _, name := range names {
		tk, done := adapterJob(t, p, cfg, name)
		servedWith(t, sw, tk, done)
		jobs = append(jobs, tk)
	}
	for _, tk := range jobs {
		p.Release(tk, End{Worker: Succeeded})
	}
}

func TestDemandMovingToOneAdapterMovesTheWorkersToIt(t *testing.T) {
	p, sw := placedPool(t, 4)
	cfg := config(LeastWork{}, 1)
	holdEach(t, p, sw, cfg, "a", "b", "c", "d")
	if h := holders(p); h["a"] != 1 || h["b"] != 1 || h["c"] != 1 || h["d"] != 1 {
		t.Fatalf("holders %v; want one worker on each adapter", h)
	}
	served := make(chan string, 40)
	for range 40 {
		tk, done := adapterJob(t, p, cfg, "a")
		go func() {
			if <-done == nil {
				served <- sw.holding(tk.servedBy)
			}
		}()
	}
	waitFor(t, "three workers more to hold a", func() bool { return holders(p)["a"] == 4 })
	deadline := time.After(10 * time.Second)
	for range 40 {
		select {
		case got := <-served:
			if got != "a" {
				t.Fatalf("a job of a ran on a worker holding %q", got)
			}
		case <-deadline:
			t.Fatal("jobs got no worker")
		}
		finishJobs(p)
	}
}

func TestAdaptersWithWorkOutnumberingWorkersTakeTurns(t *testing.T) {
	p, sw := placedPool(t, 1)
	cfg := config(LeastWork{}, 1)
	runningJob(t, p, sw, cfg, "a")
	adapterJob(t, p, cfg, "a")
	waitFor(t, "a's job to wait", func() bool { return queued(p) == 1 })
	bJob, bDone := adapterJob(t, p, cfg, "b")
	waitFor(t, "b's job to wait", func() bool { return queued(p) == 2 })
	for range 3 {
		adapterJob(t, p, cfg, "a") // a's jobs keep coming, after b's
	}
	waitFor(t, "a's later jobs to wait", func() bool { return queued(p) == 5 })
	finishJobs(p)
	tick(p, sw.clock, DefaultTurn/2)
	if w := p.Snapshot()[0]; w.Adapter != "a" || w.AdapterState != "ready" {
		t.Fatalf("half a turn on the worker holds %q (%s); want a to keep it", w.Adapter, w.AdapterState)
	}
	tick(p, sw.clock, DefaultTurn/2)
	finishJobs(p)
	if got := servedWith(t, sw, bJob, bDone); got != "b" {
		t.Fatalf("b's job ran on %q", got)
	}
}

// runningJob gives adapter name a holder, and that holder a job of name
// that runs until the test ends it.
func runningJob(t *testing.T, p *Pool, sw *fakeSwitcher, cfg *Config, name string) *Ticket {
	t.Helper()
	holdEach(t, p, sw, cfg, name)
	tk, done := adapterJob(t, p, cfg, name)
	servedWith(t, sw, tk, done)
	return tk
}

// finishJobs ends the jobs every worker of p runs.
func finishJobs(p *Pool) {
	p.mu.Lock()
	var jobs []*Ticket
	for _, w := range p.workers {
		jobs = append(jobs, w.load.jobs...)
	}
	p.mu.Unlock()
	for _, tk := range jobs {
		p.Release(tk, End{Worker: Succeeded})
	}
}

func TestAPublishReloadsTheHoldersAndNoJobRunsOnTheOldPath(t *testing.T) {
	p, sw := placedPool(t, 2)
	cfg := config(LeastWork{}, 1)
	running := runningJob(t, p, sw, cfg, "a")
	holdersOfA, version, err := p.Publish("a", "/l/a2", 0)
	if err != nil || len(holdersOfA) != 1 || !strings.HasSuffix(version, "+lora:a@1") {
		t.Fatalf("publish: %v %v %v", holdersOfA, version, err)
	}
	if _, _, err := p.Publish("a", "/l/a2", 0); !errors.Is(err, ErrSamePath) {
		t.Fatalf("publishing the same path again: %v", err)
	}
	next, nextDone := adapterJob(t, p, cfg, "a")
	waitFor(t, "the next job to wait", func() bool { return queued(p) == 1 })
	results := make(chan map[string]SwitchResult, 1)
	go func() { results <- p.WaitSwitched(nil, holdersOfA, "a", 10*time.Second) }()
	p.Release(running, End{Worker: Succeeded}) // the old path's last job ends; its worker reloads
	res := <-results
	if r := res[holdersOfA[0]]; !r.OK || r.Publish != 1 {
		t.Fatalf("switch result %+v", r)
	}
	servedWith(t, sw, next, nextDone)
	sw.mu.Lock()
	path := sw.active[next.servedBy].Path
	sw.mu.Unlock()
	if path != "/l/a2" || !strings.HasSuffix(next.ServedVersion(), "+lora:a@1") {
		t.Fatalf("the job after the publish ran on %s as %q", path, next.ServedVersion())
	}
}

func TestAWorkerWhoseAdapterCannotBeReadServesNothing(t *testing.T) {
	p, clock := poolOf(t, 1)
	t.Cleanup(func() { _ = p.Close() })
	sw := &fakeSwitcher{pool: p, clock: clock, took: time.Second, active: map[string]Adapter{}, broken: map[string]bool{"http://a:1": true}}
	p.DeclareAdapters([]Adapter{{Name: "a", Path: "/l/a"}}, placementConfig(time.Second))
	p.UseSwitcher(sw)
	cfg := config(LeastWork{}, 1)
	cfg.Timeout = 50 * time.Millisecond
	tk := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 1}}
	if err := p.ResolveAdapter(tk, ""); err != nil {
		t.Fatal(err)
	}
	if err := p.Acquire(context.Background(), tk); !errors.Is(err, ErrQueueTimeout) {
		t.Fatalf("acquire on a worker whose adapter is unknown: %v", err)
	}
	if s := p.Snapshot()[0].AdapterState; s != "unknown" {
		t.Fatalf("adapter state %q", s)
	}
}

func TestAFailedSwitchIsTriedAgainAndServesNothingMeanwhile(t *testing.T) {
	p, sw := placedPool(t, 1)
	sw.mu.Lock()
	sw.failing = 1
	sw.mu.Unlock()
	cfg := config(LeastWork{}, 1)
	tk, done := adapterJob(t, p, cfg, "a")
	waitFor(t, "the switch to fail", func() bool { return p.Adapters()[1].Failures == 1 })
	if w := p.Snapshot()[0]; w.AdapterState != "unknown" || w.Inflight != 0 {
		t.Fatalf("after a failed switch the worker is %s with %d jobs; want unknown and idle", w.AdapterState, w.Inflight)
	}
	for range 6 {
		tick(p, sw.clock, time.Second) // past the retry time: read back, then switched again
	}
	if got := servedWith(t, sw, tk, done); got != "a" {
		t.Fatalf("the job ran on %q", got)
	}
}

func TestASwitchIsChargedToTheTenantWhoseJobAskedForIt(t *testing.T) {
	p, sw := placedPool(t, 1)
	cfg := config(LeastWork{}, 1)
	tk := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 1, Tenant: "trainer"}}
	if err := p.ResolveAdapter(tk, "a"); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- p.Acquire(context.Background(), tk) }()
	servedWith(t, sw, tk, done)
	// The job's cost, 1, and the switch's 5 s at the assumed speed of 1
	// unit a second.
	i := slices.IndexFunc(p.Tenants(), func(tn TenantStats) bool { return tn.Name == "trainer" })
	if i < 0 || p.Tenants()[i].Service != 6 {
		t.Fatalf("tenants %+v; want trainer charged its job and its switch, 6", p.Tenants())
	}
}

func TestTheBacklogCountsASwitchUnderWay(t *testing.T) {
	p, sw := placedPool(t, 1)
	release := holdSwitches(t, sw)
	cfg := config(LeastWork{}, 1)
	tk, done := adapterJob(t, p, cfg, "a")
	waitFor(t, "the switch to begin", func() bool { return strings.HasPrefix(p.Snapshot()[0].AdapterState, "switching") })
	// The switch (5 s assumed) and then the job (1 s at 1 unit a second).
	if b := p.Backlog(); b != 6*time.Second {
		t.Fatalf("backlog %v while the only worker switches for the only job; want 6s", b)
	}
	release()
	servedWith(t, sw, tk, done)
}

func TestAHedgedCopyGoesOnlyToAWorkerHoldingItsAdapter(t *testing.T) {
	p, sw := placedPool(t, 2)
	cfg := config(LeastWork{}, 1)
	holdEach(t, p, sw, cfg, "a", "b")
	tk, done := adapterJob(t, p, cfg, "a")
	servedWith(t, sw, tk, done)
	if c := p.HedgeCopy(tk); c != nil {
		t.Fatalf("a copy of a job of a went to %s, which holds b", c.servedBy)
	}
}

func TestAWorkerServesNothingWhileACallToItRuns(t *testing.T) {
	p, sw := placedPool(t, 1)
	release := holdSwitches(t, sw)
	cfg := config(LeastWork{}, 1)
	adapterJob(t, p, cfg, "a")
	waitFor(t, "the switch to a to begin", func() bool { return strings.HasPrefix(p.Snapshot()[0].AdapterState, "switching") })
	// A reload drops a while set_lora(a) runs: the worker may have a merged.
	p.UndeclareAdapters([]Adapter{{Name: "a", Path: "/l/a"}})
	base, baseDone := adapterJob(t, p, cfg, "")
	waitFor(t, "the base job to wait", func() bool { return queued(p) == 1 })
	release()
	if got := servedWith(t, sw, base, baseDone); got != "" {
		t.Fatalf("the base job ran on adapter %q", got)
	}
}

func TestWaitingJobsOfAnAdapterNoLongerDeclaredEnd(t *testing.T) {
	p, sw := placedPool(t, 1)
	cfg := config(LeastWork{}, 1)
	runningJob(t, p, sw, cfg, "b")
	tk := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 1}}
	if err := p.ResolveAdapter(tk, "a"); err != nil {
		t.Fatal(err)
	}
	ctx := tk.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Acquire(ctx, tk) }()
	waitFor(t, "a's job to wait", func() bool { return queued(p) == 1 })
	p.UndeclareAdapters([]Adapter{{Name: "a", Path: "/l/a"}})
	<-done
	if _, ok := errors.AsType[*UnknownAdapterError](tk.Cancelled()); !ok {
		t.Fatalf("the job ended with %v; want it told its adapter is not served", tk.Cancelled())
	}
	finishJobs(p)
}

func TestEveryNeedyAdapterIsConsideredNotOnlyTheNeediest(t *testing.T) {
	p, sw := placedPool(t, 3)
	cfg := config(LeastWork{}, 1)
	holdEach(t, p, sw, cfg, "a", "b")
	// a's holder, the one worker that makes videos, runs a long job, and a
	// video of a waits: no worker may switch to a, the neediest, while b,
	// with ten jobs waiting, may take the idle one.
	long := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 60}}
	_ = p.ResolveAdapter(long, "a")
	if err := p.Acquire(context.Background(), long); err != nil {
		t.Fatal(err)
	}
	p.SetCapabilities(long.servedBy, []string{"T2V", "T2I"}, "m")
	video := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 1, Task: request.VideoTask}}
	_ = p.ResolveAdapter(video, "a")
	go func() { _ = p.Acquire(context.Background(), video) }()
	waitFor(t, "the video to wait", func() bool { return queued(p) == 1 })
	runningJob(t, p, sw, cfg, "b")
	for range 10 {
		adapterJob(t, p, cfg, "b")
	}
	waitFor(t, "a second worker to hold b", func() bool { return holders(p)["b"] == 2 })
	finishJobs(p)
}

func TestAJobBehindALongOneGetsAnotherWorker(t *testing.T) {
	p, sw := placedPool(t, 2)
	cfg := config(LeastWork{}, 1)
	holdEach(t, p, sw, cfg, "a")
	long := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 600}}
	_ = p.ResolveAdapter(long, "a")
	if err := p.Acquire(context.Background(), long); err != nil {
		t.Fatal(err)
	}
	tk, done := adapterJob(t, p, cfg, "a")
	if got := servedWith(t, sw, tk, done); got != "a" || tk.servedBy == long.servedBy {
		t.Fatalf("the job ran on %s holding %q; want the other worker, switched to a", tk.servedBy, got)
	}
	finishJobs(p)
}

func TestAPublishDoesNotWaitForAHolderThatIsDown(t *testing.T) {
	p, sw := placedPool(t, 2)
	cfg := config(LeastWork{}, 1)
	holdEach(t, p, sw, cfg, "a")
	p.mu.Lock()
	for _, w := range p.workers {
		w.health.down = w.adapter.holds.Name == "a"
	}
	p.mu.Unlock()
	holdersOfA, _, err := p.Publish("a", "/l/a2", 0)
	if err != nil || len(holdersOfA) != 0 {
		t.Fatalf("publish waits for %v (%v); want none: a's only holder is down", holdersOfA, err)
	}
}

func TestJobsArrivingOneByOneGiveEachAdapterAWorker(t *testing.T) {
	p, sw := placedPool(t, 4)
	release := holdSwitches(t, sw)
	cfg := config(LeastWork{}, 1)
	names := []string{"a", "b", "c", "d"}
	rng := rand.New(rand.NewPCG(1, 0))
	for i := range 40 {
		adapterJob(t, p, cfg, names[rng.IntN(4)])
		waitFor(t, "the job to wait", func() bool { return queued(p) == i+1 })
	}
	targets := map[string]int{}
	for _, w := range p.Snapshot() {
		targets[w.AdapterState]++
	}
	release()
	if len(targets) != 4 {
		t.Fatalf("switches %v; want one worker to each adapter", targets)
	}
	finishJobs(p)
}

// On a fleet of 128 workers placement looks again after every fourth job
// that ends, and at once when the queue gains a class of jobs, when a job
// waits of a higher priority than its adapter's others, and when a worker
// switching its adapter has ended its jobs.
func TestOnALargeFleetPlacementLooksAgainAfterEveryFewJobs(t *testing.T) {
	c := clusterOf(t, 128, 300, true)
	p := c.p
	adapters := []Adapter{{Name: "fresh", Path: "/l/fresh"}}
	p.DeclareAdapters(adapters, placementConfig(30*time.Second))
	p.mu.Lock()
	p.clock.(*fakeClock).advance(time.Minute) // every worker has served as long as a switch takes
	p.mu.Unlock()

	fresh := p.NewTicket(c.cfg)
	fresh.Job, fresh.Task, fresh.Cost = true, request.ImageTask, 10
	if err := p.ResolveAdapter(fresh, "fresh"); err != nil {
		t.Fatal(err)
	}
	c.admit(t, fresh)
	switching := switchingTo(p, "fresh")
	if switching == nil {
		t.Fatal("the first job of an adapter no worker holds sent no worker to it")
	}

	var jobs []*Ticket // jobs running on workers that keep their adapter
	for _, tk := range c.running {
		if tk.worker != switching {
			jobs = append(jobs, tk)
		}
	}
	for i, tk := range jobs[:8] {
		p.Release(tk, End{Worker: Succeeded})
		p.mu.Lock()
		moved := p.placement.moved
		p.mu.Unlock()
		if want := (i + 1) % 4; moved != want {
			t.Fatalf("after %d jobs ended, %d since placement looked; want %d", i+1, moved, want)
		}
	}
	p.Release(jobs[8], End{Worker: Succeeded})
	for _, adapter := range []int{0, 1} { // the second finds jobs of priority 1 waiting already
		urgent := c.job(t, adapter)
		urgent.Priority = 1
		c.admit(t, urgent)
		p.mu.Lock()
		moved, waiting := p.placement.moved, urgent.waiter != nil
		p.mu.Unlock()
		if !waiting || moved != 0 {
			t.Fatalf("a waiting job of lora-%d of a higher priority than the others: waits %v, %d jobs since placement looked; want 0", adapter, waiting, moved)
		}
	}
	for _, tk := range c.running {
		if tk.worker == switching {
			p.Release(tk, End{Worker: Succeeded})
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if !switching.adapter.calling {
		t.Fatal("a worker switching its adapter ended its jobs, and its switch did not start")
	}
}

// switchingTo is the worker switching to the adapter named, or nil.
func switchingTo(p *Pool, name string) *worker {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, w := range p.workers {
		if w.adapter.switching && w.adapter.target.Name == name {
			return w
		}
	}
	return nil
}

// A worker switching its adapter takes no job, but a dispatch pass that
// finds it with a slot free goes on past a head job no worker can take:
// a job of a route of max_inflight 2 gets the second slot of the worker
// holding its adapter, while the head, of a route of max_inflight 1,
// waits.
func TestAJobPassesAHeadOfAnotherLimitWhileAWorkerSwitches(t *testing.T) {
	p := benchPool(nil, 2)
	defer p.Close()
	p.DeclareAdapters([]Adapter{{Name: "x", Path: "/l/x"}, {Name: "y", Path: "/l/y"}, {Name: "z", Path: "/l/z"}}, placementConfig(5*time.Second))
	one := &Config{Strategy: LeastWork{}, MaxInflight: 1, MaxQueue: 100, Order: FIFO{}}
	two := &Config{Strategy: LeastWork{}, MaxInflight: 2, MaxQueue: 100, Order: FIFO{}}
	job := func(cfg *Config, name string) *Ticket {
		tk := p.NewTicket(cfg)
		tk.Job, tk.Task, tk.Cost = true, request.ImageTask, 1
		if err := p.ResolveAdapter(tk, name); err != nil {
			t.Fatal(err)
		}
		return tk
	}
	p.mu.Lock()
	now := p.now().UnixNano()
	pl := &p.placement
	y, z := pl.policies["y"], pl.policies["z"]
	switching, holder := p.workers[0], p.workers[1]
	switching.adapter = workerAdapter{known: true, holds: &pl.base, since: now, switching: true, target: z}
	holder.adapter = workerAdapter{known: true, holds: y, publish: y.publish, since: now}
	p.mu.Unlock()
	running := job(two, "y")
	if err := p.Admit(running, func() {}); err != nil || running.worker != holder {
		t.Fatalf("the first job of y: %v, on %v; want the worker holding y", err, running.worker)
	}
	if err := p.Admit(job(one, "x"), func() {}); err != nil {
		t.Fatal(err)
	}
	got := false
	if err := p.Admit(job(two, "y"), func() { got = true }); err != nil {
		t.Fatal(err)
	}
	if !got {
		t.Fatal("a job of y of max_inflight 2 waits while the worker holding y has a slot of 2 free")
	}
}
