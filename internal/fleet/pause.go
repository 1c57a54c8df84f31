package fleet

import (
	"context"
	"net/http"
	"slices"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// PauseGeneration pauses the workers named, or with none named every
// worker an operator has not held back, and waits as the drain before an
// update does until the jobs they hold have ended, not for one that hung.
// When the drain runs out of time the workers it paused serve again. The
// caller holds the fleet's lock.
func (f *Fleet) PauseGeneration(ctx context.Context, urls []string, cfg *Config) ([]Result, error) {
	p := f.pool
	paused, already, err := p.PauseWorkers(urls) // nil: all, as the pool has them now
	if err != nil {
		return nil, err
	}
	hung, err := p.WaitIdle(ctx, slices.Concat(paused, already), cfg.DrainTimeout, cfg.Health)
	if err != nil {
		for _, u := range paused {
			// One at a time: a worker removed meanwhile has no pause to
			// undo, and must not keep the others paused.
			_, _ = p.ContinueWorkers([]string{u})
		}
		return nil, drainError(ctx, err)
	}
	results := make([]Result, 0, len(paused)+len(already))
	for _, u := range slices.Concat(paused, already) {
		msg := "paused: it gets no new job until continue_generation"
		switch {
		case slices.Contains(hung, u):
			msg = "paused, but a job on it overran its predicted time many times over (hung), and the pause did not wait for it to end"
		case slices.Contains(already, u):
			msg = "already paused: it gets no new job until continue_generation"
		}
		results = append(results, doneWithoutCall(u, msg))
	}
	return results, nil
}

// ContinueGeneration ends the pause of the workers named, or with none
// named of every paused worker: they get jobs again.
// scheduler.ErrNothingToDo when none is named and none is paused.
func (f *Fleet) ContinueGeneration(urls []string) ([]Result, error) {
	p := f.pool
	continued, err := p.ContinueWorkers(urls) // nil: every paused worker, as the pool has them now
	if err != nil {
		return nil, err
	}
	if urls == nil {
		if len(continued) == 0 {
			return nil, scheduler.ErrNothingToDo
		}
		urls = continued
	}
	results := make([]Result, 0, len(urls))
	for _, u := range urls {
		msg := "serving again"
		if !slices.Contains(continued, u) {
			msg = "was not paused"
		}
		results = append(results, doneWithoutCall(u, msg))
	}
	return results, nil
}

// doneWithoutCall is the result of a worker an operation changed without a call.
func doneWithoutCall(workerURL, msg string) Result {
	return Result{WorkerURL: workerURL, StatusCode: http.StatusOK, OK: true, answered: true, Body: map[string]any{"success": true, "message": msg}}
}
