package main

import (
	"cmp"
	"context"
	"fmt"
	"net/http"
	"os"
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
	newSchedSim(speeds, simConfig{scheduler.LeastWork{}, scheduler.LargestFirst{}, unit, defaultHedgeAfter, ""}, len(tasks)).run(tasks)

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
	if span, _ := makespan(tasks); span < ef || span > ef*11/10 {
		t.Fatalf("makespan %s; want from the earliest-finish schedule's %s to 1.1 times it", span, ef)
	}
}

// hungRun runs 32 jobs on 4 workers, of which worker 0 hangs as hang
// says after its first job, with hedge_after after.
func hungRun(hang string, after float64) ([]*schedTask, *schedSim) {
	return hungRunOf(32, 10*time.Millisecond, hang, after)
}

// hungRunOf is hungRun with n jobs and a cost unit of unit.
func hungRunOf(n int, unit time.Duration, hang string, after float64) ([]*schedTask, *schedSim) {
	tasks := schedTasks(makeJobs(mixes["heavy"], n, 1), nil)
	s := newSchedSim([]float64{1, 2, 1, 2}, simConfig{scheduler.LeastWork{}, scheduler.Adaptive{}, unit, after, hang}, len(tasks))
	s.run(tasks)
	return tasks, s
}

// outcomes is what the client of each task got, when, and from which
// worker.
func outcomes(tasks []*schedTask) []string {
	out := make([]string, len(tasks))
	for i, task := range tasks {
		out[i] = fmt.Sprintf("%d from worker %d, begun %s, answered %s", task.status, task.worker, task.start, task.end)
	}
	return out
}

// A worker that hangs after its first job, its /health still answering,
// holds its next jobs for ever with hedge_after off; with it on, a copy
// on another worker answers each of them, on the virtual clock, and the
// run gives the same answers at the same times every time.
func TestAHedgeRescuesTheJobsOfAHungWorker(t *testing.T) {
	off, _ := hungRun(hangSilent, 0)
	if _, unanswered := makespan(off); unanswered == 0 {
		t.Fatalf("with hedge_after off, every job was answered: %q", outcomes(off))
	}
	on, sim := hungRun(hangSilent, defaultHedgeAfter)
	fromHung := 0
	for _, task := range on {
		if task.status != http.StatusOK {
			t.Fatalf("with hedges on, a job got %d; want every one answered: %q", task.status, outcomes(on))
		}
		if task.worker == 0 {
			fromHung++
		}
	}
	won := count(sim.runner.Metrics.Hedges, "won")
	if fromHung != 1 || won < 1 || won != float64(len(off)-countAnswered(off)) {
		t.Fatalf("%d answers from the hung worker, %g copies won, %d jobs unanswered without hedges; want 1 (its first job) and a copy's answer for each of the others: %q",
			fromHung, won, len(off)-countAnswered(off), outcomes(on))
	}
	again, _ := hungRun(hangSilent, defaultHedgeAfter)
	if !slices.Equal(outcomes(on), outcomes(again)) {
		t.Fatalf("the same run gave\n%q\nthen\n%q", outcomes(on), outcomes(again))
	}
}

// A worker whose answers stop halfway has each of its jobs after the
// first run again on another worker once answer_stall_timeout (30 s)
// passed without a byte, with hedge_after off, the same way every time.
func TestAStalledAnswerRunsAgainElsewhere(t *testing.T) {
	tasks, sim := hungRun(hangStall, 0)
	stalls := count(sim.runner.Metrics.Reruns, "stalled")
	if countAnswered(tasks) != len(tasks) || stalls < 1 {
		t.Fatalf("%d of %d jobs answered, %g run again after a stall; want all, and at least one: %q", countAnswered(tasks), len(tasks), stalls, outcomes(tasks))
	}
	if last, _ := makespan(tasks); last < simStallTimeout {
		t.Fatalf("the last answer came at %s, before a stall could be noticed (%s)", last, simStallTimeout)
	}
	again, _ := hungRun(hangStall, 0)
	if !slices.Equal(outcomes(tasks), outcomes(again)) {
		t.Fatalf("the same run gave\n%q\nthen\n%q", outcomes(tasks), outcomes(again))
	}
}

// With answers that stall and hedges on, and jobs long beside the stall
// timeout, jobs run again after a stall wait in the pool's queue for
// their next worker, and attempts that stalled wait for copies of their
// job still running (attempt.Runner.AwaitCopies): waits the conductor
// sees only through the pool's clock and that hook. Every job is answered,
// the same way every time.
func TestEveryWaitOfTheAttemptsEnds(t *testing.T) {
	tasks, sim := hungRunOf(64, 500*time.Millisecond, hangStall, defaultHedgeAfter)
	stalls, copies := count(sim.runner.Metrics.Reruns, "stalled"), count(sim.runner.Metrics.Hedges, "launched")
	if countAnswered(tasks) != len(tasks) || stalls < 1 || copies < 1 {
		t.Fatalf("%d of %d jobs answered, %g run again after a stall, %g copies; want all, and some of each: %q",
			countAnswered(tasks), len(tasks), stalls, copies, outcomes(tasks))
	}
	again, _ := hungRunOf(64, 500*time.Millisecond, hangStall, defaultHedgeAfter)
	if !slices.Equal(outcomes(tasks), outcomes(again)) {
		t.Fatalf("the same run gave\n%q\nthen\n%q", outcomes(tasks), outcomes(again))
	}
}

func countAnswered(tasks []*schedTask) int {
	n := 0
	for _, task := range tasks {
		if task.status == http.StatusOK {
			n++
		}
	}
	return n
}

func sortedByStart(tasks []*schedTask) []*schedTask {
	out := append([]*schedTask(nil), tasks...)
	slices.SortStableFunc(out, func(a, b *schedTask) int { return cmp.Compare(a.start, b.start) })
	return out
}

// A schedule run reports every fleet and strategy asked for, and says why
// a strategy it cannot run did not run.
func TestScheduleMode(t *testing.T) {
	o, err := parseFlags([]string{"--mode", "schedule", "--fleets", "2,4", "--per-worker", "8", "--open-jobs", "64", "--strategies", "least_work/fifo,least_work,caddy/least_conn"})
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	benchSchedule(o, &out)
	for _, want := range []string{"2 16 least_work/fifo", "4 32 least_work/fifo", "4 32 least_work"} {
		row := reportRow(out.String(), want)
		if len(row) < 4 {
			t.Fatalf("the report has no row %q:\n%s", want, out.String())
		}
		if ratio, err := strconv.ParseFloat(row[3], 64); err != nil || ratio < 1 {
			t.Fatalf("the report's row %q reads %q; want a ratio of at least 1:\n%s", want, row[3], out.String())
		}
	}
	if row := reportRow(out.String(), "4 32 caddy/least_conn"); len(row) < 4 || row[3] != "not" {
		t.Fatalf("the report's row of caddy/least_conn does not say it did not run:\n%s", out.String())
	}
	if !strings.Contains(out.String(), "caddy/least_conn not run: the schedule mode runs diffusion_router's scheduler") {
		t.Fatalf("the report does not say why caddy/least_conn did not run:\n%s", out.String())
	}
}

// The cluster mode runs Caddy and the fake workers as processes and
// reports, for each strategy, a batch that every job of ended.
func TestClusterMode(t *testing.T) {
	if testing.Short() {
		t.Skip("builds Caddy and the fake worker and runs them as processes")
	}
	o := testOptions(t, "--mode", "cluster", "--fleets", "2", "--per-worker", "4", "--unit-ms", "5")
	var out strings.Builder
	if err := benchCluster(context.Background(), o, &out); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"least_work", "caddy/least_conn"} {
		row := reportRow(out.String(), "2 8 "+name)
		if len(row) < 9 || row[7] != "0" {
			t.Fatalf("the report's row of %s is %q; want one with no job failed:\n%s", name, row, out.String())
		}
	}
}

// reportRow is the fields of the line of report whose fields begin with
// prefix's.
func reportRow(report, prefix string) []string {
	want := strings.Fields(prefix)
	for line := range strings.Lines(report) {
		if f := strings.Fields(line); len(f) >= len(want) && slices.Equal(f[:len(want)], want) {
			return f
		}
	}
	return nil
}

// processCPU reads a process's CPU time from /proc; the bench's own is
// positive and grows with work.
func TestProcessCPU(t *testing.T) {
	before := processCPU(os.Getpid())
	for end := time.Now().Add(50 * time.Millisecond); time.Now().Before(end); {
	}
	if after := processCPU(os.Getpid()); after <= before {
		t.Fatalf("the bench's CPU time went from %s to %s over 50 ms of work", before, after)
	}
}
