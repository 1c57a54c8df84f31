package scheduler

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"
)

// tracked makes a cancellable job of request id rid and registers it, as
// the router does before the job asks for a worker.
func tracked(t *testing.T, p *Pool, cfg *Config, rid string, cost float64) (*Ticket, context.Context) {
	t.Helper()
	tk := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: cost, RID: rid}}
	ctx := tk.WithCancel(context.Background())
	if err := p.Track(tk); err != nil {
		t.Fatalf("track %s: %v", rid, err)
	}
	return tk, ctx
}

// waiting starts job rid waiting for a worker; its Acquire's error arrives
// on the channel.
func waiting(t *testing.T, p *Pool, cfg *Config, rid string) (*Ticket, chan error) {
	t.Helper()
	tk, ctx := tracked(t, p, cfg, rid, 1)
	done := make(chan error, 1)
	n := queued(p)
	go func() { done <- p.Acquire(ctx, tk) }()
	waitQueued(t, p, n+1)
	return tk, done
}

func abortedBy(err error) *AbortedError {
	ae, _ := errors.AsType[*AbortedError](err)
	return ae
}

// A prefix ends a whole step: its waiting jobs leave the queue with the
// abort as their error and never get the worker that frees up, its running
// job's context ends, other steps' jobs go on, and a job of the step that
// arrives later is refused until the memory ends.
func TestAbortPrefixEndsAStep(t *testing.T) {
	p, clock := poolOf(t, 1)
	cfg := config(LeastWork{}, 1)
	running, runCtx := tracked(t, p, cfg, "step-7-a", 10)
	if err := p.Acquire(runCtx, running); err != nil {
		t.Fatal(err)
	}
	running.NoteSent()
	_, b := waiting(t, p, cfg, "step-7-b")
	other, otherDone := waiting(t, p, cfg, "step-8-a")
	_, c := waiting(t, p, cfg, "step-7-c")

	got := p.Abort(Abort{Prefix: "step-7-", By: "test", Memory: time.Minute})
	if got != (AbortCounts{Waiting: 2, Running: 1}) {
		t.Fatalf("abort counted %+v; want 2 waiting, 1 running", got)
	}
	for _, done := range []chan error{b, c} {
		if ae := abortedBy(<-done); ae == nil || ae.By != "test" {
			t.Fatal("a waiting job of the step did not end with the abort")
		}
	}
	if ae := abortedBy(CancelledBy(runCtx)); ae == nil || ae.RID != "step-7-a" {
		t.Fatalf("the running job's context ended with %v", context.Cause(runCtx))
	}
	p.Release(running, End{Worker: Abandoned})
	p.endGhost(running) // its predicted end
	if err := <-otherDone; err != nil || other.worker == nil {
		t.Fatalf("the other step's job got %v; want the worker", err)
	}

	late := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, RID: "step-7-z"}}
	ae := abortedBy(p.Track(late))
	if ae == nil || !ae.Until.Equal(clock.t.Add(time.Minute)) {
		t.Fatalf("a later job of the step was not refused until the memory ends: %v", ae)
	}
	clock.advance(time.Minute)
	if err := p.Track(late); err != nil {
		t.Fatalf("after the memory ended the step's job was refused: %v", err)
	}
	if s := p.AbortStats(); s != (AbortStats{Waiting: 2, Running: 1, Resent: 1}) {
		t.Fatalf("stats %+v", s)
	}
}

// An id is remembered even when no job has it now: its client may be
// between two tries.
func TestAbortRememberedIDRefusesItsResend(t *testing.T) {
	p, _ := poolOf(t, 1)
	cfg := config(LeastWork{}, 1)
	if got := p.Abort(Abort{RID: "r1", By: "test", Memory: time.Minute}); got != (AbortCounts{}) {
		t.Fatalf("abort of an id no job has counted %+v", got)
	}
	resend := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, RID: "r1"}}
	if abortedBy(p.Track(resend)) == nil {
		t.Fatal("the resend was not refused")
	}
	if err := p.Track(&Ticket{pool: p, cfg: cfg, Request: Request{Job: true, RID: "r10"}}); err != nil {
		t.Fatalf("an id that only starts like the aborted one was refused: %v", err)
	}
}

// A job aborted after it registered and before it asked for a worker gets
// none, though one is free: it counts as waiting.
func TestAbortBeforeAcquire(t *testing.T) {
	p, _ := poolOf(t, 1)
	cfg := config(LeastWork{}, 1)
	tk, ctx := tracked(t, p, cfg, "r1", 1)
	if got := p.Abort(Abort{RID: "r1", By: "test"}); got != (AbortCounts{Waiting: 1}) {
		t.Fatalf("counted %+v; want 1 waiting", got)
	}
	if abortedBy(p.Acquire(ctx, tk)) == nil || tk.worker != nil {
		t.Fatalf("the aborted job got worker %v", tk.worker)
	}
	if err := p.Track(&Ticket{pool: p, cfg: cfg, Request: Request{Job: true, RID: "r1"}}); err != nil {
		t.Fatalf("an abort with no memory refused a later job: %v", err)
	}
}

// abort_all ends every job, those sharing an id included, and remembers
// each one's id, not the jobs that come after.
func TestAbortAll(t *testing.T) {
	p, _ := poolOf(t, 1)
	cfg := config(LeastWork{}, 1)
	first, ctx := tracked(t, p, cfg, "same", 1)
	if err := p.Acquire(ctx, first); err != nil {
		t.Fatal(err)
	}
	_, twin := waiting(t, p, cfg, "same")
	_, other := waiting(t, p, cfg, "other")
	if got := p.Abort(Abort{All: true, By: "test", Memory: time.Minute}); got != (AbortCounts{Waiting: 2, Running: 1}) {
		t.Fatalf("counted %+v", got)
	}
	for _, done := range []chan error{twin, other} {
		if abortedBy(<-done) == nil {
			t.Fatal("a waiting job was not aborted")
		}
	}
	p.Untrack(first) // already taken out: a no-op
	if len(p.aborts.live) != 0 {
		t.Fatalf("%d ids still registered", len(p.aborts.live))
	}
	for rid, refused := range map[string]bool{"same": true, "other": true, "new": false} {
		if err := p.Track(&Ticket{pool: p, cfg: cfg, Request: Request{Job: true, RID: rid}}); (err != nil) != refused {
			t.Errorf("job %s after abort_all: %v; want refused=%v", rid, err, refused)
		}
	}
}

// Jobs sharing an id leave the registry one by one.
func TestUntrackJobsSharingAnID(t *testing.T) {
	p, _ := poolOf(t, 1)
	cfg := config(LeastWork{}, 1)
	var tks []*Ticket
	for range 3 {
		tk, _ := tracked(t, p, cfg, "same", 1)
		tks = append(tks, tk)
	}
	for _, i := range []int{1, 2, 0} {
		p.Untrack(tks[i])
	}
	if len(p.aborts.live) != 0 {
		t.Fatalf("%d ids still registered", len(p.aborts.live))
	}
	if got := p.Abort(Abort{RID: "same", By: "test"}); got != (AbortCounts{}) {
		t.Fatalf("an abort found %+v of jobs that had ended", got)
	}
}

// The memory is bounded: beyond MaxAbortedPrefixes the oldest prefix is
// forgotten first.
func TestAbortMemoryBounded(t *testing.T) {
	p, _ := poolOf(t, 1)
	cfg := config(LeastWork{}, 1)
	for i := range MaxAbortedPrefixes + 1 {
		p.Abort(Abort{Prefix: fmt.Sprintf("step-%d-", i), By: "test", Memory: time.Hour})
	}
	if err := p.Track(&Ticket{pool: p, cfg: cfg, Request: Request{Job: true, RID: "step-0-a"}}); err != nil {
		t.Fatalf("the oldest prefix is still remembered: %v", err)
	}
	if p.Track(&Ticket{pool: p, cfg: cfg, Request: Request{Job: true, RID: "step-1-a"}}) == nil {
		t.Fatal("the second oldest prefix was forgotten")
	}
}

// An aborted job that had been passed over by higher priorities for
// longer than MaxPassedOver is not handed the next worker: it left the
// queue.
func TestAbortedJobPassedOverGetsNoWorker(t *testing.T) {
	p, clock := poolOf(t, 1)
	cfg := config(LeastWork{}, 1)
	cfg.MaxPassedOver = 10 * time.Second
	running, _ := choose(t, p, cfg, 1)
	low, lowDone := waiting(t, p, cfg, "low")
	urgent, urgentDone := enqueueAt(t, p, cfg, 1)
	clock.advance(time.Minute)
	p.Abort(Abort{RID: "low", By: "test"})
	if abortedBy(<-lowDone) == nil {
		t.Fatal("the passed-over job was not aborted")
	}
	p.Release(running, End{Worker: Succeeded})
	select {
	case err := <-urgentDone:
		if err != nil || urgent.worker == nil || low.worker != nil {
			t.Fatalf("the urgent job got %v; the aborted one worker %v", err, low.worker)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the worker went to the aborted job, not the urgent one")
	}
}
