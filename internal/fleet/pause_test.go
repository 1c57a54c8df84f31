package fleet

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/memstore"
)

// pausePool is a pool of the workers urls, its fleet and the config of
// its jobs: one at a time on a worker.
func pausePool(t *testing.T, urls ...string) (*scheduler.Pool, *Fleet, *scheduler.Config) {
	t.Helper()
	p := scheduler.New(t.Name(), zap.NewNop())
	t.Cleanup(func() { _ = p.Close() })
	p.Declare(urls)
	return p, New(p, zap.NewNop()), &scheduler.Config{Strategy: scheduler.LeastWork{}, MaxInflight: 1, MaxQueue: 10, Order: scheduler.FIFO{}}
}

// runningJob gives a job of cost to a worker of p and returns it.
func runningJob(t *testing.T, p *scheduler.Pool, cfg *scheduler.Config, cost float64) *scheduler.Ticket {
	t.Helper()
	tk := p.NewTicket(cfg)
	tk.Job, tk.Cost = true, cost
	if err := p.Acquire(context.Background(), tk); err != nil {
		t.Fatal(err)
	}
	return tk
}

// pauseAsync runs a pause of urls over f and delivers its results; one
// that fails fails t.
func pauseAsync(t *testing.T, f *Fleet, urls []string, cfg *Config) <-chan []Result {
	done := make(chan []Result, 1)
	go func() {
		results, err := f.PauseGeneration(context.Background(), urls, cfg)
		if err != nil {
			t.Errorf("the pause failed: %v", err)
		}
		done <- results
	}()
	return done
}

// messages are the messages of results, by worker.
func messages(t *testing.T, results []Result) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, r := range results {
		body, _ := r.Body.(map[string]any)
		msg, _ := body["message"].(string)
		if !r.OK || r.StatusCode != 200 || msg == "" {
			t.Fatalf("result %+v; want a success with a message", r)
		}
		out[r.WorkerURL] = msg
	}
	return out
}

// A pause with no worker named pauses them all at once and answers once
// the job one of them holds has ended.
func TestPauseAnswersOnceTheJobsHaveEnded(t *testing.T) {
	p, f, cfg := pausePool(t, "http://a:1", "http://b:1")
	job := runningJob(t, p, cfg, 1)
	done := pauseAsync(t, f, nil, &Config{DrainTimeout: time.Minute})
	if !testkit.WaitUntil(10*time.Second, func() bool { return len(p.PausedWorkers()) == 2 }) {
		t.Fatalf("paused %v; want both workers at once", p.PausedWorkers())
	}
	select {
	case results := <-done:
		t.Fatalf("the pause answered %+v while a job of a paused worker ran", results)
	default:
	}
	p.Release(job, scheduler.End{Worker: scheduler.Succeeded})
	select {
	case results := <-done:
		if msgs := messages(t, results); len(msgs) != 2 || !strings.HasPrefix(msgs["http://a:1"], "paused") || !strings.HasPrefix(msgs["http://b:1"], "paused") {
			t.Fatalf("the pause answered %v; want both workers paused", msgs)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the pause did not answer once the job ended")
	}
}

// A job that hung (it overran its prediction stall_factor times, and at
// least health_timeout) does not hold the pause: its worker is paused all
// the same, and its result says the pause did not wait for that job.
func TestPauseDoesNotWaitForAHungJob(t *testing.T) {
	p, f, cfg := pausePool(t, "http://a:1")
	job := runningJob(t, p, cfg, 0.001) // 1 ms at the initial speed, never released
	health := &scheduler.HealthConfig{StallFactor: 1, Timeout: time.Millisecond}
	select {
	case results := <-pauseAsync(t, f, nil, &Config{DrainTimeout: time.Minute, Health: health}):
		if msg := messages(t, results)["http://a:1"]; !strings.Contains(msg, "hung") {
			t.Fatalf("the result of the worker with a hung job says %q; want that its job hung", msg)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("a hung job held the pause")
	}
	if got := p.PausedWorkers(); !slices.Equal(got, []string{"http://a:1"}) {
		t.Fatalf("paused %v; want a, its hung job notwithstanding", got)
	}
	p.Release(job, scheduler.End{Worker: scheduler.Abandoned})
}

// A pause whose jobs outlast drain_timeout fails with ErrDrainTimeout,
// and the workers it paused serve again; one paused before stays paused.
func TestPauseThatRunsOutOfTimeIsUndone(t *testing.T) {
	p, f, cfg := pausePool(t, "http://a:1", "http://b:1")
	p.PauseWorkers([]string{"http://b:1"})
	job := runningJob(t, p, cfg, 1) // on a, the one not paused
	defer p.Release(job, scheduler.End{Worker: scheduler.Succeeded})
	_, err := f.PauseGeneration(context.Background(), nil, &Config{DrainTimeout: time.Millisecond})
	if !errors.Is(err, ErrDrainTimeout) {
		t.Fatalf("a pause beside a job that outlasts drain_timeout: %v; want ErrDrainTimeout", err)
	}
	if got := p.PausedWorkers(); !slices.Equal(got, []string{"http://b:1"}) {
		t.Fatalf("paused after the pause ran out of time: %v; want b alone, as before it", got)
	}
}

// A worker removed while a pause drains does not keep the others paused
// when the pause runs out of time.
func TestPauseUndoneThoughAWorkerLeftDuringIt(t *testing.T) {
	p, f, cfg := pausePool(t, "http://a:1", "http://b:1")
	for range 2 { // one on each
		job := runningJob(t, p, cfg, 1)
		defer p.Release(job, scheduler.End{Worker: scheduler.Succeeded})
	}
	failed := make(chan error, 1)
	go func() {
		_, err := f.PauseGeneration(context.Background(), nil, &Config{DrainTimeout: 500 * time.Millisecond})
		failed <- err
	}()
	if !testkit.WaitUntil(10*time.Second, func() bool { return len(p.PausedWorkers()) == 2 }) {
		t.Fatal("the pause did not pause both workers")
	}
	p.Remove("http://a:1")
	if err := <-failed; !errors.Is(err, ErrDrainTimeout) {
		t.Fatalf("the pause: %v; want ErrDrainTimeout", err)
	}
	if got := p.PausedWorkers(); len(got) > 0 {
		t.Fatalf("paused after the pause was undone: %v; want none", got)
	}
}

// A continue with no worker named ends every pause, and is a no-op when
// none is paused; one that names workers says which were not paused.
func TestContinueEndsThePauses(t *testing.T) {
	p, f, _ := pausePool(t, "http://a:1", "http://b:1", "http://c:1")
	if _, err := f.ContinueGeneration(nil); !errors.Is(err, scheduler.ErrNothingToDo) {
		t.Fatalf("a continue with nothing paused: %v; want ErrNothingToDo", err)
	}
	p.PauseWorkers([]string{"http://a:1", "http://b:1"})
	results, err := f.ContinueGeneration([]string{"http://a:1", "http://c:1"})
	if msgs := messages(t, results); err != nil || msgs["http://a:1"] != "serving again" || msgs["http://c:1"] != "was not paused" {
		t.Fatalf("continue of a and c: %v, %v", msgs, err)
	}
	results, err = f.ContinueGeneration(nil)
	if msgs := messages(t, results); err != nil || len(msgs) != 1 || msgs["http://b:1"] != "serving again" {
		t.Fatalf("continue of every paused worker: %v, %v; want b", msgs, err)
	}
	if got := p.PausedWorkers(); len(got) > 0 {
		t.Fatalf("paused after the continues: %v", got)
	}
}

// A pause is written to the fleet's record as it is made: a router that
// starts on that storage has the workers paused, since when they were.
func TestAPauseIsInTheStoredRecord(t *testing.T) {
	store := memstore.New()
	before, f, _ := pausePool(t, "http://a:1")
	before.Register("http://r:1", 10)
	s := NewStore(before, f, zap.NewNop())
	s.Use(nil, store, Rules{})
	s.StartOnce()
	if _, err := f.PauseGeneration(context.Background(), []string{"http://r:1"}, &Config{DrainTimeout: time.Minute}); err != nil {
		t.Fatal(err)
	}
	if err := s.Persist(context.Background()); err != nil {
		t.Fatal(err)
	}
	since := before.Snapshot()[1].PausedSince

	after, _, _ := pausePool(t, "http://a:1")
	s = NewStore(after, New(after, zap.NewNop()), zap.NewNop())
	s.Use(nil, store, Rules{})
	s.StartOnce()
	info, ok := after.Worker("http://r:1")
	if !ok || !info.PausedSince.Equal(since) || !slices.Equal(after.PausedWorkers(), []string{"http://r:1"}) {
		t.Fatalf("after a restart: r %+v (paused since %v), paused %v; want r alone, paused since %v", ok, info.PausedSince, after.PausedWorkers(), since)
	}
}
