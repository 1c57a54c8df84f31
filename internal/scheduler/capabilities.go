package scheduler

import (
	"slices"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/request"
)

// can reports whether w may be given a request of kind k.
func (w *worker) can(k request.Task) bool {
	return w.caps.makes.Has(k)
}

// CanServe reports whether a serving worker can take a request of kind k.
// A paused worker counts: the pause ends, and its jobs wait for it.
func (p *Pool) CanServe(k request.Task) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := p.now().UnixNano()
	for _, w := range p.workers {
		if s := w.stateAt(now); (s == Serving || s == Paused) && w.can(k) {
			return true
		}
	}
	return false
}

// AnyMakes reports whether some worker of the pool, serving or not, is
// known or assumed to make requests of kind k.
func (p *Pool) AnyMakes(k request.Task) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.ContainsFunc(p.workers, func(w *worker) bool { return w.can(k) })
}

// SetCapabilities records what a worker's /v1/models says it can do. Until
// an update names its weights, a worker's weight version is its model id,
// the model_path it was started with.
func (p *Pool) SetCapabilities(url string, taskTypes []string, modelID string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if w := p.findLocked(url); w != nil {
		if w.life.version == "" {
			w.life.version = modelID
		}
		if w.caps.taskTypes != nil && (modelID != w.caps.modelID || !slices.Equal(taskTypes, w.caps.taskTypes)) {
			p.fleet.changedLocked(w) // restarted on other weights, behind the router's back
		}
		w.caps.modelID = modelID
		if w.caps.taskTypes == nil {
			p.unknown.Add(-1)
		}
		w.caps.taskTypes = append([]string{}, taskTypes...)
		w.caps.makes = request.TasksOf(taskTypes)
		p.dispatchLocked()
	}
}

// Unprobed returns the workers whose capabilities are unknown and were not
// probed within the last interval, and marks them as being probed now.
func (p *Pool) Unprobed(now time.Time, interval time.Duration) []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var urls []string
	for _, w := range p.workers {
		if w.caps.taskTypes == nil && now.Sub(w.caps.probedAt) >= interval {
			w.caps.probedAt = now
			urls = append(urls, w.url)
		}
	}
	return urls
}

// AllProbed reports whether a probe has told every worker's task types.
// It takes no lock: it is asked on every image and video request.
func (p *Pool) AllProbed() bool { return p.unknown.Load() == 0 }
