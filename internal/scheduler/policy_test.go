package scheduler

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/clock"
	"github.com/miles-rollout/miles-diffusion-router/internal/request"
)

// fakeClock is a settable clock for a pool; its timers run on the wall
// clock.
type fakeClock struct{ t time.Time }

func (c *fakeClock) Now() time.Time                                  { return c.t }
func (c *fakeClock) AfterFunc(d time.Duration, f func()) clock.Timer { return time.AfterFunc(d, f) }
func (c *fakeClock) advance(d time.Duration)                         { c.t = c.t.Add(d) }

// poolOf returns a pool with n workers a:1, b:1, ... on a fake clock.
func poolOf(t *testing.T, n int) (*Pool, *fakeClock) {
	t.Helper()
	p := newPool(t.Name())
	clock := &fakeClock{time.Unix(1_000_000, 0)}
	p.clock = clock
	var urls []string
	for i := range n {
		urls = append(urls, fmt.Sprintf("http://%c:1", 'a'+i))
	}
	p.Declare(urls)
	return p, clock
}

func config(s Strategy, maxInflight int) *Config {
	return &Config{Strategy: s, MaxInflight: maxInflight, MaxQueue: 1000, Order: FIFO{}}
}

// choose acquires a worker for a new job and returns the ticket and the
// worker's host letter.
func choose(t *testing.T, p *Pool, cfg *Config, cost float64) (*Ticket, string) {
	t.Helper()
	tk := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: cost}}
	if err := p.Acquire(context.Background(), tk); err != nil {
		t.Fatalf("acquire: %v", err)
	}
	return tk, tk.worker.dial[:1]
}

func TestLeastRequestPicksLeastLoaded(t *testing.T) {
	p, _ := poolOf(t, 3)
	cfg := config(LeastRequest{}, 0)
	var held []*Ticket
	counts := map[string]int{}
	for range 9 {
		tk, w := choose(t, p, cfg, 1)
		counts[w]++
		held = append(held, tk)
	}
	if counts["a"] != 3 || counts["b"] != 3 || counts["c"] != 3 {
		t.Fatalf("9 jobs on 3 workers went %v; want 3 each", counts)
	}
	freed := 0
	for _, tk := range held {
		if tk.servedBy == "http://b:1" && freed < 2 {
			p.Release(tk, End{Worker: Succeeded})
			freed++
		}
	}
	for range 2 {
		if _, w := choose(t, p, cfg, 1); w != "b" {
			t.Fatalf("job went to %s; want b, the least loaded", w)
		}
	}
}

func TestIdleWorkersShareTies(t *testing.T) {
	for _, s := range []Strategy{LeastRequest{}, LeastWork{}, Random{}} {
		p, _ := poolOf(t, 4)
		seen := map[string]bool{}
		for range 200 {
			tk, w := choose(t, p, config(s, 0), 1)
			seen[w] = true
			p.Release(tk, End{Worker: Abandoned})
		}
		if len(seen) != 4 {
			t.Fatalf("%T on idle workers chose only %v", s, seen)
		}
	}
}

func TestRoundRobinCycles(t *testing.T) {
	p, _ := poolOf(t, 3)
	var got string
	cfg := config(new(RoundRobin), 0)
	for range 6 {
		tk, w := choose(t, p, cfg, 1)
		got += w
		p.Release(tk, End{Worker: Succeeded})
	}
	if got[:3] != got[3:] || got[0] == got[1] || got[1] == got[2] || got[0] == got[2] {
		t.Fatalf("round robin order %s does not cycle through 3 workers", got)
	}
}

func TestLeastWorkPrefersTheFastWorker(t *testing.T) {
	p, clock := poolOf(t, 2)
	cfg := config(LeastWork{}, 0)
	// a turns 1 unit of cost into a second, b 4.
	teach(t, p, clock, cfg, map[string]float64{"a": 1, "b": 4})
	if _, w := choose(t, p, cfg, 10); w != "b" {
		t.Fatalf("job went to %s; want the fast worker b", w)
	}
	// b now has 10 units (2.5 s) left; a 1-unit job finishes sooner on a
	// (1 s) than behind b's job (2.75 s).
	if _, w := choose(t, p, cfg, 1); w != "a" {
		t.Fatalf("small job went to %s; want a, which finishes it first", w)
	}
}

func TestLeastWorkCountsWorkNotRequests(t *testing.T) {
	p, clock := poolOf(t, 2)
	cfg := config(LeastWork{}, 0)
	big, w1 := choose(t, p, cfg, 100)
	var other string
	for range 5 {
		_, w := choose(t, p, cfg, 1)
		if w == w1 {
			t.Fatalf("small job queued behind the 100-unit job on %s", w)
		}
		other = w
	}
	// Once the big job is done, its worker is the one with the least work.
	clock.advance(100 * time.Second)
	p.Release(big, End{Worker: Succeeded})
	if _, w := choose(t, p, cfg, 1); w != w1 {
		t.Fatalf("job went to %s (5 jobs queued) instead of idle %s", other, w1)
	}
}

// teach has each worker complete jobs at the given speed (cost units per
// second), so the pool learns it.
func teach(t *testing.T, p *Pool, clock *fakeClock, cfg *Config, speeds map[string]float64) {
	t.Helper()
	for host, speed := range speeds {
		for range 5 {
			tk := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 10, Pin: "http://" + host + ":1"}}
			if err := p.Acquire(context.Background(), tk); err != nil {
				t.Fatal(err)
			}
			clock.advance(time.Duration(10 / speed * float64(time.Second)))
			p.Release(tk, End{Worker: Succeeded})
		}
	}
}

func TestAdmitsOnlyWorkersThatMayServe(t *testing.T) {
	p, _ := poolOf(t, 3)
	p.SetDead("http://a:1", true)
	p.SetCapabilities("http://b:1", []string{"T2I"}, "")
	p.SetCapabilities("http://c:1", []string{"T2V"}, "")
	cfg := config(LeastRequest{}, 0)
	for task, want := range map[request.Task]string{request.VideoTask: "c", request.ImageTask: "b"} {
		for range 5 {
			tk := &Ticket{pool: p, cfg: cfg, Request: Request{Task: task, Job: true}}
			if err := p.Acquire(context.Background(), tk); err != nil || tk.worker.dial[:1] != want {
				t.Fatalf("task %d went to %v (%v); want %s", task, tk.worker, err, want)
			}
			p.Release(tk, End{Worker: Succeeded})
		}
	}
	poll := &Ticket{pool: p, cfg: cfg, Request: Request{Pin: "http://b:1"}}
	if err := p.Acquire(context.Background(), poll); err != nil || poll.worker.dial != "b:1" {
		t.Fatalf("pinned request went to %v (%v)", poll.worker, err)
	}
	if p.byDial["b:1"].load.inflight != 0 {
		t.Fatal("a video poll was counted as a job")
	}
	p.Release(poll, End{Worker: Succeeded})
	// A poll of a job a held-back worker runs still reaches it; a job pinned
	// there does not.
	deadPoll := &Ticket{pool: p, cfg: cfg, Request: Request{Pin: "http://a:1"}}
	if err := p.Acquire(context.Background(), deadPoll); err != nil || deadPoll.worker.dial != "a:1" {
		t.Fatalf("poll pinned to a held-back worker went to %v (%v); want that worker", deadPoll.worker, err)
	}
	p.Release(deadPoll, End{Worker: Succeeded})
	deadJob := &Ticket{pool: p, cfg: cfg, Request: Request{Pin: "http://a:1", Job: true}}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := p.Acquire(ctx, deadJob); err == nil {
		t.Fatal("a job pinned to a held-back worker was given it")
	}
}

func TestRetryAvoidsFailedWorker(t *testing.T) {
	p, _ := poolOf(t, 2)
	tk, first := choose(t, p, config(LeastRequest{}, 0), 1)
	if err := p.Retry(context.Background(), tk, End{Worker: Failed, Rerun: RerunStatus}); err != nil || tk.worker.dial[:1] == first {
		t.Fatalf("retry went to %v (%v) after %s failed", tk.worker, err, first)
	}
	// Both have failed it once and both still serve: rather than wait for
	// workers that are out, the job goes back to one of them.
	if err := p.Retry(context.Background(), tk, End{Worker: Failed, Rerun: RerunStatus}); err != nil || tk.worker == nil {
		t.Fatalf("second retry: %v; a worker that failed once is better than none", err)
	}
	p.Release(tk, End{Worker: Succeeded})
	for _, w := range p.workers {
		if w.load.inflight != 0 || w.stats.failures != 1 {
			t.Fatalf("%s: inflight=%d failures=%d; want 0, 1", w.dial, w.load.inflight, w.stats.failures)
		}
	}
}

// TestRetryAfterAnAnswerCutShortAvoidsItsWorker: the worker's answer
// began, which freed its slot, and then broke off; the job runs again on
// the other worker, though the strategy prefers the first.
func TestRetryAfterAnAnswerCutShortAvoidsItsWorker(t *testing.T) {
	p, _ := poolOf(t, 2)
	tk, first := choose(t, p, config(&lastURL{}, 0), 1)
	p.Release(tk, End{Worker: Succeeded})
	p.NoteCutShort(tk)
	if err := p.Retry(context.Background(), tk, End{Worker: Failed, Rerun: RerunStatus}); err != nil || tk.worker == nil || tk.worker.dial[:1] == first {
		t.Fatalf("retry went to %v (%v) after %s cut its answer short", tk.worker, err, first)
	}
	p.Release(tk, End{Worker: Succeeded})
	if w := p.findLocked("http://" + first + ":1"); w.stats.failures != 1 {
		t.Fatalf("%s shows %d failures after cutting an answer short; want 1", first, w.stats.failures)
	}
}

// TestRetryAfterAFailureReleasedAvoidsItsWorker: a worker on probation
// holds its slot until its answer is known; the answer broke, which
// released the slot as a failure; the job runs again on the other worker,
// though the strategy prefers the first.
func TestRetryAfterAFailureReleasedAvoidsItsWorker(t *testing.T) {
	p, _ := poolOf(t, 2)
	tk, first := choose(t, p, config(&lastURL{}, 0), 1)
	p.Release(tk, End{Worker: Failed})
	if err := p.Retry(context.Background(), tk, End{Worker: Failed, Rerun: RerunStatus}); err != nil || tk.worker == nil || tk.worker.dial[:1] == first {
		t.Fatalf("retry went to %q (%v) after %s broke its answer", tk.servedBy, err, first)
	}
}

// TestARerunNeverReturnsToAWorkerThatStalled: where Retry sends a
// job back to a worker that failed it rather than wait, a worker that
// stalled on it never gets it again: with no other, the job gets
// ErrNoOtherWorker at once, and leaves its worker free.
func TestARerunNeverReturnsToAWorkerThatStalled(t *testing.T) {
	p, _ := poolOf(t, 2)
	tk, first := choose(t, p, config(&lastURL{}, 0), 1) // the strategy would pick it again
	if err := p.Retry(context.Background(), tk, End{Worker: Failed, Rerun: RerunStalled}); err != nil || tk.worker == nil || tk.worker.dial[:1] == first {
		t.Fatalf("a job whose worker %s stalled went to %v (%v); want the other", first, tk.worker, err)
	}
	second := tk.worker.dial[:1]
	// Both had it; Retry goes back to one that failed it, never to the one
	// that stalled.
	if err := p.Retry(context.Background(), tk, End{Worker: Failed, Rerun: RerunStatus}); err != nil || tk.worker == nil || tk.worker.dial[:1] != second {
		t.Fatalf("after %s stalled and %s failed, the job went to %v (%v); want %s again", first, second, tk.worker, err, second)
	}
	p.Release(tk, End{Worker: Succeeded})
	tk, first = choose(t, p, config(LeastRequest{}, 0), 1)
	for _, w := range p.workers {
		w.health.down = w.dial[:1] != first
	}
	if err := p.Retry(context.Background(), tk, End{Worker: Failed, Rerun: RerunStalled}); err != ErrNoOtherWorker {
		t.Fatalf("alone, a job whose worker stalled: %v; want ErrNoOtherWorker", err)
	}
	for _, w := range p.workers {
		if w.load.inflight != 0 {
			t.Fatalf("%s still holds %d jobs", w.dial, w.load.inflight)
		}
	}
}

// When a job has been to every worker that may serve it, it goes back to
// one, but not to the one that failed it last while another serves: a
// worker breaking its answers at once is the least loaded and would take
// it straight back.
func TestRetryDoesNotGoBackToTheWorkerThatFailedItLast(t *testing.T) {
	p, _ := poolOf(t, 2)
	cfg := config(LeastRequest{}, 0)
	tk, first := choose(t, p, cfg, 1)
	if err := p.Retry(context.Background(), tk, End{Worker: Failed, Rerun: RerunStatus}); err != nil || tk.worker.dial[:1] == first {
		t.Fatalf("retry went to %v (%v) after %s failed", tk.worker, err, first)
	}
	second := tk.worker.dial[:1]
	busy, _ := choose(t, p, cfg, 1) // the first is now the more loaded
	if busy.worker.dial[:1] != first {
		t.Fatalf("a second job went to %s; want %s, the idle one", busy.worker.dial[:1], first)
	}
	if err := p.Retry(context.Background(), tk, End{Worker: Failed, Rerun: RerunStatus}); err != nil || tk.worker == nil || tk.worker.dial[:1] != first {
		t.Fatalf("after %s and then %s failed it, the job went to %q (%v); want %s, though busier", first, second, tk.servedBy, err, first)
	}
}

func TestRetryDoesNotWaitForWorkersThatAreOut(t *testing.T) {
	p, _ := poolOf(t, 3)
	tk, first := choose(t, p, config(LeastRequest{}, 0), 1)
	for _, w := range p.workers {
		if w.dial[:1] != first {
			w.health.down = true // marked dead by its probes
		}
	}
	if err := p.Retry(context.Background(), tk, End{Worker: Failed, Rerun: RerunStatus}); err != nil || tk.worker == nil || tk.worker.dial[:1] != first {
		t.Fatalf("retry: worker %v, %v; want the one serving worker again at once", tk.worker, err)
	}
}

// lastURL is a strategy known only to this test: the candidate whose URL
// sorts last. That the pool runs it proves the seam.
type lastURL struct{ seen [][]Candidate }

func (s *lastURL) Pick(_ Job, cands []Candidate) int {
	s.seen = append(s.seen, slices.Clone(cands))
	best := 0
	for i, c := range cands {
		if c.URL > cands[best].URL {
			best = i
		}
	}
	return best
}

func TestAStrategyFromOutsideTheScheduler(t *testing.T) {
	p, _ := poolOf(t, 3)
	s := &lastURL{}
	cfg := config(s, 1)
	var got string
	for range 3 {
		_, w := choose(t, p, cfg, 2)
		got += w
	}
	if got != "cba" {
		t.Fatalf("jobs went to %s; want c, b, a: the last free worker each time", got)
	}
	// The strategy saw only workers with a free slot, with their load.
	if n := len(s.seen[2]); n != 1 || s.seen[2][0].URL != "http://a:1" || s.seen[2][0].Inflight != 0 {
		t.Fatalf("third decision saw %+v; want only a, idle", s.seen[2])
	}
	if c := s.seen[0][0]; c.Speed <= 0 || c.WorkLeft != 0 {
		t.Fatalf("an idle worker seen as %+v", c)
	}
}
