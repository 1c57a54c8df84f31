package main

import (
	"cmp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// The earliest-finish schedule takes the longest job first, each to the
// worker that ends it first.
func TestEarliestFinish(t *testing.T) {
	// 4 to the fast worker (ends at 2), 3 to the slow (3), 3 to the fast
	// (3.5), 2 to the fast (4.5): the slow one would end it at 5.
	if got := earliestFinish([]float64{3, 2, 4, 3}, []float64{1, 2}, time.Second); got != 4500*time.Millisecond {
		t.Fatalf("makespan %s; want 4.5s", got)
	}
}

// The simulation runs the router's pool: every job of a batch ends, each
// worker runs one job at a time, none before it arrived, and the pool,
// learning the speeds from nothing, gives the fast workers the larger
// share of the work and ends near the earliest-finish schedule.
func TestScheduleRunsThePool(t *testing.T) {
	speeds := []float64{1, 2, 1, 2}
	jobs := makeJobs(mixes["heavy"], 256, 1)
	tasks := schedTasks(jobs, nil)
	unit := 10 * time.Millisecond
	newSchedSim(speeds, scheduler.LeastWork{}, scheduler.LargestFirst{}, unit, len(tasks)).run(tasks)

	busyUntil := make([]time.Duration, len(speeds))
	done := make([]float64, len(speeds))
	costs := make([]float64, len(tasks))
	for i, task := range tasks { // in the order they were handed out per worker
		costs[i] = task.cost
		done[task.worker] += task.cost
	}
	for _, task := range sortedByStart(tasks) {
		if task.end == 0 || task.start < task.arrival || task.start < busyUntil[task.worker] {
			t.Fatalf("task %+v: ends, begins after its arrival and after its worker's job before it (%s)", task, busyUntil[task.worker])
		}
		busyUntil[task.worker] = task.end
	}
	if done[1] < 1.5*done[0] || done[3] < 1.5*done[2] {
		t.Fatalf("work done by worker: %v; want the speed-2 ones near twice the others'", done)
	}
	ef := earliestFinish(costs, speeds, unit)
	if span := makespan(tasks); span < ef || span > ef*11/10 {
		t.Fatalf("makespan %s; want from the earliest-finish schedule's %s to 1.1 times it", span, ef)
	}
}

func sortedByStart(tasks []*schedTask) []*schedTask {
	out := append([]*schedTask(nil), tasks...)
	slices.SortStableFunc(out, func(a, b *schedTask) int { return cmp.Compare(a.start, b.start) })
	return out
}

// A schedule run reports every fleet and strategy asked for, and says why
// a strategy it cannot run did not run.
func TestScheduleMode(t *testing.T) {
	o, err := parseFlags([]string{"--mode", "schedule", "--fleets", "2,4", "--per-worker", "8", "--strategies", "least_work/fifo,least_work,caddy/least_conn"})
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	benchSchedule(o, &out)
	rows := map[string]string{} // "workers jobs strategy" -> batch ÷EF
	for line := range strings.Lines(out.String()) {
		if f := strings.Fields(line); len(f) >= 4 {
			rows[strings.Join(f[:3], " ")] = f[3]
		}
	}
	for _, want := range []string{"2 16 least_work/fifo", "4 32 least_work/fifo", "4 32 least_work"} {
		if ratio, err := strconv.ParseFloat(rows[want], 64); err != nil || ratio < 1 {
			t.Fatalf("the report's row %q reads %q; want a ratio of at least 1:\n%s", want, rows[want], out.String())
		}
	}
	if rows["4 32 caddy/least_conn"] != "not" {
		t.Fatalf("the report's row of caddy/least_conn does not say it did not run:\n%s", out.String())
	}
	if !strings.Contains(out.String(), "caddy/least_conn not run: the schedule mode runs diffusion_router's scheduler") {
		t.Fatalf("the report does not say why caddy/least_conn did not run:\n%s", out.String())
	}
}
