package scheduler

import (
	"context"
	"errors"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
)

// queued returns the number of jobs waiting in p's queue.
func queued(p *Pool) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.queue.n
}

// waitQueued waits until n jobs wait in p's queue.
func waitQueued(t *testing.T, p *Pool, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for queued(p) != n {
		if time.Now().After(deadline) {
			t.Fatalf("%d jobs queued; want %d", queued(p), n)
		}
		runtime.Gosched()
	}
}

// enqueue starts acquiring a worker for a job of the given cost in the
// background and waits until it is queued; the result arrives on the channel.
func enqueue(t *testing.T, p *Pool, cfg *Config, cost float64, ctx context.Context) (*Ticket, chan error) {
	t.Helper()
	tk := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: cost}}
	done := make(chan error, 1)
	n := queued(p)
	go func() { done <- p.Acquire(ctx, tk) }()
	waitQueued(t, p, n+1)
	return tk, done
}

func TestJobsWaitForTheFirstWorkerToFreeUp(t *testing.T) {
	p, _ := poolOf(t, 2)
	cfg := config(LeastWork{}, 1)
	a, _ := choose(t, p, cfg, 100)
	choose(t, p, cfg, 1)
	late, done := enqueue(t, p, cfg, 5, context.Background())
	p.Release(a, End{Worker: Succeeded})
	if err := <-done; err != nil || late.worker != p.byDial[a.servedBy[7:]] {
		t.Fatalf("waiting job got %v (%v); want the worker that freed up, %s", late.worker, err, a.servedBy)
	}
}

func TestJobRunningAgainKeepsItsPlace(t *testing.T) {
	p, _ := poolOf(t, 3)
	cfg := config(LeastWork{}, 1)
	cfg.MaxAttempts = 3
	first, _ := choose(t, p, cfg, 1)
	second, _ := choose(t, p, cfg, 1)
	choose(t, p, cfg, 1)
	newer, newerDone := enqueue(t, p, cfg, 1, context.Background())
	failedOn := first.worker
	rerun := make(chan error, 1)
	go func() { rerun <- p.Retry(context.Background(), first, End{Worker: Failed, Rerun: RerunStatus}) }()
	// The worker that failed it goes to the newer job; first waits, ahead
	// of jobs that came after it.
	if err := <-newerDone; err != nil || newer.worker != failedOn {
		t.Fatalf("newer job got %v (%v); want the freed worker, which first may not have again", newer.worker, err)
	}
	waitQueued(t, p, 1)
	newest, newestDone := enqueue(t, p, cfg, 1, context.Background())
	freed := second.worker
	p.Release(second, End{Worker: Succeeded})
	if err := <-rerun; err != nil || first.worker != freed {
		t.Fatalf("the job running again got %v (%v); want the next worker to free up, %s", first.worker, err, freed.url)
	}
	if newest.worker != nil {
		t.Fatal("a newer job took the worker ahead of the job running again")
	}
	p.Release(first, End{Worker: Succeeded})
	if err := <-newestDone; err != nil {
		t.Fatal(err)
	}
}

func TestQueueOrder(t *testing.T) {
	for order, want := range map[string][]float64{
		"fifo":           {5, 1, 9, 3},
		"largest_first":  {9, 5, 3, 1},
		"smallest_first": {1, 3, 5, 9},
	} {
		p, _ := poolOf(t, 1)
		cfg := config(LeastWork{}, 1)
		cfg.Order = QueueOrders[order]
		running, _ := choose(t, p, cfg, 1)
		var waiting []*Ticket
		var dones []chan error
		for _, cost := range []float64{5, 1, 9, 3} {
			tk, done := enqueue(t, p, cfg, cost, context.Background())
			waiting = append(waiting, tk)
			dones = append(dones, done)
		}
		var got []float64
		for range waiting {
			p.Release(running, End{Worker: Succeeded})
			for i, tk := range waiting {
				if tk.worker != nil && tk != running {
					<-dones[i]
					running = tk
					got = append(got, tk.Cost)
				}
			}
		}
		for i := range want {
			if got[i] != want[i] {
				t.Fatalf("order %s served %v; want %v", order, got, want)
			}
		}
	}
}

func TestQueueTimeout(t *testing.T) {
	p, _ := poolOf(t, 1)
	cfg := config(LeastWork{}, 1)
	cfg.Timeout = 20 * time.Millisecond
	choose(t, p, cfg, 1)
	tk := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 1}}
	if err := p.Acquire(context.Background(), tk); !errors.Is(err, ErrQueueTimeout) {
		t.Fatalf("acquire: %v; want the queue timeout", err)
	}
	if queued(p) != 0 || tk.worker != nil {
		t.Fatal("a timed-out job stayed in the queue or kept a worker")
	}
}

func TestMaxQueue(t *testing.T) {
	p, _ := poolOf(t, 1)
	cfg := config(LeastWork{}, 1)
	cfg.MaxQueue = 2
	choose(t, p, cfg, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	enqueue(t, p, cfg, 1, ctx)
	enqueue(t, p, cfg, 1, ctx)
	if err := p.Acquire(ctx, &Ticket{pool: p, cfg: cfg, Request: Request{Job: true}}); !errors.Is(err, ErrQueueFull) {
		t.Fatalf("third waiting job: %v; want queue full", err)
	}
}

func TestCancelledJobLeavesTheQueueAtOnce(t *testing.T) {
	p, _ := poolOf(t, 1)
	cfg := config(LeastWork{}, 1)
	running, _ := choose(t, p, cfg, 1)
	ctx, cancel := context.WithCancel(context.Background())
	_, done := enqueue(t, p, cfg, 1, ctx)
	next, nextDone := enqueue(t, p, cfg, 1, context.Background())
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled job: %v", err)
	}
	waitQueued(t, p, 1)
	p.Release(running, End{Worker: Succeeded})
	if err := <-nextDone; err != nil || next.worker == nil {
		t.Fatalf("the job behind the cancelled one: %v", err)
	}
}

func TestNoWorkerThatCouldServeFailsAtOnce(t *testing.T) {
	p, _ := poolOf(t, 1)
	p.SetCapabilities("http://a:1", []string{"T2I"}, "")
	cfg := config(LeastWork{}, 1)
	if err := p.Acquire(context.Background(), &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Task: request.VideoTask}}); err != ErrNoWorker {
		t.Fatalf("video job on an image pool: %v", err)
	}
	empty := newPool("empty")
	if err := empty.Acquire(context.Background(), &Ticket{pool: empty, cfg: cfg, Request: Request{Job: true}}); err != ErrNoWorker {
		t.Fatalf("job on an empty pool: %v", err)
	}
}

// TestCountersReturnToZero runs 10,000 jobs through a small pool with
// random cancellations, failures, retries and timeouts; afterwards nothing
// may be in flight or queued.
func TestCountersReturnToZero(t *testing.T) {
	p, _ := poolOf(t, 4)
	cfg := config(LeastWork{}, 1)
	cfg.Timeout = 50 * time.Millisecond
	var wg sync.WaitGroup
	sem := make(chan struct{}, 64)
	for i := range 10_000 {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			runJob(p, cfg, rand.New(rand.NewPCG(uint64(i), 0)))
		})
	}
	wg.Wait()
	if queued(p) != 0 {
		t.Fatalf("%d jobs still queued", queued(p))
	}
	for _, w := range p.workers {
		if w.load.inflight != 0 || len(w.load.jobs) != 0 || w.load.work != 0 {
			t.Fatalf("%s: inflight %d, %d jobs, work %v after all requests ended", w.dial, w.load.inflight, len(w.load.jobs), w.load.work)
		}
	}
}

// runJob plays one request with a random fate.
func runJob(p *Pool, cfg *Config, rng *rand.Rand) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if rng.IntN(10) == 0 {
		time.AfterFunc(time.Duration(rng.IntN(200))*time.Microsecond, cancel)
	}
	tk := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: float64(1 + rng.IntN(100))}}
	if p.Acquire(ctx, tk) != nil {
		return
	}
	if rng.IntN(8) == 0 && p.Retry(ctx, tk, End{Worker: Failed, Rerun: RerunStatus}) != nil {
		return
	}
	time.Sleep(time.Duration(rng.IntN(50)) * time.Microsecond)
	p.Release(tk, End{Worker: Evidence(rng.IntN(3))})
}

// A job pinned to a busy worker waits for that worker, and the jobs
// behind it take the others as they free up.
func TestAJobPinnedToABusyWorkerLetsTheOthersPass(t *testing.T) {
	p, _ := poolOf(t, 2)
	cfg := config(LeastWork{}, 1)
	long, _ := choose(t, p, cfg, 100)
	short, _ := choose(t, p, cfg, 1)
	pinned := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 1, Pin: long.ServedBy()}}
	ctx, cancel := context.WithCancel(context.Background())
	left := make(chan error)
	go func() { left <- p.Acquire(ctx, pinned) }()
	t.Cleanup(func() { cancel(); <-left })
	waitQueued(t, p, 1)
	behind, done := enqueue(t, p, cfg, 1, context.Background())
	p.Release(short, End{Worker: Succeeded})
	if err := <-done; err != nil || behind.ServedBy() != short.ServedBy() {
		t.Fatalf("the job behind the pinned one got %q (%v); want %s, which freed up", behind.ServedBy(), err, short.ServedBy())
	}
	if queued(p) != 1 {
		t.Fatalf("%d jobs wait; want the pinned one", queued(p))
	}
}

func TestTenThousandWaitingJobsDrain(t *testing.T) {
	before := packageGoroutines()
	drainQueue(t, 10_000)
	testkit.WaitNoNewGoroutines(t, "draining 10,000 jobs", "this package", before, packageGoroutines)
}

// drainQueue fills one worker's queue with n jobs, then completes them all.
func drainQueue(tb testing.TB, n int) {
	p := newPool("drain")
	p.Declare([]string{"http://a:1"})
	cfg := &Config{Strategy: LeastWork{}, MaxInflight: 1, MaxQueue: n, Order: FIFO{}}
	got := make(chan *Ticket, n)
	// The first job is predicted to run for days, so that no waiting job is
	// handed to the worker ahead of its end, however slow the queue fills.
	first := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 1e6}}
	if err := p.Acquire(context.Background(), first); err != nil {
		tb.Fatal(err)
	}
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			tk := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 1}}
			if err := p.Acquire(context.Background(), tk); err != nil {
				tb.Error(err)
				return
			}
			got <- tk
		})
	}
	deadline := time.Now().Add(time.Minute)
	for queued(p) != n {
		if time.Now().After(deadline) {
			tb.Fatalf("%d of %d jobs queued after a minute", queued(p), n)
		}
		runtime.Gosched()
	}
	p.Release(first, End{Worker: Succeeded})
	for range n {
		p.Release(<-got, End{Worker: Succeeded})
	}
	wg.Wait()
	if queued(p) != 0 || p.workers[0].load.inflight != 0 {
		tb.Fatalf("after draining: %d queued, %d in flight", queued(p), p.workers[0].load.inflight)
	}
}

func TestAbandonedJobKeepsItsWorkerUntilItWouldEnd(t *testing.T) {
	p, _ := poolOf(t, 2)
	cfg := config(LeastWork{}, 1)
	left, _ := choose(t, p, cfg, 100)
	left.NoteSent()
	p.Release(left, End{Worker: Abandoned}) // the client left; the worker computes on
	w := p.byDial[left.servedBy[len("http://"):]]
	if info, _ := p.Worker(left.servedBy); info.Inflight != 1 || info.WorkLeft <= 0 {
		t.Fatalf("after its client left, the job's worker has %d in flight and %v work left; want the job still counted", info.Inflight, info.WorkLeft)
	}
	next, _ := choose(t, p, cfg, 1)
	if next.worker == w {
		t.Fatal("the next job went to the worker still computing the abandoned one")
	}
	p.Release(next, End{Worker: Succeeded})
	p.endGhost(left)
	if info, _ := p.Worker(left.servedBy); info.Inflight != 0 {
		t.Fatalf("at its predicted end the abandoned job still holds its worker: %d in flight", info.Inflight)
	}
	p.endGhost(left) // a second end changes nothing
	// A job that never reached its worker leaves at once.
	unsent, _ := choose(t, p, cfg, 100)
	p.Release(unsent, End{Worker: Abandoned})
	if info, _ := p.Worker(unsent.servedBy); info.Inflight != 0 {
		t.Fatal("a job its client left before it was sent still holds its worker")
	}
}

// Two answers that arrive together can be released out of order: the one
// behind the head first. That job never started on the router's clock, so
// it must not teach the worker a speed (it did: an elapsed time of the
// whole Unix epoch, a speed of about nothing).
func TestAnswerOvertakingTheHeadTeachesNoSpeed(t *testing.T) {
	p, clock := poolOf(t, 1)
	cfg := config(LeastWork{}, 0)
	head, _ := choose(t, p, cfg, 1)
	behind, _ := choose(t, p, cfg, 1)
	clock.advance(time.Second)
	p.Release(behind, End{Worker: Succeeded})
	if s := p.workers[0].load.speed; s.Samples() != 0 {
		t.Fatalf("the overtaking answer taught a speed of %g units/s", s.Value())
	}
	p.Release(head, End{Worker: Succeeded})
	if s := p.workers[0].load.speed; s.Samples() != 1 || s.Value() != 1 {
		t.Fatalf("speed %g units/s from %d samples; want 1 from the head's 1 unit in 1 s", s.Value(), s.Samples())
	}
}

func TestPrefetchOnlyForJobsAboutToEnd(t *testing.T) {
	w := &worker{}
	now := int64(1_000_000_000)
	for _, tc := range []struct {
		name     string
		left     time.Duration // until the worker's jobs are predicted to end
		inflight int
		fits     bool
	}{
		{"free slot", time.Hour, 0, true},
		{"long job running", time.Second, 1, false},
		{"ending now: one more", time.Millisecond, 1, true},
		{"jobs of no time: a few more", time.Millisecond, 1 + maxPrefetch - 1, true},
		{"but no more than maxPrefetch", time.Millisecond, 1 + maxPrefetch, false},
		{"slightly late: still about to end", -time.Millisecond, 4, true},
		{"long overdue, maybe stalled: one more at most", -time.Second, 1, true},
		{"long overdue with one more already", -time.Second, 2, false},
	} {
		w.load.inflight, w.load.endsAt = tc.inflight, now+int64(tc.left)
		if got := fits(true, 1, w, now); got != tc.fits {
			t.Errorf("%s: fits = %v", tc.name, got)
		}
	}
}

// A cancelled ticket that waits leaves the queue at once, with the cause,
// and never reaches a worker; the worker it would have had goes to the
// next job.
func TestCancelledWaitingJobLeavesTheQueue(t *testing.T) {
	p, _ := poolOf(t, 1)
	cfg := config(LeastWork{}, 1)
	running, _ := choose(t, p, cfg, 1)
	tk := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 5}}
	ctx := tk.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Acquire(ctx, tk) }()
	waitQueued(t, p, 1)
	next, nextDone := enqueue(t, p, cfg, 7, context.Background())
	cause := errors.New("step 12 aborted")
	tk.Cancel(cause)
	if err := <-done; err != cause {
		t.Fatalf("cancelled job got %v; want its cause", err)
	}
	if queued(p) != 1 || tk.worker != nil {
		t.Fatalf("after the cancel: %d queued, worker %v; want only the other job waiting", queued(p), tk.worker)
	}
	p.Release(running, End{Worker: Succeeded})
	if err := <-nextDone; err != nil || next.worker == nil {
		t.Fatalf("the job behind got %v", err)
	}
}

// A cancelled ticket that runs ends its attempt's context; released as
// abandoned, its worker's slot stays counted until the job's predicted
// end, since the GPU finishes it anyway.
func TestCancelledRunningJobKeepsItsSlotUntilItWouldEnd(t *testing.T) {
	p, _ := poolOf(t, 1)
	cfg := config(LeastWork{}, 1)
	tk := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 100}}
	ctx := tk.WithCancel(context.Background())
	if err := p.Acquire(ctx, tk); err != nil {
		t.Fatal(err)
	}
	tk.NoteSent()
	tk.Cancel(errors.New("abort_all"))
	if ctx.Err() == nil || CancelledBy(ctx) == nil {
		t.Fatal("the running job's context was not ended with its cause")
	}
	p.Release(tk, End{Worker: Abandoned})
	if info, _ := p.Worker(tk.servedBy); info.Inflight != 1 {
		t.Fatalf("after the cancel the worker has %d in flight; want the job still counted", info.Inflight)
	}
	p.endGhost(tk)
	if info, _ := p.Worker(tk.servedBy); info.Inflight != 0 {
		t.Fatalf("at its predicted end the cancelled job still holds its worker: %d in flight", info.Inflight)
	}
}

// A copy of a job runs beside its attempt: it ends when the client
// leaves or the job is cancelled, with the cancel's cause, but not when it
// overtakes the attempt, whose context then ends with no cause of an
// abort.
func TestACopyEndsWithItsJobNotWithTheAttemptItOvertook(t *testing.T) {
	newTicket := func(parent context.Context) *Ticket {
		tk := &Ticket{Request: Request{Job: true}}
		tk.WithCancel(parent)
		return tk
	}
	tk := newTicket(context.Background())
	copyCtx, endCopy := tk.CopyContext()
	tk.Overtake()
	if tk.ctx.Err() == nil || tk.Cancelled() != nil {
		t.Fatalf("overtaken attempt: context %v, cancelled by %v; want ended, by no abort", tk.ctx.Err(), tk.Cancelled())
	}
	if copyCtx.Err() != nil {
		t.Fatal("the copy that overtook the attempt was ended with it")
	}
	endCopy()
	if copyCtx.Err() == nil {
		t.Fatal("the copy's own end did not end its context")
	}

	tk = newTicket(context.Background())
	copyCtx, endCopy = tk.CopyContext()
	defer endCopy()
	cause := errors.New("step 12 aborted")
	tk.Cancel(cause)
	waitFor(t, "the cancelled job's copy to end", func() bool { return copyCtx.Err() != nil })
	if got := CancelledBy(copyCtx); got != cause {
		t.Fatalf("the cancelled job's copy ended by %v; want the cancel's cause", got)
	}

	client, leave := context.WithCancel(context.Background())
	tk = newTicket(client)
	copyCtx, endCopy = tk.CopyContext()
	defer endCopy()
	leave()
	if copyCtx.Err() == nil {
		t.Fatal("the copy outlived its client")
	}
}

// A job whose client left holds its worker until its predicted end at the
// speed the pool knows now, not at the one it knew when the job started:
// in a cold pool, a 50-unit job started at the initial speed of 1 a second
// would hold its worker 50 s though the worker beside it has shown, a
// moment later, that the fleet runs 100 units a second.
func TestAbandonedJobEndsAtTheSpeedLearnedSince(t *testing.T) {
	p, clock := poolOf(t, 2)
	t.Cleanup(func() { _ = p.Close() })
	cfg := config(LeastWork{}, 1)
	left, _ := choose(t, p, cfg, 50)
	left.NoteSent()
	p.Release(left, End{Worker: Abandoned})
	quick, _ := choose(t, p, cfg, 1)
	clock.advance(10 * time.Millisecond)
	p.Release(quick, End{Worker: Succeeded}) // 100 units a second: the job left ends 0.5 s after it started
	waitFor(t, "the job whose client left to end at its predicted end", func() bool {
		return infoOf(t, p, left.ServedBy()).Inflight == 0
	})
}

// Admit gives a job its worker with no goroutine waiting for it: given is
// called at once when a worker is free, else as the worker frees up.
func TestAdmitCallsGivenOnceTheJobHasAWorker(t *testing.T) {
	p, _ := poolOf(t, 1)
	cfg := config(LeastWork{}, 1)
	first, second := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 1}}, &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 1}}
	var given []*Ticket
	for _, tk := range []*Ticket{first, second} {
		if err := p.Admit(tk, func() { given = append(given, tk) }); err != nil {
			t.Fatal(err)
		}
	}
	if !slices.Equal(given, []*Ticket{first}) {
		t.Fatalf("given %d jobs before any ended; want the first only", len(given))
	}
	p.Release(first, End{Worker: Succeeded})
	if !slices.Equal(given, []*Ticket{first, second}) || second.ServedBy() != "http://a:1" {
		t.Fatalf("after the first ended: %d given, the second on %q; want both, the second on http://a:1", len(given), second.ServedBy())
	}
}

// adaptiveRun admits jobs of the given costs to p, one worker of speed 1
// on clock, and reports the costs in the order they got the worker.
type adaptiveRun struct {
	t       *testing.T
	p       *Pool
	clock   *fakeClock
	cfg     *Config
	given   []float64
	running []*Ticket
}

func newAdaptiveRun(t *testing.T) *adaptiveRun {
	p, clock := poolOf(t, 1)
	cfg := config(LeastWork{}, 1)
	cfg.Order = Adaptive{}
	return &adaptiveRun{t: t, p: p, clock: clock, cfg: cfg}
}

func (r *adaptiveRun) admit(costs ...float64) {
	for _, cost := range costs {
		tk := &Ticket{pool: r.p, cfg: r.cfg, Request: Request{Job: true, Cost: cost}}
		if err := r.p.Admit(tk, func() { r.given = append(r.given, cost); r.running = append(r.running, tk) }); err != nil {
			r.t.Fatal(err)
		}
	}
}

// drain runs every job to its end, each for its cost in seconds.
func (r *adaptiveRun) drain() []float64 {
	for len(r.running) > 0 {
		tk := r.running[0]
		r.running = r.running[1:]
		r.clock.advance(time.Duration(tk.Cost * float64(time.Second)))
		r.p.Release(tk, End{Worker: Succeeded})
	}
	given := r.given
	r.given = nil
	return given
}

// The default order serves a short queue in arrival order, the large job
// that came last included: a stream the fleet keeps up with waits as in
// FIFO.
func TestAdaptiveOrderKeepsAShortQueueInArrivalOrder(t *testing.T) {
	r := newAdaptiveRun(t)
	r.admit(1, 1, 1, 10) // 2 units wait as the 10 comes: less than 4 of it
	if got := r.drain(); !slices.Equal(got, []float64{1, 1, 1, 10}) {
		t.Fatalf("given in the order %v; want arrival order", got)
	}
}

// Once the queue is long, as when a rollout step arrives, the largest of
// the jobs that came together go first, those that waited already
// included; once it empties, arrival order is back.
func TestAdaptiveOrderGoesLargestFirstInALongQueue(t *testing.T) {
	r := newAdaptiveRun(t)
	r.admit(1, 10, 1, 1, 1, 1) // the first runs; the 10 waits in arrival order
	r.admit(1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1)
	r.admit(5) // 41 units waiting: more than 4 of the largest, 10, per worker
	want := append([]float64{1, 10, 5}, slices.Repeat([]float64{1}, 41)...)
	if got := r.drain(); !slices.Equal(got, want) {
		t.Fatalf("given in the order %v; want %v", got, want)
	}
	r.admit(1, 1, 1, 10)
	if got := r.drain(); !slices.Equal(got, []float64{1, 1, 1, 10}) {
		t.Fatalf("after the queue emptied, given in the order %v; want arrival order", got)
	}
}

// In a long queue a job is passed only by jobs that came at most as long
// after it as they run: a large one that comes later than that waits its
// turn.
func TestAdaptiveOrderAgesWaitingJobs(t *testing.T) {
	r := newAdaptiveRun(t)
	r.admit(slices.Repeat([]float64{1}, 50)...) // long
	r.clock.advance(20 * time.Second)           // the first runs on for 20 s more
	r.admit(10)                                 // runs 10 s, came 20 s after the rest
	want := append(slices.Repeat([]float64{1}, 50), 10)
	if got := r.drain(); !slices.Equal(got, want) {
		t.Fatalf("given in the order %v; want the large job last", got)
	}
}

// TestHundredThousandWaitingJobsDrain is TestTenThousandWaitingJobsDrain
// at the scale of a rollout step, with tenants and adapters on: 100,000
// jobs of 64 tenants wait for 16 workers holding 8 adapters, and each
// gets a worker once, one that holds its adapter, until none waits and
// every worker is idle. Its jobs are admitted without a goroutine each,
// as the race detector allows no more than 8,128 at once.
func TestHundredThousandWaitingJobsDrain(t *testing.T) {
	c := clusterOf(t, 16, 100_000, false)
	given, wrong := 0, 0
	for len(c.running) > 0 {
		tk := c.running[0]
		c.running = c.running[1:]
		given++
		c.p.mu.Lock()
		if tk.worker.adapter.holds != tk.policy {
			wrong++
		}
		c.p.mu.Unlock()
		c.p.Release(tk, End{Worker: Succeeded})
	}
	if given != 100_016 || wrong != 0 || queued(c.p) != 0 {
		t.Fatalf("%d jobs got a worker, %d one without their adapter, %d still wait; want 100,016, none and none", given, wrong, queued(c.p))
	}
	for _, w := range c.p.Snapshot() {
		if w.Inflight != 0 {
			t.Fatalf("after draining, %s has %d jobs in flight", w.URL, w.Inflight)
		}
	}
}
