package scheduler

import (
	"math/bits"
	"reflect"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/request"
)

// A worker that breaks one constraint of the eligibility chain is refused
// by every user of the chain that asks it: dispatch, hedging, the backlog
// and placement give it nothing, and count it for nothing. Each user
// leaves out only what its question has no use for. A new constraint
// needs its case in breaks; every user then refuses the worker that
// breaks it. A constraint broken by what the job asks for puts the job in
// another class of the queue (classOf): jobs of one class must break the
// same constraints.
func TestEligibilityChain(t *testing.T) {
	cfg := config(LeastWork{}, 1)
	// breaks makes worker w break one constraint for tk's job, and only it.
	breaks := map[constraint]func(p *Pool, w *worker, tk *Ticket){
		hasSlot: func(p *Pool, w *worker, _ *Ticket) {
			p.assignLocked(&Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 10}}, w) // max_inflight 1
		},
		isServing: func(_ *Pool, w *worker, _ *Ticket) { w.health.down = true },
		makesTask: func(p *Pool, w *worker, _ *Ticket) { p.SetCapabilities(w.url, []string{"T2V"}, "m") },
		isPinned:  func(_ *Pool, _ *worker, tk *Ticket) { tk.Pin = "http://elsewhere:1" },
		onVersion: func(_ *Pool, _ *worker, tk *Ticket) { tk.WantVersion = "m2" },
		untried:   func(_ *Pool, w *worker, tk *Ticket) { tk.tried = []*worker{w} },
		holdsAdapter: func(p *Pool, w *worker, tk *Ticket) {
			p.placement.on, tk.policy = true, &p.placement.base
			w.adapter = workerAdapter{known: true, holds: &p.placement.stray}
		},
		freshEnough: func(p *Pool, _ *worker, tk *Ticket) {
			p.fleet.learnedLocked("m2") // the worker is on none the fleet has had
			tk.Staleness, _ = Staleness(MaxStaleness)
		},
	}
	users := []struct {
		name    string
		ignores constraint                                // what its question leaves out
		takes   func(p *Pool, w *worker, tk *Ticket) bool // whether it gives tk's job to w, or counts w for it
	}{
		{"dispatch", 0, func(p *Pool, w *worker, tk *Ticket) bool {
			p.mu.Lock()
			defer p.mu.Unlock()
			got, _ := p.chooseLocked(tk)
			return got == w
		}},
		{"hedge", 0, func(p *Pool, _ *worker, tk *Ticket) bool {
			return p.HedgeCopy(tk) != nil // tk's own attempt failed while copies of it run
		}},
		// A slot frees up and an adapter is placed in the time the
		// backlog plays out.
		{"backlog", hasSlot | holdsAdapter, func(p *Pool, _ *worker, tk *Ticket) bool {
			p.mu.Lock()
			defer p.mu.Unlock()
			before := p.copyBacklogLocked(new(backlogView)).playOut(nil)
			p.enqueueLocked(tk)
			return p.copyBacklogLocked(new(backlogView)).playOut(nil) > before
		}},
		// Placement asks whether some worker that may serve the job is
		// still in placement: whether it is busy or out of service now
		// does not say, and which adapter it holds is the question.
		{"placement", hasSlot | isServing | holdsAdapter, func(p *Pool, w *worker, tk *Ticket) bool {
			w.adapter.unread, w.adapter.known = FailuresOut, false
			if tk.policy == nil {
				tk.policy = &p.placement.base
			}
			p.mu.Lock()
			defer p.mu.Unlock()
			return p.unservableLocked(tk, p.now().UnixNano()) != nil
		}},
	}
	// setup is a pool of one worker, w, that may take tk's job, then made
	// to break what breaks.
	setup := func(t *testing.T, c constraint) (*Pool, *worker, *Ticket) {
		p, _ := poolOf(t, 1)
		w := p.workers[0]
		tk := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 10, Task: request.ImageTask}}
		if c == 0 {
			return p, w, tk
		}
		asked := *tk
		breaks[c](p, w, tk)
		if !reflect.DeepEqual(asked, *tk) && classOf(&asked) == classOf(tk) {
			t.Fatalf("breaking %v through what the job asks for leaves it in its class: add what %v reads to classOf", c, c)
		}
		now := p.now().UnixNano()
		for d := constraint(1); d < chainEnd; d <<= 1 {
			if got := p.brokenLocked(tk, w, now, question{asks: d}); got != 0 != (d == c) {
				t.Fatalf("breaking %v, the worker breaks %v: %v", c, d, got)
			}
		}
		return p, w, tk
	}

	for _, u := range users {
		p, w, tk := setup(t, 0)
		if !u.takes(p, w, tk) {
			t.Fatalf("%s refuses a worker that breaks no constraint", u.name)
		}
	}
	if n := bits.TrailingZeros16(uint16(chainEnd)); len(constraintNames) != n {
		t.Fatalf("%d constraints named; the chain has %d", len(constraintNames), n)
	}
	for c := constraint(1); c < chainEnd; c <<= 1 {
		if breaks[c] == nil {
			t.Fatalf("nothing breaks constraint %v: add its case to breaks", c)
		}
		for _, u := range users {
			t.Run(c.String()+"/"+u.name, func(t *testing.T) {
				p, w, tk := setup(t, c)
				if took, want := u.takes(p, w, tk), u.ignores&c != 0; took != want {
					t.Fatalf("%s takes a worker that breaks %v: %v; want %v", u.name, c, took, want)
				}
			})
		}
	}
}
