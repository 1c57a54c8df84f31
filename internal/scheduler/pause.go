package scheduler

import (
	"errors"
	"fmt"
	"slices"
)

// A trainer that moves weights into the workers itself (over CUDA IPC
// through each engine, not through the router) pauses them first: from
// then until it lets them continue they get no new job, and the jobs
// waiting stay in the queue for the workers not paused. The pause is a
// mark beside the worker's lifecycle state, as an operator's hold is, so
// that an update, a sleep or a wake moves the worker through its states
// and leaves it paused.

// ErrUnknownWorker is why a pause or a continue that names a worker the
// pool lacks changes nothing.
var ErrUnknownWorker = errors.New("no worker of the pool has that URL")

// PauseWorkers pauses the workers named, or with none named (nil) every
// worker an operator has not held back: none gets a new job from now on.
// It returns those it paused and those paused already, whose pause (and
// its time) it keeps. A URL the pool lacks fails it, pausing none.
func (p *Pool) PauseWorkers(urls []string) (paused, already []string, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	named, err := p.namedLocked(urls)
	if urls == nil {
		named = slices.DeleteFunc(slices.Clone(p.workers), func(w *worker) bool { return w.life.dead })
	}
	if err != nil {
		return nil, nil, err
	}
	if len(named) == 0 {
		return nil, nil, ErrNoWorker
	}
	now := p.now().UnixNano()
	for _, w := range named {
		if w.life.pausedAt != 0 {
			already = append(already, w.url)
			continue
		}
		w.life.pausedAt = now
		paused = append(paused, w.url)
	}
	if len(paused) > 0 {
		p.Changed()
	}
	return paused, already, nil
}

// ContinueWorkers ends the pause of the workers named, or with none named
// (nil) of every paused worker, and hands them the jobs waiting. It
// returns those whose pause it ended; a worker named that was not paused
// is left as it is. A URL the pool lacks fails it, changing none.
func (p *Pool) ContinueWorkers(urls []string) (continued []string, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	named, err := p.namedLocked(urls)
	if urls == nil {
		named = p.workers
	}
	if err != nil {
		return nil, err
	}
	for _, w := range named {
		if w.life.pausedAt != 0 {
			w.life.pausedAt = 0
			continued = append(continued, w.url)
		}
	}
	if len(continued) > 0 {
		p.dispatchLocked()
		p.Changed()
	}
	return continued, nil
}

// PausedWorkers returns the workers a trainer has paused.
func (p *Pool) PausedWorkers() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.urlsLocked(func(w *worker) bool { return w.life.pausedAt != 0 })
}

// urlsLocked returns the URLs of the workers keep keeps, in the order
// they joined.
func (reg *registry) urlsLocked(keep func(*worker) bool) []string {
	var out []string
	for _, w := range reg.workers {
		if keep(w) {
			out = append(out, w.url)
		}
	}
	return out
}

// namedLocked returns the workers urls name, each once however often or
// in whatever spelling it is named: ErrUnknownWorker for a URL the pool
// lacks.
func (reg *registry) namedLocked(urls []string) ([]*worker, error) {
	out := make([]*worker, 0, len(urls))
	for _, u := range urls {
		w := reg.findLocked(u)
		if w == nil {
			return nil, fmt.Errorf("%w: %s", ErrUnknownWorker, u)
		}
		if !slices.Contains(out, w) {
			out = append(out, w)
		}
	}
	return out, nil
}
