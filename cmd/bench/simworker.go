package main

import (
	"cmp"
	"context"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/answer"
	"github.com/miles-rollout/miles-diffusion-router/internal/attempt"
	"github.com/miles-rollout/miles-diffusion-router/internal/jobkinds"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// The simulated workers, and the proxy in front of them: a worker runs
// the attempts sent to it one at a time, in the order they came, each
// for its true time; the proxy (the attempts' Next) waits for its
// attempt's answer, or gives up as its context ends, as reverse_proxy
// does. A worker cannot stop a generation: one whose proxy gave up is
// computed all the same.

// How a hung worker answers, after its first job (--hang): one worker in
// hangEvery hangs, its /health still answering.
const (
	hangSilent = "silent" // it answers no more: the job it is on never ends, and none after it begins
	hangStall  = "stall"  // each answer stops halfway: the header and half the body, then nothing
	hangEvery  = 64
)

// The router's defaults the simulation runs with (README, reference.md).
var (
	simHealth = scheduler.HealthConfig{
		Interval: 10 * time.Second, Timeout: 5 * time.Second, Fails: 3, Passes: 2,
		StallFactor: 5, MaxFails: 3, FailWindow: 30 * time.Second,
		EjectTime: 10 * time.Second, MaxEjectTime: 5 * time.Minute, MaxEjectionPercent: 50,
	}
	simStallTimeout = 30 * time.Second // answer_stall_timeout
	simHeld         = int64(32 << 20)  // max_held_answer
)

// simURL is the endpoint of the simulation's jobs: RL rollouts, answered
// in JSON when done, hedged.
var simURL = &url.URL{Scheme: "http", Host: "router", Path: "/v1/diffusion/generate"}

// simBody is a job's body, and simAnswer its answer.
var (
	simBody   = []byte(`{"prompt":"a cat","width":1024,"height":1024,"num_inference_steps":20}`)
	simAnswer = []byte(`{"images":["iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"],"seed":1}`)
)

// callState is where an attempt is at its worker.
type callState int

const (
	callComputing callState = iota // sent, not answered
	callAnswered                   // its worker answered in full
	callHalf                       // its worker began its answer and stopped halfway
	callStalled                    // its answer stopped halfway and its proxy waits for more
	callCancelled                  // its context ended before its answer did
)

// simCall is one attempt at its worker.
type simCall struct {
	ctx    context.Context
	g      *simGoroutine
	cost   float64
	worker int
	begin  time.Duration // when its worker began it
	state  callState
	wrote  bool // its answer began
}

// waits reports whether the proxy still waits for more of c's answer.
func (c *simCall) waits() bool { return c.state == callComputing || c.state == callStalled }

// simWorker is a worker of the simulation.
type simWorker struct {
	speed  float64
	hangs  bool       // it hangs after its first job (see --hang)
	calls  []*simCall // sent to it, not yet done; it runs the first
	served int        // attempts it finished
}

// ServeHTTP is the attempts' Next: the proxy sends r to the worker its
// ticket holds and waits, its turn over, for the answer or its context's
// end.
func (s *schedSim) ServeHTTP(w http.ResponseWriter, r *http.Request) error {
	t := scheduler.TicketFrom(r.Context())
	g := s.tasks[t]
	call := &simCall{ctx: r.Context(), g: g, cost: t.Cost, worker: s.byURL[t.ServedBy()]}
	s.send(call)
	for {
		g.call = call
		s.yield(g)
		g.call = nil
		switch call.state {
		case callAnswered:
			g.task.answers = append(g.task.answers, simCall{worker: call.worker, begin: call.begin})
			return writeAnswer(w, simAnswer)
		case callHalf:
			call.state, call.wrote = callStalled, true
			s.watch(g.task)
			if err := writeAnswer(w, simAnswer[:len(simAnswer)/2]); err != nil {
				return err
			}
		case callCancelled:
			if call.wrote {
				panic(http.ErrAbortHandler) // as reverse_proxy aborts an answer that broke off
			}
			return r.Context().Err()
		}
	}
}

// writeAnswer writes a worker's 200 answer, of which body is all or the
// first part.
func writeAnswer(w http.ResponseWriter, body []byte) error {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(simAnswer)))
	w.WriteHeader(http.StatusOK)
	_, err := w.Write(body)
	return err
}

// send puts call on its worker's list; an idle worker begins it now.
func (s *schedSim) send(call *simCall) {
	wk := &s.workers[call.worker]
	wk.calls = append(wk.calls, call)
	if len(wk.calls) == 1 {
		s.begin(call.worker)
	}
}

// begin runs worker w's first attempt for its true time; a silent hung
// worker never ends it.
func (s *schedSim) begin(w int) {
	wk := &s.workers[w]
	call := wk.calls[0]
	call.begin = s.elapsed()
	if wk.hangs && wk.served > 0 && s.hang == hangSilent {
		return
	}
	s.clk.AfterFunc(time.Duration(call.cost/wk.speed*float64(s.unit)), func() { s.end(w) })
}

// end ends worker w's running attempt: its proxy gets the answer, unless
// it gave up, and the worker begins its next.
func (s *schedSim) end(w int) {
	wk := &s.workers[w]
	call := wk.calls[0]
	wk.calls = wk.calls[1:]
	if call.state == callComputing {
		call.state = callAnswered
		if wk.hangs && wk.served > 0 {
			call.state = callHalf
		}
		s.ready(call.g)
	}
	wk.served++
	if len(wk.calls) > 0 {
		s.begin(w)
	}
}

// jobPool is the pool as one job's attempts use it: the pool itself, but
// that the conductor hears of its copies.
type jobPool struct {
	simPool
	s    *schedSim
	task *schedTask
}

// HedgeCopy is the pool's; a copy it gives starts a goroutine of attempt's.
func (p jobPool) HedgeCopy(t *scheduler.Ticket) *scheduler.Ticket {
	c := p.simPool.HedgeCopy(t)
	if c != nil {
		p.s.tasks[c] = p.s.start(p.task)
		p.task.live++
		p.s.starting++
		p.s.watch(p.task)
	}
	return c
}

// EndHedge is the pool's, and the last a copy's goroutine does.
func (p jobPool) EndHedge() {
	p.simPool.EndHedge()
	p.s.copyEnded(p.task)
}

// newRunner is the Runner of the simulation's jobs, as the router makes
// it (see the root package's Provision), with the proxy of simWorker.
func (s *schedSim) newRunner() attempt.Runner {
	counters := func(name, label string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: name}, []string{label})
	}
	return attempt.Runner{
		Pool: s.pool, Kinds: jobkinds.New(s.pool), Budget: answer.NewBudget(simHeld, 1<<50),
		Proxy: attempt.Proxy{
			NeverSent: func(error) bool { return false }, ClientLeft: func(error) bool { return false },
			Vars:     func(context.Context) map[string]any { return nil },
			WithVars: func(ctx context.Context, _ map[string]any) context.Context { return ctx },
		},
		StallTimeout: simStallTimeout,
		Metrics: attempt.Metrics{Reruns: counters("reruns", "cause"), Broken: counters("broken", "delivery"),
			Streamed: counters("streamed", "reason"), Hedges: counters("hedges", "outcome")},
		Logger: zap.NewNop(), Clock: s.clk,
	}
}

// simRequest is a client's request for a job, in ctx.
func simRequest(ctx context.Context) *http.Request {
	return (&http.Request{Method: http.MethodPost, URL: simURL, Header: make(http.Header), Body: http.NoBody, Host: simURL.Host}).WithContext(ctx)
}

// simClient is the client's end of a job's answer.
type simClient struct {
	header http.Header
	status int
}

func (c *simClient) Header() http.Header         { return c.header }
func (c *simClient) Write(b []byte) (int, error) { return len(b), nil }
func (c *simClient) WriteHeader(status int)      { c.status = cmp.Or(c.status, status) }
