package scheduler

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/request"
)

// The queue's index changes how a dispatch finds the next job, not which
// job it finds: on random pools and queues (priorities, tenants, tasks,
// pins, versions, adapters, jobs tried elsewhere, queue orders), every
// job each dispatch pass hands out, and to which worker, is the one a
// walk of the whole queue in order would hand out, asking the chain about
// every job until a free worker may take one.
func TestDispatchTakesTheJobsAWalkOfTheQueueWould(t *testing.T) {
	for seed := range uint64(40) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			r := newRandomQueue(t, seed)
			for round := range 60 {
				r.freeOne()
				r.arrive(r.rng.IntN(4))
				r.checkPass(t, round)
			}
		})
	}
}

// randomQueue is a pool of a few workers of random tasks, versions and
// adapters, all busy, with random jobs waiting.
type randomQueue struct {
	p       *Pool
	cfg     *Config
	rng     *rand.Rand
	tenants bool
	running []*Ticket
}

func newRandomQueue(t *testing.T, seed uint64) *randomQueue {
	rng := rand.New(rand.NewPCG(seed, 7))
	p, _ := poolOf(t, 6)
	orders := []QueueOrder{FIFO{}, LargestFirst{}, Adaptive{}}
	r := &randomQueue{p: p, rng: rng, tenants: seed%2 == 0,
		cfg: &Config{Strategy: LeastWork{}, MaxInflight: 1 + rng.IntN(2), MaxQueue: 1 << 20, Order: orders[rng.IntN(len(orders))]}}
	if seed%3 == 0 {
		p.DeclareAdapters([]Adapter{{Name: "a", Path: "/a"}, {Name: "b", Path: "/b"}}, placementConfig(0))
	}
	p.mu.Lock()
	for i, w := range p.workers {
		w.caps.makes = []request.Tasks{request.TasksOf([]string{"T2I"}), request.TasksOf([]string{"T2V"}), request.TasksOf([]string{"T2I", "T2V"})}[rng.IntN(3)]
		w.life.version = []string{"v1", "v2"}[rng.IntN(2)]
		w.load.speed.Observe(float64(1+i%3), 1e9, 0)
		if p.placement.on {
			pol := []*policy{&p.placement.base, p.placement.policies["a"], p.placement.policies["b"]}[rng.IntN(3)]
			w.adapter = workerAdapter{known: true, holds: pol, publish: pol.publish}
		}
	}
	p.mu.Unlock()
	for range 12 { // every worker busy, some with more than one job
		r.arrive(1)
	}
	r.arrive(20)
	return r
}

// arrive adds n random jobs: to the jobs running while a worker has a
// slot for them, to the queue after.
func (r *randomQueue) arrive(n int) {
	p, rng := r.p, r.rng
	p.mu.Lock()
	defer p.mu.Unlock()
	for range n {
		tk := &Ticket{pool: p, cfg: r.cfg, Request: Request{Job: true, Cost: float64(1 + rng.IntN(9)), Priority: rng.IntN(3),
			Task: []request.Task{request.ImageTask, request.VideoTask}[rng.IntN(2)]}}
		switch rng.IntN(8) {
		case 0:
			tk.Pin = p.workers[rng.IntN(len(p.workers))].url
		case 1:
			tk.WantVersion = "v2"
		case 2:
			tk.tried = []*worker{p.workers[rng.IntN(len(p.workers))]}
		}
		if r.tenants {
			tk.Tenant = fmt.Sprint("t", rng.IntN(4))
			p.joinTenantLocked(tk)
		}
		if p.placement.on {
			tk.policy = []*policy{&p.placement.base, p.placement.policies["a"], p.placement.policies["b"]}[rng.IntN(3)]
		}
		p.seq++
		tk.seq, tk.arrived = p.seq, p.now().UnixNano()
		p.noteQueueLengthLocked(tk)
		tk.key = tk.cfg.order().Key(p.orderedLocked(tk))
		if w, _ := p.chooseLocked(tk); w != nil && p.queue.n == 0 {
			p.assignLocked(tk, w)
			r.running = append(r.running, tk)
		} else {
			p.enqueueLocked(tk)
		}
	}
}

// freeOne ends a random running job, without a dispatch.
func (r *randomQueue) freeOne() {
	if len(r.running) == 0 {
		return
	}
	i := r.rng.IntN(len(r.running))
	tk := r.running[i]
	r.running = slices.Delete(r.running, i, i+1)
	r.p.mu.Lock()
	r.p.freeLocked(tk, End{Worker: Succeeded})
	r.p.mu.Unlock()
}

// checkPass runs a dispatch pass a job at a time, each checked against
// a walk of the queue.
func (r *randomQueue) checkPass(t *testing.T, round int) {
	p := r.p
	p.mu.Lock()
	defer p.mu.Unlock()
	p.queue.pass++
	for {
		want, wantW := r.walkLocked()
		got, gotW := p.nextLocked()
		if got != want || gotW != wantW {
			t.Fatalf("round %d: the index gave %v to %v; a walk of the queue, %v to %v", round, jobOf(got), gotW, jobOf(want), wantW)
		}
		if gotW == nil {
			return
		}
		p.dequeueLocked(got)
		p.handOutLocked(got, gotW)
		r.running = append(r.running, got.t)
	}
}

// walkLocked is the job the next free worker goes to, and the worker, as
// a walk of every waiting job in dispatch order finds them: the order of
// the tenants' shares while tenants are on (priority, then the tenant's
// counter and first job), compare order within a tenant.
func (r *randomQueue) walkLocked() (*waiter, *worker) {
	p := r.p
	jobs := slices.Collect(p.queue.jobs())
	first := make(map[*tenant]*Ticket)
	for _, wt := range jobs {
		if tn := wt.t.tenant; tn != nil && (first[tn] == nil || wt.t.before(first[tn])) {
			first[tn] = wt.t
		}
	}
	slices.SortFunc(jobs, func(a, b *waiter) int {
		ta, tb := a.t.tenant, b.t.tenant
		if a.t.Priority != b.t.Priority || ta == tb {
			return a.t.compare(b.t)
		}
		return cmp.Or(cmp.Compare(ta.served, tb.served), cmp.Compare(first[ta].seq, first[tb].seq))
	})
	for _, wt := range jobs {
		w, anyFree := p.chooseLocked(wt.t)
		if w != nil {
			return wt, w
		}
		if !anyFree {
			return nil, nil
		}
	}
	return nil, nil
}

// jobOf describes wt's job for a failure.
func jobOf(wt *waiter) string {
	if wt == nil {
		return "no job"
	}
	return fmt.Sprintf("job %d (priority %d, tenant %s)", wt.t.seq, wt.t.Priority, wt.t.TenantOf())
}
