package scheduler

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/request"
)

// A paused worker gets no job, though it is free: the jobs go to the
// workers not paused, or wait in the queue for one of them, and a
// continue hands the paused worker the jobs waiting.
func TestAPausedWorkerGetsNoJob(t *testing.T) {
	p, clock := poolOf(t, 2)
	cfg := config(LeastWork{}, 1)
	paused, already, err := p.PauseWorkers([]string{"http://a:1"})
	if err != nil || !slices.Equal(paused, []string{"http://a:1"}) || len(already) > 0 {
		t.Fatalf("pause of a: paused %v, already %v, %v", paused, already, err)
	}
	info := infoOf(t, p, "http://a:1")
	if info.State != Paused || info.Lifecycle != Serving || !info.PausedSince.Equal(clock.Now()) {
		t.Fatalf("a paused is %v (lifecycle %v) since %v; want paused, serving, since %v", info.State, info.Lifecycle, info.PausedSince, clock.Now())
	}
	if s, n := p.ServingCount(), p.PausedCount(); s != 1 || n != 1 {
		t.Fatalf("%d serving, %d paused; want 1 and 1", s, n)
	}
	first, on := choose(t, p, cfg, 1)
	if on != "b" {
		t.Fatalf("a job went to %s; want b, the worker not paused", on)
	}
	waiting, done := enqueue(t, p, cfg, 1, context.Background()) // b is busy, a is free but paused
	if continued, err := p.ContinueWorkers([]string{"http://a:1"}); err != nil || !slices.Equal(continued, []string{"http://a:1"}) {
		t.Fatalf("continue of a: %v, %v", continued, err)
	}
	if err := <-done; err != nil || waiting.ServedBy() != "http://a:1" {
		t.Fatalf("the job waiting got %q (%v) once a continued; want a", waiting.ServedBy(), err)
	}
	if info := infoOf(t, p, "http://a:1"); info.State != Serving || !info.PausedSince.IsZero() {
		t.Fatalf("a continued is %v, paused since %v; want serving, not paused", info.State, info.PausedSince)
	}
	p.Release(first, End{Worker: Succeeded})
}

// While every worker is paused a job waits, as during an update, rather
// than failing: queue_timeout bounds its wait where it is set.
func TestAJobWaitsWhileEveryWorkerIsPaused(t *testing.T) {
	p, _ := poolOf(t, 2)
	if _, _, err := p.PauseWorkers(p.URLs()); err != nil {
		t.Fatal(err)
	}
	cfg := config(LeastWork{}, 1)
	cfg.Timeout = time.Millisecond
	tk := p.NewTicket(cfg)
	tk.Job, tk.Cost = true, 1
	if err := p.Acquire(context.Background(), tk); !errors.Is(err, ErrQueueTimeout) {
		t.Fatalf("a job beside paused workers only: %v; want it to wait until queue_timeout", err)
	}
	cfg.Timeout = 0
	_, done := enqueue(t, p, cfg, 1, context.Background())
	if _, err := p.ContinueWorkers([]string{"http://b:1"}); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("the job waiting once b continued: %v", err)
	}
}

// A paused worker still counts as one that can make a kind of job: a
// video job arriving while the only video worker is paused waits for it
// rather than being refused for want of one.
func TestAPausedWorkerCanStillServeItsKind(t *testing.T) {
	p, _ := poolOf(t, 1)
	p.SetCapabilities("http://a:1", []string{"T2V"}, "video-model")
	if _, _, err := p.PauseWorkers(nil); err != nil {
		t.Fatal(err)
	}
	if !p.CanServe(request.VideoTask) {
		t.Fatal("with its only video worker paused, the pool says it serves no video")
	}
}

// Pausing a paused worker changes nothing, not even since when it is
// paused; a name the pool lacks pauses none of those named, and continues
// none either.
func TestPausingTwiceKeepsTheFirstPause(t *testing.T) {
	p, clock := poolOf(t, 2)
	first := clock.Now()
	p.PauseWorkers([]string{"http://a:1"})
	clock.advance(time.Minute)
	paused, already, err := p.PauseWorkers([]string{"http://b:1", "http://a:1", "http://b:1"})
	if err != nil || !slices.Equal(paused, []string{"http://b:1"}) || !slices.Equal(already, []string{"http://a:1"}) {
		t.Fatalf("pause of b and a: paused %v, already %v, %v; want b, and a already", paused, already, err)
	}
	if since := infoOf(t, p, "http://a:1").PausedSince; !since.Equal(first) {
		t.Fatalf("a paused again shows paused since %v; want %v", since, first)
	}
	p.ContinueWorkers([]string{"http://b:1"})
	if _, _, err := p.PauseWorkers([]string{"http://b:1", "http://x:1"}); !errors.Is(err, ErrUnknownWorker) {
		t.Fatalf("a pause naming a worker the pool lacks: %v; want ErrUnknownWorker", err)
	}
	if _, err := p.ContinueWorkers([]string{"http://a:1", "http://x:1"}); !errors.Is(err, ErrUnknownWorker) {
		t.Fatalf("a continue naming a worker the pool lacks: %v; want ErrUnknownWorker", err)
	}
	if got := p.PausedWorkers(); !slices.Equal(got, []string{"http://a:1"}) {
		t.Fatalf("paused after the calls that named an unknown worker: %v; want a alone, as before them", got)
	}
}

// An update, a sleep and a wake move a paused worker through their
// states and leave it paused; an operator's hold or release ends the
// pause.
func TestAPauseOutlivesUpdatesSleepAndWake(t *testing.T) {
	p, _ := poolOf(t, 2)
	p.PauseWorkers([]string{"http://a:1"})
	up := Update{Path: DiskUpdatePath, Version: "step-1", Mode: ModeDrain, Body: []byte(`{"model_path":"/ckpt/1"}`)}
	if targets, _ := p.BeginUpdate(up); !slices.Equal(targets, []string{"http://a:1", "http://b:1"}) {
		t.Fatalf("an update goes to %v; want both workers, the paused one too", targets)
	}
	p.SetStates([]string{"http://a:1"}, Updating)
	if st := infoOf(t, p, "http://a:1").State; st != Updating {
		t.Fatalf("a paused worker loading weights shows %v; want updating", st)
	}
	applyUpdate(p, DiskUpdatePath, up.Version, string(up.Body))
	if info := infoOf(t, p, "http://a:1"); info.State != Paused || info.Version != "step-1" {
		t.Fatalf("a paused worker after the update is %v on %q; want paused on step-1", info.State, info.Version)
	}
	p.Moved([]string{"http://a:1"}, Sleeping)
	if st := infoOf(t, p, "http://a:1").State; st != Sleeping {
		t.Fatalf("a paused worker put to sleep shows %v", st)
	}
	p.Moved([]string{"http://a:1"}, Serving)
	if st := infoOf(t, p, "http://a:1").State; st != Paused {
		t.Fatalf("a paused worker woken shows %v; want paused", st)
	}
	p.SetDead("http://a:1", false)
	if info := infoOf(t, p, "http://a:1"); info.State != Serving || !info.PausedSince.IsZero() {
		t.Fatalf("a paused worker an operator let serve is %v, paused since %v; want serving", info.State, info.PausedSince)
	}
}

// A pause is in the fleet's record: a router that starts again on it
// keeps the workers paused since when they were, and a standby follows
// the record's pauses as they come and go.
func TestAPauseOutlivesARestart(t *testing.T) {
	before, clock := poolOf(t, 2)
	registerRaw(before, "http://r:1")
	before.PauseWorkers([]string{"http://a:1", "http://r:1"})
	since := clock.Now()
	rec := throughStorage(t, before.Record())

	after := newPool(t.Name())
	after.Declare([]string{"http://a:1", "http://b:1"})
	after.Restore(rec)
	after.RecordProbe("http://r:1", nil, testHealth) // read back, out until a probe passes
	for u, want := range map[string]State{"http://a:1": Paused, "http://b:1": Serving, "http://r:1": Paused} {
		info := infoOf(t, after, u)
		if info.State != want || (want == Paused) != info.PausedSince.Equal(since) {
			t.Errorf("%s read back is %v, paused since %v; want %v (paused since %v)", u, info.State, info.PausedSince, want, since)
		}
	}

	standby := newPool(t.Name())
	standby.Declare([]string{"http://a:1", "http://b:1"})
	standby.Mirror(rec)
	if got := standby.PausedWorkers(); !slices.Equal(got, []string{"http://a:1", "http://r:1"}) {
		t.Fatalf("a standby mirrors %v as paused; want a and r", got)
	}
	before.ContinueWorkers([]string{"http://a:1"})
	standby.Mirror(throughStorage(t, before.Record()))
	if got := standby.PausedWorkers(); !slices.Equal(got, []string{"http://r:1"}) {
		t.Fatalf("a standby mirrors %v as paused once a continued; want r alone", got)
	}
}
