package scheduler

import (
	"context"
	"fmt"
	"testing"
	"time"
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
					p.assignLocked(&Ticket{pool: p, cfg: cfg, Job: true, Cost: 10}, w)
				}
				t := &Ticket{pool: p, cfg: cfg, Job: true, Cost: 20}
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
				p.assignLocked(&Ticket{pool: p, cfg: cfg, Job: true, Cost: 10}, w)
			}
			for i := range 800 {
				t := &Ticket{pool: p, cfg: cfg, Job: true, Cost: float64(10 + i%7), Tenant: fmt.Sprint("tenant-", i%8)}
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
				t := Ticket{pool: p, cfg: cfg, Job: true, Cost: 20}
				if err := p.Acquire(ctx, &t); err != nil {
					b.Fatal(err)
				}
				p.Release(&t, Succeeded)
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
		p.assignLocked(&Ticket{pool: p, cfg: cfg, Job: true, Cost: 10, Tenant: fmt.Sprint("tenant-", i%64)}, w)
	}
	for i := range 10_000 {
		t := &Ticket{pool: p, cfg: cfg, Job: true, Cost: float64(10 + i%7), Tenant: fmt.Sprint("tenant-", i%64)}
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
