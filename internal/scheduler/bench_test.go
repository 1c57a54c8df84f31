package scheduler

import (
	"context"
	"fmt"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/request"
)

// benchPool is a pool of n workers with learned, varied speeds, on a fixed
// clock.
func benchPool(b *testing.B, n int) *Pool {
	p := newPool("bench")
	p.clock = &fakeClock{time.Unix(1_000_000, 0)}
	urls := make([]string, n)
	for i := range urls {
		urls[i] = fmt.Sprintf("http://10.0.%d.%d:30000", i/256, i%256)
	}
	p.Declare(urls)
	for i, w := range p.workers {
		w.load.speed.Observe(1+float64(i%4), time.Second, 0) // that many units a second
	}
	return p
}

// fleetSizes are the pool sizes the routing benchmarks measure: a large
// fleet today, and eight times that.
var fleetSizes = []int{1024, 8192}

// BenchmarkDecision measures one least_work decision among n workers with
// max_inflight 1, each worker with a job but the free ones: "busy" leaves
// 16 free, as under rollout load, where the queue is rarely empty; "half"
// leaves half and "idle" all of them free, the worst case.
func BenchmarkDecision(b *testing.B) {
	for _, n := range fleetSizes {
		for _, bc := range []struct {
			name string
			free int
		}{{"busy", 16}, {"half", n / 2}, {"idle", n}} {
			b.Run(fmt.Sprintf("%d/%s", n, bc.name), func(b *testing.B) {
				p := benchPool(b, n)
				cfg := &Config{Strategy: LeastWork{}, MaxInflight: 1, MaxQueue: 10, Order: FIFO{}}
				for _, w := range p.workers[bc.free:] {
					p.assignLocked(&Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 10}}, w)
				}
				t := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 20}}
				b.ReportAllocs()
				b.ResetTimer()
				for b.Loop() {
					p.mu.Lock()
					if w, _ := p.chooseLocked(t); w == nil {
						b.Fatal("no worker")
					}
					p.mu.Unlock()
				}
			})
		}
	}
}

// BenchmarkDecisionTenants measures the decision of BenchmarkDecision's
// busy case (n workers, 16 free) while 8 tenants have jobs waiting (100
// each, of varied costs and counters): which tenant's job goes next, and
// to which worker.
func BenchmarkDecisionTenants(b *testing.B) {
	for _, n := range fleetSizes {
		b.Run(fmt.Sprintf("%d/busy/8-tenants", n), func(b *testing.B) {
			p := benchPool(b, n)
			cfg := &Config{Strategy: LeastWork{}, MaxInflight: 1, MaxQueue: 10_000, Order: FIFO{}}
			for _, w := range p.workers[16:] {
				p.assignLocked(&Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 10}}, w)
			}
			for i := range 800 {
				t := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: float64(10 + i%7), Tenant: fmt.Sprint("tenant-", i%8)}}
				p.seq++
				t.seq = p.seq
				p.joinTenantLocked(t)
				p.enqueueLocked(t)
			}
			for i, tn := range p.tenancy.list {
				tn.served = float64(100 - i)
			}
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				p.mu.Lock()
				p.queue.pass++ // the first decision of a pass, which reads the workers
				if _, w := p.nextLocked(); w == nil {
					b.Fatal("no worker")
				}
				p.mu.Unlock()
			}
		})
	}
}

// BenchmarkAcquireRelease measures a job's whole claim on a pool of n idle
// workers: choose, claim, release (with speed learning).
func BenchmarkAcquireRelease(b *testing.B) {
	for _, n := range fleetSizes {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			p := benchPool(b, n)
			cfg := &Config{Strategy: LeastWork{}, MaxInflight: 1, MaxQueue: 10, Order: FIFO{}}
			ctx := context.Background()
			b.ReportAllocs()
			for b.Loop() {
				t := Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 20}}
				if err := p.Acquire(ctx, &t); err != nil {
					b.Fatal(err)
				}
				p.Release(&t, End{Worker: Succeeded})
			}
		})
	}
}

// BenchmarkDrain fills a queue with 10,000 waiting jobs and drains it.
func BenchmarkDrain(b *testing.B) {
	for b.Loop() {
		drainQueue(b, 10_000)
	}
}

// BenchmarkTenantBacklog measures what a scrape of the tenant metrics
// holds the pool's lock for: the backlog of 64 tenants with 10,000 jobs
// waiting among 1,024 busy workers.
func BenchmarkTenantBacklog(b *testing.B) {
	p := benchPool(b, 1024)
	cfg := &Config{Strategy: LeastWork{}, MaxInflight: 1, MaxQueue: 10_000, Order: FIFO{}}
	for i, w := range p.workers {
		p.assignLocked(&Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 10, Tenant: fmt.Sprint("tenant-", i%64)}}, w)
	}
	for i := range 10_000 {
		t := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: float64(10 + i%7), Tenant: fmt.Sprint("tenant-", i%64)}}
		p.seq++
		t.seq = p.seq
		p.joinTenantLocked(t)
		p.enqueueLocked(t)
	}
	b.ReportAllocs()
	b.Run("tenants", func(b *testing.B) {
		for b.Loop() {
			if len(p.Tenants()) != 65 {
				b.Fatal("want 64 tenants and other")
			}
		}
	})
	b.Run("pool", func(b *testing.B) { // the pool's backlog alone, the same play-out
		for b.Loop() {
			p.Backlog()
		}
	})
}

// The queue at cluster scale: 1,024 workers, each busy with a job under
// max_inflight 1, 8 adapters placed (128 workers holding each), and
// waiting jobs from 64 tenants, each for one of the adapters.
const (
	clusterWorkers  = 1024
	clusterTenants  = 64
	clusterAdapters = 8
	clusterWaiting  = 100_000
)

// cluster is a pool at cluster scale, the config its jobs come with,
// and its jobs running, in the order they got their workers.
type cluster struct {
	p       *Pool
	cfg     *Config
	running []*Ticket
}

// clusterQueue is such a pool with n jobs waiting. Every job was admitted
// as the router admits it, with Admit. With switching, placement runs a
// pass after each dispatch, with a switcher whose calls never end before
// the pool closes; without, the adapters stay where they are, and the
// pool's decisions are the queue's alone.
func clusterQueue(tb testing.TB, n int, switching bool) *cluster {
	return clusterOf(tb, clusterWorkers, n, switching)
}

// clusterOf is clusterQueue with workers workers, at least one for each
// adapter.
func clusterOf(tb testing.TB, workers, n int, switching bool) *cluster {
	p := benchPool(nil, workers)
	tb.Cleanup(func() { _ = p.Close() })
	adapters := make([]Adapter, clusterAdapters)
	for i := range adapters {
		adapters[i] = Adapter{Name: fmt.Sprint("lora-", i), Path: fmt.Sprint("/l/", i)}
	}
	p.DeclareAdapters(adapters, placementConfig(30*time.Second))
	p.mu.Lock()
	if switching {
		p.placement.switcher = stuckSwitcher{} // without the placement's clock: no pass but the benchmark's
	}
	now := p.now().UnixNano()
	for i, w := range p.workers {
		// A second job at its speed: the pool works its median speed out
		// again after a worker's first job only, which the drain need not
		// measure.
		w.load.speed.Observe(1+float64(i%4), time.Second, 0)
		pol := p.placement.order[i%clusterAdapters]
		w.adapter = workerAdapter{known: true, holds: pol, publish: pol.publish, since: now}
	}
	p.mu.Unlock()
	c := &cluster{p: p, cfg: &Config{Strategy: LeastWork{}, MaxInflight: 1, MaxQueue: 1 << 30, Order: Adaptive{}}}
	for i := range workers + n {
		c.admit(tb, c.job(tb, i))
	}
	if len(c.running) != workers || queued(p) != n {
		tb.Fatalf("%d running, %d waiting; want %d, %d", len(c.running), queued(p), workers, n)
	}
	return c
}

// admit admits t, which joins the jobs running once it has a worker.
func (c *cluster) admit(tb testing.TB, t *Ticket) {
	if err := c.p.Admit(t, func() { c.running = append(c.running, t) }); err != nil {
		tb.Fatal(err)
	}
}

// completionGap is the time between two jobs' ends on a cluster: 1,024
// workers each running a job of about 5 s (cost 13 at speed 2.5).
const completionGap = 5 * time.Millisecond

// drain ends each job running in turn, its worker taking the next waiting
// job, until none runs, the clock moving on by completionGap before each.
func (c *cluster) drain() {
	for len(c.running) > 0 {
		t := c.running[0]
		c.running = c.running[1:]
		c.p.mu.Lock()
		c.p.clock.(*fakeClock).advance(completionGap)
		c.p.mu.Unlock()
		c.p.Release(t, End{Worker: Succeeded})
	}
}

// job is the i'th job of a clusterQueue: an adapter's and a tenant's in
// turn, of costs 10-16.
func (c *cluster) job(tb testing.TB, i int) *Ticket {
	p := c.p
	t := p.NewTicket(c.cfg)
	t.Job, t.Task, t.Cost = true, request.ImageTask, float64(10+i%7)
	t.Tenant = fmt.Sprint("tenant-", i/clusterAdapters%clusterTenants)
	if err := p.ResolveAdapter(t, fmt.Sprint("lora-", i%clusterAdapters)); err != nil {
		tb.Fatal(err)
	}
	return t
}

// stuckSwitcher is a worker fleet whose LoRA calls end only with the
// pool: a worker placement switches serves nothing from then on.
type stuckSwitcher struct{}

func (stuckSwitcher) Active(ctx context.Context, _ string) (string, string, error) {
	<-ctx.Done()
	return "", "", ctx.Err()
}

func (stuckSwitcher) Switch(ctx context.Context, _ string, _ *Adapter, _ bool) (int, string, error) {
	<-ctx.Done()
	return 0, "", ctx.Err()
}

// cpuTime is the CPU time the process has used.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// placements are the two ways the cluster benchmarks run: with
// placement's passes, and with the adapters where they are.
var placements = []struct {
	name      string
	switching bool
}{{"switching", true}, {"fixed", false}}

// BenchmarkClusterQueue measures the queue of clusterQueue, 100,000 jobs
// waiting: a job admitted and taken out again ("admit"), what a scrape
// of the tenants' figures takes ("tenants"), and a dispatch pass when the
// one free worker holds an adapter no waiting job wants
// ("pass-none-runnable").
func BenchmarkClusterQueue(b *testing.B) {
	for _, pl := range placements {
		b.Run(pl.name, func(b *testing.B) { benchClusterQueue(b, pl.switching) })
	}
}

func benchClusterQueue(b *testing.B, switching bool) {
	c := clusterQueue(b, clusterWaiting, switching)
	p := c.p
	b.Run("admit", func(b *testing.B) {
		i := 0
		for b.Loop() {
			t := c.job(b, i)
			i++
			p.mu.Lock()
			wt, err := p.admitLocked(t)
			if wt == nil {
				b.Fatal("a job got a worker, or no place:", err)
			}
			p.dequeueLocked(wt)
			p.mu.Unlock()
		}
	})
	b.Run("index", func(b *testing.B) { // a job joins the queue's index and leaves it, and nothing else
		t := c.job(b, clusterWaiting/2)
		p.mu.Lock()
		p.seq++
		t.seq = p.seq
		p.joinTenantLocked(t)
		p.mu.Unlock()
		for b.Loop() {
			p.mu.Lock()
			p.dequeueLocked(p.enqueueLocked(t))
			p.mu.Unlock()
		}
	})
	b.Run("tenants", func(b *testing.B) {
		for b.Loop() {
			if len(p.Tenants()) != clusterTenants+1 {
				b.Fatal("want 64 tenants and other")
			}
		}
	})
	b.Run("tenants-locked", func(b *testing.B) { // what of a scrape holds the lock: on average, and at the least (the machine's other work aside)
		var locked, least time.Duration
		for b.Loop() {
			v := p.newBacklogView(true)
			p.mu.Lock()
			began := time.Now()
			p.tenantsLocked(v)
			took := time.Since(began)
			p.mu.Unlock()
			locked += took
			if least == 0 || took < least {
				least = took
			}
		}
		b.ReportMetric(float64(locked.Microseconds())/float64(b.N), "µs-locked/op")
		b.ReportMetric(float64(least.Microseconds()), "µs-locked-least")
	})
	b.Run("pass-none-runnable", func(b *testing.B) {
		p.mu.Lock()
		w := p.workers[0]
		w.adapter.holds = &p.placement.stray // wanted by no job
		// Freed already when -count runs this again.
		if len(w.load.jobs) > 0 {
			p.freeLocked(w.load.jobs[0], End{Worker: Succeeded})
		}
		p.mu.Unlock()
		for b.Loop() {
			p.mu.Lock()
			p.dispatchLocked()
			p.mu.Unlock()
		}
		if queued(p) != clusterWaiting {
			b.Fatalf("%d waiting; want every job still waiting", queued(p))
		}
	})
}

// BenchmarkClusterDrain drains the queue of clusterQueue: each job
// running ends in turn, and its worker takes the next, until none waits
// and none runs, at the pace of a cluster's completions. It reports the CPU time of a
// drain beside its wall time.
func BenchmarkClusterDrain(b *testing.B) {
	for _, pl := range placements {
		for _, n := range []int{10_000, clusterWaiting} {
			b.Run(fmt.Sprint(pl.name, "/", n), func(b *testing.B) { benchClusterDrain(b, n, pl.switching) })
		}
	}
}

func benchClusterDrain(b *testing.B, n int, switching bool) {
	var cpu time.Duration
	for b.Loop() {
		b.StopTimer()
		c := clusterQueue(b, n, switching)
		b.StartTimer()
		began := cpuTime()
		c.drain()
		cpu += cpuTime() - began
		if queued(c.p) != 0 {
			b.Fatalf("%d jobs still waiting", queued(c.p))
		}
	}
	b.ReportMetric(cpu.Seconds()/float64(b.N), "cpu-s/op")
}

// BenchmarkWaitingJobMemory reports the heap a waiting job holds beyond
// its body: its ticket, as the router makes it (cancellable), its place
// in the queue and every index of it, measured over 100,000 of them.
func BenchmarkWaitingJobMemory(b *testing.B) {
	for b.Loop() {
		b.StopTimer()
		c := clusterQueue(b, 0, false)
		jobs := make([]*Ticket, clusterWaiting)
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		b.StartTimer()
		for i := range jobs {
			t := c.job(b, i)
			t.WithCancel(context.Background())
			jobs[i] = t
			c.admit(b, t)
		}
		b.StopTimer()
		runtime.GC()
		runtime.ReadMemStats(&after)
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/clusterWaiting, "B/waiting-job")
		runtime.KeepAlive(jobs)
		b.StartTimer()
	}
}

// BenchmarkClusterPassedOver is a dispatch pass of clusterQueue's queue
// when every waiting job has been passed over for priority_max_wait by
// one of a higher priority, and the one free worker can run none of them
// (it holds an adapter no job wants): the pass asks about each class of
// them once, not about each job.
func BenchmarkClusterPassedOver(b *testing.B) {
	c := clusterQueue(b, clusterWaiting, false)
	p := c.p
	p.mu.Lock()
	w := p.workers[0]
	w.adapter.holds = &p.placement.stray
	p.freeLocked(w.load.jobs[0], End{Worker: Succeeded})
	c.cfg.MaxPassedOver = time.Minute
	p.clock.(*fakeClock).advance(2 * time.Minute)
	p.dispatchLocked() // each worker, overdue now, takes its one job beyond the limit
	p.mu.Unlock()
	urgent := c.job(b, 0)
	urgent.Priority = 1
	c.admit(b, urgent)
	waiting := queued(p)
	for b.Loop() {
		p.mu.Lock()
		p.dispatchLocked()
		p.mu.Unlock()
	}
	if urgent.worker != nil || queued(p) != waiting {
		b.Fatalf("%d waiting, the urgent job on %v; want every job still waiting (%d)", queued(p), urgent.worker, waiting)
	}
}
