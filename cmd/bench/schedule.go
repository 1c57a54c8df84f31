package main

import (
	"cmp"
	"fmt"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/clock"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// The schedule mode runs the router's own scheduler (the pool itself:
// its queue, its dispatch, its learning of speeds, its timers) on a
// virtual clock, with no HTTP and no sleeping: each worker is a FIFO of
// the jobs the pool gave it that runs the first for its true time (cost ×
// unit ÷ speed), and the clock jumps from one job's end to the next. What
// it measures is the scheduler's decisions alone, whatever the machine:
// 65,536 jobs on 1,024 workers take seconds of CPU.

// simEpoch is where the virtual clock starts.
var simEpoch = time.Unix(1_000_000, 0)

// schedTask is one job of a simulated run.
type schedTask struct {
	t       *scheduler.Ticket
	cost    float64       // cost units: the router's prediction and the job's true work alike
	worker  int           // the worker that ran it
	arrival time.Duration // from the run's start
	start   time.Duration // when its worker began it
	end     time.Duration // when its worker finished it
}

// schedSim is one simulated run: a pool on a virtual clock and the
// workers it hands jobs to.
type schedSim struct {
	clk    *clock.Virtual
	pool   simPool
	cfg    *scheduler.Config
	unit   time.Duration // a cost unit's time at speed 1
	speeds []float64     // each worker's true speed
	byURL  map[string]int
	queues [][]*schedTask // each worker's jobs in the order it got them; it runs the first
	given  []*schedTask   // handed a worker by the pool since the last settle
}

// simPool is the view of the pool a simulation drives.
type simPool interface {
	NewTicket(cfg *scheduler.Config) *scheduler.Ticket
	Admit(t *scheduler.Ticket, given func()) error
	Release(t *scheduler.Ticket, e scheduler.End) time.Duration
	Close() error
}

// newSchedSim makes a pool of len(speeds) workers on a virtual clock,
// dispatching by strategy and order with the router's defaults otherwise
// (max_inflight 1 for least_work, else none; max_attempts 3). The queue
// may hold every job of the run.
func newSchedSim(speeds []float64, strategy scheduler.Strategy, order scheduler.QueueOrder, unit time.Duration, jobs int) *schedSim {
	inflight := 0
	if _, ok := strategy.(scheduler.LeastWork); ok {
		inflight = 1
	}
	s := &schedSim{
		clk:    clock.NewVirtual(simEpoch),
		unit:   unit,
		speeds: speeds,
		byURL:  make(map[string]int, len(speeds)),
		queues: make([][]*schedTask, len(speeds)),
		cfg: &scheduler.Config{
			Strategy: strategy, MaxInflight: inflight, Order: order, MaxQueue: jobs,
			MaxAttempts: 3, Health: &scheduler.HealthConfig{},
		},
	}
	pool := scheduler.NewOn(s.clk, "schedule", zap.NewNop())
	urls := make([]string, len(speeds))
	for i := range urls {
		urls[i] = fmt.Sprintf("http://10.%d.%d.%d:30000", i>>16, i>>8&255, i&255)
		s.byURL[urls[i]] = i
	}
	pool.Declare(urls)
	s.pool = pool
	return s
}

// run sends tasks at their arrivals and returns once every one has
// ended.
func (s *schedSim) run(tasks []*schedTask) {
	for _, task := range tasks {
		s.clk.AfterFunc(task.arrival, func() { s.arrive(task) })
	}
	for s.clk.Step() {
	}
	s.pool.Close()
}

func (s *schedSim) elapsed() time.Duration { return s.clk.Now().Sub(simEpoch) }

// arrive admits task's job to the pool, as a request's handler does.
func (s *schedSim) arrive(task *schedTask) {
	task.t = s.pool.NewTicket(s.cfg)
	task.t.Job, task.t.Cost = true, task.cost
	if err := s.pool.Admit(task.t, func() { s.given = append(s.given, task) }); err != nil {
		panic(fmt.Sprintf("the simulated pool refused a job: %v", err)) // the queue holds every job
	}
	s.settle()
}

// settle puts the jobs the pool handed out on their workers: a worker
// that was idle begins its job now.
func (s *schedSim) settle() {
	for len(s.given) > 0 {
		task := s.given[0]
		s.given = s.given[1:]
		w := s.byURL[task.t.ServedBy()]
		task.worker = w
		s.queues[w] = append(s.queues[w], task)
		if len(s.queues[w]) == 1 {
			s.begin(w)
		}
	}
}

// begin runs worker w's first job for its true time.
func (s *schedSim) begin(w int) {
	task := s.queues[w][0]
	task.start = s.elapsed()
	took := time.Duration(task.cost / s.speeds[w] * float64(s.unit))
	s.clk.AfterFunc(took, func() { s.finish(w) })
}

// finish ends worker w's running job: the worker begins its next, and the
// pool hears of the answer, as the router does when it arrives.
func (s *schedSim) finish(w int) {
	task := s.queues[w][0]
	task.end = s.elapsed()
	s.queues[w] = s.queues[w][1:]
	if len(s.queues[w]) > 0 {
		s.begin(w)
	}
	s.pool.Release(task.t, scheduler.End{Worker: scheduler.Succeeded})
	s.settle()
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

// makespan is when the last task ended.
func makespan(tasks []*schedTask) time.Duration {
	var last time.Duration
	for _, t := range tasks {
		last = max(last, t.end)
	}
	return last
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
