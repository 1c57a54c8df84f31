package scheduler

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/request"
)

// tenantJob is a job of the tenant simulation.
type tenantJob struct {
	tenant string
	cost   float64
	prio   int
}

// sim runs jobs on p's workers without goroutines: each job is admitted
// as a waiting client would be, and a running job ends when the clock
// reaches its predicted end (speed 1: cost seconds).
type sim struct {
	t       *testing.T
	p       *Pool
	clock   *fakeClock
	cfg     *Config
	running []*Ticket
	order   []*Ticket // jobs in the order they got a worker
	waiting map[*Ticket]bool
}

func newSim(t *testing.T, workers int, cfg *Config) *sim {
	p, clock := poolOf(t, workers)
	return &sim{t: t, p: p, clock: clock, cfg: cfg, waiting: map[*Ticket]bool{}}
}

// submit admits a job; it reports the error a client would get.
func (s *sim) submit(j tenantJob) (*Ticket, error) {
	tk := &Ticket{pool: s.p, cfg: s.cfg, Request: Request{Job: true, Cost: j.cost, Priority: j.prio, Tenant: j.tenant}}
	s.p.mu.Lock()
	_, err := s.p.admitLocked(tk)
	s.p.mu.Unlock()
	if err != nil {
		return tk, err
	}
	s.waiting[tk] = true
	s.collect()
	return tk, nil
}

// collect notes the jobs that got a worker since it last looked, in the
// order they did (dispatch order among jobs given workers at once is
// their seq's, which is enough here: one worker frees at a time).
func (s *sim) collect() {
	s.p.mu.Lock()
	defer s.p.mu.Unlock()
	for {
		var next *Ticket
		for tk := range s.waiting {
			if tk.worker != nil && (next == nil || tk.started < next.started || (tk.started == next.started && tk.seq < next.seq)) {
				next = tk
			}
		}
		if next == nil {
			return
		}
		delete(s.waiting, next)
		s.running = append(s.running, next)
		s.order = append(s.order, next)
	}
}

// firstToEnd is the running job that ends first; a job prefetched onto a
// busy worker has not started.
func (s *sim) firstToEnd() (int, time.Time) {
	first, end := -1, time.Time{}
	for i, tk := range s.running {
		e := time.Unix(0, tk.started+int64(tk.predicted))
		if tk.started != 0 && (first < 0 || e.Before(end)) {
			first, end = i, e
		}
	}
	return first, end
}

// step ends the running job that ends first, at its end.
func (s *sim) step() *Ticket {
	s.t.Helper()
	first, end := s.firstToEnd()
	if first < 0 {
		s.t.Fatal("nothing runs")
	}
	tk := s.running[first]
	s.running = append(s.running[:first], s.running[first+1:]...)
	s.clock.t = end
	s.p.Release(tk, End{Worker: Succeeded})
	s.collect()
	return tk
}

// workDone runs the pool until until seconds of the clock have passed and
// returns the cost each tenant's finished jobs add up to.
func (s *sim) workDone(until time.Duration) map[string]float64 {
	s.t.Helper()
	end := s.clock.t.Add(until)
	done := map[string]float64{}
	for {
		first, e := s.firstToEnd()
		if first < 0 || e.After(end) {
			break
		}
		tk := s.step()
		done[tk.Tenant] += tk.Cost
	}
	return done
}

func (s *sim) submitAll(tenant string, n int, cost float64) {
	s.t.Helper()
	for range n {
		if _, err := s.submit(tenantJob{tenant: tenant, cost: cost}); err != nil {
			s.t.Fatal(err)
		}
	}
}

func within(got, want, tolerance float64) bool { return math.Abs(got-want) <= tolerance*want }

func TestTenantsShareWorkByCostNotRequests(t *testing.T) {
	s := newSim(t, 1, config(LeastWork{}, 1))
	s.submitAll("many-small", 400, 1)
	s.submitAll("few-large", 40, 10)
	done := s.workDone(300 * time.Second)
	small, large := done["many-small"], done["few-large"]
	t.Logf("in 300 s: many-small %.0f units (%d jobs), few-large %.0f units", small, int(small), large)
	if !within(small/(small+large), 0.5, 0.05) {
		t.Fatalf("many-small got %.0f units, few-large %.0f: want equal shares of the work within 5%%", small, large)
	}
}

func TestTenantWeightsSetTheShares(t *testing.T) {
	cfg := config(LeastWork{}, 1)
	cfg.TenantWeights = map[string]float64{"trainer": 2}
	s := newSim(t, 2, cfg)
	s.submitAll("trainer", 300, 2)
	s.submitAll("eval", 300, 3)
	done := s.workDone(300 * time.Second)
	share := done["trainer"] / (done["trainer"] + done["eval"])
	t.Logf("weights 2:1 on 2 workers in 300 s: trainer %.0f units, eval %.0f (trainer's share %.3f)", done["trainer"], done["eval"], share)
	if !within(share, 2.0/3, 0.05) {
		t.Fatalf("trainer's share of the work %.3f; want 2/3 by its weight", share)
	}
}

func TestAnIdleTenantBanksNoCredit(t *testing.T) {
	s := newSim(t, 1, config(LeastWork{}, 1))
	s.submitAll("a", 400, 1)
	done := s.workDone(200 * time.Second)
	if done["a"] < 199 {
		t.Fatalf("alone, a got %.0f units in 200 s; want the whole worker (work-conserving)", done["a"])
	}
	s.submitAll("b", 200, 1)
	done = s.workDone(100 * time.Second)
	t.Logf("in the 100 s after b came: a %.0f units, b %.0f", done["a"], done["b"])
	if !within(done["b"], 50, 0.05) {
		t.Fatalf("after b came, b got %.0f of 100 units; want half: b's idle time banks no credit", done["b"])
	}
}

func TestAnIdleTenantsShareGoesToTheOthers(t *testing.T) {
	s := newSim(t, 1, config(LeastWork{}, 1))
	s.submitAll("a", 300, 1)
	s.submitAll("b", 300, 1)
	s.submitAll("c", 10, 1)
	done := s.workDone(210 * time.Second)
	t.Logf("a %.0f, b %.0f, c %.0f units in 210 s", done["a"], done["b"], done["c"])
	if done["c"] != 10 || done["a"]+done["b"]+done["c"] < 209 || !within(done["a"], done["b"], 0.05) {
		t.Fatalf("a %.0f, b %.0f, c %.0f units; want c's 10 done, the worker never idle, a and b even", done["a"], done["b"], done["c"])
	}
}

func TestPriorityGoesBeforeTenantShares(t *testing.T) {
	s := newSim(t, 1, config(LeastWork{}, 1))
	first, _ := s.submit(tenantJob{tenant: "a", cost: 1})
	s.submitAll("a", 5, 1)
	s.submitAll("b", 5, 1)
	urgent, _ := s.submit(tenantJob{tenant: "a", cost: 1, prio: 1})
	s.step()
	if s.order[0] != first || s.order[1] != urgent {
		t.Fatalf("after the first job, tenant %s's priority %d job ran; want a's urgent job, though a was served more", s.order[1].Tenant, s.order[1].Priority)
	}
	s.step()
	if s.order[2].Tenant != "b" {
		t.Fatalf("then tenant %s ran; want b, served least", s.order[2].Tenant)
	}
}

func TestQueueOrderWithinATenant(t *testing.T) {
	cfg := config(LeastWork{}, 1)
	cfg.Order = LargestFirst{}
	s := newSim(t, 1, cfg)
	s.submitAll("a", 1, 1)
	for _, c := range []float64{1, 3, 2} {
		s.submitAll("a", 1, c)
		s.submitAll("b", 1, c)
	}
	for range 6 {
		s.step()
	}
	var got []string
	for _, tk := range s.order[1:] {
		got = append(got, fmt.Sprintf("%s%.0f", tk.Tenant, tk.Cost))
	}
	// b came while a ran its first job, so b's counter was lifted to a's:
	// even, the tenant whose next job came first goes, then the least
	// served; each tenant's largest job first.
	want := fmt.Sprint([]string{"a3", "b3", "a2", "b2", "a1", "b1"})
	if fmt.Sprint(got) != want {
		t.Fatalf("ran %v; want %v", got, want)
	}
}

func TestTenantMaxQueueRefusesOnlyThatTenant(t *testing.T) {
	cfg := config(LeastWork{}, 1)
	cfg.TenantMaxQueue = 2
	s := newSim(t, 1, cfg)
	s.submitAll("a", 3, 1) // one runs, two wait
	tk, err := s.submit(tenantJob{tenant: "a", cost: 1})
	if !errors.Is(err, ErrTenantQueueFull) || tk.TenantOf() != "a" {
		t.Fatalf("a's third waiting job: %v, tenant %q; want ErrTenantQueueFull naming a", err, tk.TenantOf())
	}
	if _, err := s.submit(tenantJob{tenant: "b", cost: 1}); err != nil {
		t.Fatalf("b's job: %v; want it to wait: a's limit is a's", err)
	}
}

func TestTenantsBeyondTheBoundShareOther(t *testing.T) {
	cfg := config(LeastWork{}, 1)
	cfg.MaxTenants = 2
	s := newSim(t, 1, cfg)
	s.submitAll("a", 2, 1)
	s.submitAll("b", 1, 1)
	c, _ := s.submit(tenantJob{tenant: "c", cost: 1})
	none, _ := s.submit(tenantJob{cost: 1})
	if c.TenantOf() != OtherTenant || none.TenantOf() != OtherTenant {
		t.Fatalf("with a and b tracked and active, c counts for %q and a job naming none for %q; want both %q", c.TenantOf(), none.TenantOf(), OtherTenant)
	}
	for len(s.running) > 0 {
		s.step()
	}
	d, _ := s.submit(tenantJob{tenant: "d", cost: 1})
	if d.TenantOf() != "d" {
		t.Fatalf("with a and b idle, d counts for %q; want d, in an idle tenant's place", d.TenantOf())
	}
	var names []string
	for _, ts := range s.p.Tenants() {
		names = append(names, ts.Name)
	}
	if len(names) != 3 {
		t.Fatalf("tracked %v; want other and two tenants", names)
	}
}

func TestARerunKeepsItsPlaceAndIsChargedOnce(t *testing.T) {
	s := newSim(t, 1, config(LeastWork{}, 1))
	a, _ := s.submit(tenantJob{tenant: "a", cost: 5})
	b, _ := s.submit(tenantJob{tenant: "b", cost: 5})
	if err := s.p.Retry(context.Background(), a, End{Worker: Failed, Rerun: RerunStatus}); err != nil {
		t.Fatal(err)
	}
	if a.worker == nil || b.worker != nil {
		t.Fatal("b got the worker a's job failed on; want a's re-run, in its place: b came when a had been served as much")
	}
	for _, ts := range s.p.Tenants() {
		if ts.Name == "a" && ts.Cost != 5 {
			t.Fatalf("a was charged %.0f; want 5, once: the re-run is not charged again", ts.Cost)
		}
	}
}

func TestTenantBacklogPlaysTheQueueOutByShares(t *testing.T) {
	s := newSim(t, 1, config(LeastWork{}, 1))
	s.submitAll("a", 3, 10)
	s.submitAll("b", 1, 10)
	s.submitAll("c", 1, 1)
	s.clock.advance(4 * time.Second)
	// a runs (6 s left) and has been served 10; b and c came then, lifted
	// to 10. Even, the earlier head goes: a's 2nd (a 20), then b (20),
	// then c (11), then a's 3rd. Ends 6, 16, 26, 27, 37.
	got := map[string]float64{}
	for _, ts := range s.p.Tenants() {
		got[ts.Name] = ts.Backlog
	}
	want := map[string]float64{OtherTenant: 0, "a": 37, "b": 26, "c": 27}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("tenant backlogs %v; want %v", got, want)
	}
	if b := s.p.Backlog(); b != 37*time.Second {
		t.Fatalf("backlog %s; want 37s", b)
	}
}

func TestAJobPassedOverForTooLongGoesNextWithTenants(t *testing.T) {
	cfg := config(LeastWork{}, 1)
	cfg.MaxPassedOver = 10 * time.Second
	s := newSim(t, 1, cfg)
	s.submit(tenantJob{tenant: "b", cost: 5})
	low, _ := s.submit(tenantJob{tenant: "a", cost: 5})
	s.submit(tenantJob{tenant: "b", cost: 5, prio: 1})
	s.step() // at 5 s b's urgent job goes: a's has waited 5 s
	s.submit(tenantJob{tenant: "b", cost: 5, prio: 1})
	s.step() // at 10 s
	if s.order[2] != low {
		t.Fatalf("at 10 s tenant %s's priority %d job went; want a's, passed over for 10 s", s.order[2].Tenant, s.order[2].Priority)
	}
}

func TestAJobNoFreeWorkerMayServeLetsOtherTenantsPass(t *testing.T) {
	p, _ := poolOf(t, 2)
	p.SetCapabilities("http://a:1", []string{"T2I"}, "")
	p.SetCapabilities("http://b:1", []string{"T2V"}, "")
	cfg := config(LeastWork{}, 1)
	admit := func(tenant string, task request.Task, cost float64) *Ticket {
		tk := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: cost, Task: task, Tenant: tenant}}
		p.mu.Lock()
		defer p.mu.Unlock()
		if _, err := p.admitLocked(tk); err != nil {
			t.Fatal(err)
		}
		return tk
	}
	image := admit("busy", request.ImageTask, 10)
	admit("busy", request.VideoTask, 10)
	video := admit("videos", request.VideoTask, 1) // lifted to busy's 20, as is images: even, its earlier job is tried first
	img := admit("images", request.ImageTask, 1)
	p.Release(image, End{Worker: Succeeded})
	if video.worker != nil || img.worker == nil || img.worker.dial != "a:1" {
		t.Fatal("the image worker that freed did not go to the images tenant's job; want it to pass the video job no free worker may serve")
	}
}

// An aborted job leaves its tenant's queue too: the worker that frees up
// goes to the next job, and the tenant shows nothing waiting.
func TestAnAbortedJobLeavesItsTenantsQueue(t *testing.T) {
	p, _ := poolOf(t, 1)
	cfg := config(LeastWork{}, 1)
	running, runCtx := tracked(t, p, cfg, "run", 1)
	running.Tenant = "a"
	if err := p.Acquire(runCtx, running); err != nil {
		t.Fatal(err)
	}
	ab, abCtx := tracked(t, p, cfg, "step-1", 1)
	ab.Tenant = "a"
	abDone := make(chan error, 1)
	go func() { abDone <- p.Acquire(abCtx, ab) }()
	waitQueued(t, p, 1)
	next, nextDone := enqueueTenant(t, p, cfg, "b")
	if got := p.Abort(Abort{RID: "step-1", By: "test"}); got.Waiting != 1 {
		t.Fatalf("abort counted %+v; want 1 waiting", got)
	}
	if err := <-abDone; abortedBy(err) == nil {
		t.Fatalf("the aborted job got %v; want the abort", err)
	}
	for _, ts := range p.Tenants() {
		if ts.Name == "a" && ts.Waiting != 0 {
			t.Fatalf("tenant a shows %d waiting after the abort; want 0", ts.Waiting)
		}
	}
	p.Release(running, End{Worker: Succeeded})
	if err := <-nextDone; err != nil || next.worker == nil {
		t.Fatalf("b's job: %v; want the worker that freed up", err)
	}
}

// enqueueTenant queues a job of tenant behind p's busy workers; its
// Acquire's error arrives on the channel.
func enqueueTenant(t *testing.T, p *Pool, cfg *Config, tenant string) (*Ticket, chan error) {
	t.Helper()
	tk := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 1, Tenant: tenant}}
	done := make(chan error, 1)
	n := queued(p)
	go func() { done <- p.Acquire(context.Background(), tk) }()
	waitQueued(t, p, n+1)
	return tk, done
}
