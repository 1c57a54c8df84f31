package main

import (
	"cmp"
	"context"
	"fmt"
	"net/http"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/attempt"
	"github.com/miles-rollout/miles-diffusion-router/internal/clock"
	"github.com/miles-rollout/miles-diffusion-router/internal/jobkinds"
	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// The schedule mode runs the router's own scheduler (the pool itself:
// its queue, its dispatch, its learning of speeds, its timers) and its
// attempts (internal/attempt: held answers, hedged copies, stall watches,
// re-runs) on a virtual clock, with no HTTP and no sleeping: each worker
// is a FIFO of the attempts the pool sent it that runs the first for its
// true time (cost × unit ÷ speed), and the clock jumps from one event to
// the next (see conductor.go). What it measures is the scheduler's
// decisions alone, whatever the machine: 65,536 jobs on 1,024 workers
// take seconds of CPU.

// simEpoch is where the virtual clock starts.
var simEpoch = time.Unix(1_000_000, 0)

// simHorizon is the longest virtual time a run may take: a job that no
// copy can rescue keeps its race looking for an idle worker for ever.
const simHorizon = 24 * time.Hour

// schedTask is one job of a simulated run, and its client.
type schedTask struct {
	t        *scheduler.Ticket
	r        *http.Request
	cost     float64       // cost units: the router's prediction and the job's true work alike
	worker   int           // the worker whose answer the client got
	arrival  time.Duration // from the run's start
	start    time.Duration // when that worker began it
	end      time.Duration // when the client got its answer
	status   int           // of the client's answer; 0: none (the run ended first)
	answers  []simCall     // the attempts that answered in full: worker and begin
	goros    []*simGoroutine
	live     int  // copies launched and not over
	awaiting bool // its goroutine waits for its copies to end (attempt.Runner.AwaitCopies)
	queued   bool // it waits in the pool's queue for its first worker
	watched  bool // in the run's list of jobs whose attempts may be cancelled
}

// schedSim is one simulated run: a pool on a virtual clock, the attempts
// of its jobs, and the workers they run on.
type schedSim struct {
	conductor
	pool    simPool
	runner  attempt.Runner
	cfg     *scheduler.Config
	unit    time.Duration // a cost unit's time at speed 1
	hang    string        // how the hung workers answer: "", hangSilent or hangStall
	workers []simWorker
	byURL   map[string]int
	route   request.Route
	tasks   map[*scheduler.Ticket]*simGoroutine // the goroutine of each attempt's ticket: the job's, or a copy's
}

// simPool is the view of the pool a simulation drives: what its jobs'
// arrivals and attempts use, and its figures.
type simPool interface {
	attempt.Pool
	jobkinds.Pool
	NewTicket(cfg *scheduler.Config) *scheduler.Ticket
	Admit(t *scheduler.Ticket, given func()) error
	Declare(urls []string)
	Stats() scheduler.Stats
	Close() error
}

// simConfig is how a simulated run's router is set up.
type simConfig struct {
	strategy   scheduler.Strategy
	order      scheduler.QueueOrder
	unit       time.Duration
	hedgeAfter float64 // 0: off
	hang       string  // "": no worker hangs
}

// newSchedSim makes a pool of len(speeds) workers on a virtual clock,
// dispatching by c's strategy and order with the router's defaults
// otherwise (max_inflight 1 for least_work, else none; max_attempts 3;
// the health and answer settings' defaults). The queue may hold every job
// of the run.
func newSchedSim(speeds []float64, c simConfig, jobs int) *schedSim {
	inflight := 0
	if _, ok := c.strategy.(scheduler.LeastWork); ok {
		inflight = 1
	}
	s := &schedSim{
		unit:    c.unit,
		hang:    c.hang,
		workers: make([]simWorker, len(speeds)),
		byURL:   make(map[string]int, len(speeds)),
		tasks:   make(map[*scheduler.Ticket]*simGoroutine),
		route:   request.Endpoints.Match(http.MethodPost, simURL),
		cfg: &scheduler.Config{
			Strategy: c.strategy, MaxInflight: inflight, Order: c.order, MaxQueue: jobs,
			MaxAttempts: 3, HedgeAfter: c.hedgeAfter, Health: &simHealth,
			Timeout: poolWaitMark, // no job times out: see poolWait
		},
	}
	s.conductor.init(clock.NewVirtual(simEpoch), jobs)
	s.pool = scheduler.NewOn(poolClock{s.clk, &s.conductor}, "schedule", zap.NewNop())
	urls := make([]string, len(speeds))
	for i := range urls {
		urls[i] = fmt.Sprintf("http://10.%d.%d.%d:30000", i>>16, i>>8&255, i&255)
		s.byURL[urls[i]] = i
		s.workers[i] = simWorker{speed: speeds[i], hangs: c.hang != "" && i%hangEvery == 0}
	}
	s.pool.Declare(urls)
	s.queued = func() int { return s.pool.Stats().Queued }
	s.runner = s.newRunner()
	return s
}

// run sends tasks at their arrivals and returns once every one has
// ended, or no more can.
func (s *schedSim) run(tasks []*schedTask) {
	for _, task := range tasks {
		s.clk.AfterFunc(task.arrival, func() { s.arrive(task) })
	}
	s.conduct()
	s.pool.Close()
}

func (s *schedSim) elapsed() time.Duration { return s.clk.Now().Sub(simEpoch) }

// arrive admits task's job to the pool, as a request's handler does, and
// starts its goroutine, which runs once the job has a worker.
func (s *schedSim) arrive(task *schedTask) {
	task.t = s.pool.NewTicket(s.cfg)
	task.t.Job, task.t.Cost, task.t.Route, task.t.Body = true, task.cost, s.route, simBody
	task.r = simRequest(task.t.WithCancel(context.Background()))
	g := s.start(task)
	s.tasks[task.t] = g
	go s.runJob(task, g)
	given := false
	if err := s.pool.Admit(task.t, func() {
		given = true
		if task.queued {
			task.queued = false
			s.admitWaiting--
		}
		s.ready(g)
	}); err != nil {
		panic(fmt.Sprintf("the simulated pool refused a job: %v", err)) // the queue holds every job
	}
	if !given {
		task.queued = true
		s.admitWaiting++
	}
}

// runJob runs task's attempts as the router's handler does once its job
// has a worker, when the conductor first lets it.
func (s *schedSim) runJob(task *schedTask, g *simGoroutine) {
	<-g.wake
	run := s.runner
	run.Pool = jobPool{s.pool, s, task}
	run.AwaitCopies = func(*scheduler.Ticket) func() { return s.awaitCopies(task) }
	w := &simClient{header: make(http.Header)}
	if err := run.Run(attempt.NewRecorder(w), task.r, task.t, s); err != nil && w.status == 0 {
		w.status = http.StatusBadGateway // as the handler answers the proxy's error
	}
	task.status, task.end = w.status, s.elapsed()
	task.worker = s.byURL[task.t.ServedBy()]
	for _, a := range task.answers {
		if a.worker == task.worker {
			task.start = a.begin
		}
	}
	s.finished(task)
}

// schedTasks turns jobs, and their arrivals (nil: all at once), into the
// tasks of a run.
func schedTasks(jobs []job, arrivals []time.Duration) []*schedTask {
	tasks := make([]*schedTask, len(jobs))
	for i, j := range jobs {
		tasks[i] = &schedTask{cost: j.cost()}
		if arrivals != nil {
			tasks[i].arrival = arrivals[i]
		}
	}
	return tasks
}

// makespan is when the last task ended; unanswered is how many never
// did (the run ended first).
func makespan(tasks []*schedTask) (last time.Duration, unanswered int) {
	for _, t := range tasks {
		if t.status == 0 {
			unanswered++
		}
		last = max(last, t.end)
	}
	return last, unanswered
}

// waits are the tasks' times from arrival to their worker's beginning
// them, in seconds.
func waits(tasks []*schedTask) []float64 {
	out := make([]float64, len(tasks))
	for i, t := range tasks {
		out[i] = (t.start - t.arrival).Seconds()
	}
	return out
}

// earliestFinish is the makespan of the schedule that knows every job's
// true time: jobs longest first, each on the worker that would finish it
// earliest (the fastest, then the first, on ties).
func earliestFinish(costs []float64, speeds []float64, unit time.Duration) time.Duration {
	sorted := slices.SortedFunc(slices.Values(costs), func(a, b float64) int { return cmp.Compare(b, a) })
	free := make([]float64, len(speeds)) // when each worker is free, in units of time at speed 1
	for _, c := range sorted {
		best := 0
		for w := range speeds {
			if free[w]+c/speeds[w] < free[best]+c/speeds[best] {
				best = w
			}
		}
		free[best] += c / speeds[best]
	}
	return time.Duration(slices.Max(free) * float64(unit))
}
