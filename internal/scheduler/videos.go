package scheduler

import (
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/clock"
)

// heldVideo is a video job's claim on its worker after the creating
// request has been answered.
type heldVideo struct {
	t     *Ticket
	timer clock.Timer
}

// HoldVideo keeps t's worker claimed by the video job id.
func (p *Pool) HoldVideo(t *Ticket, id string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if t.worker == nil {
		return false
	}
	t.held = true
	hv := &heldVideo{t: t}
	// Unpolled, the job gives its worker back when it is predicted to end.
	ends := time.Duration(t.worker.load.endsAt - p.now().UnixNano())
	hv.timer = p.clock.AfterFunc(max(ends, 0), func() { p.EndVideo(id, Abandoned) })
	p.held[id] = hv
	return true
}

// EndVideo releases the worker of a held video job that has ended, with
// what its end tells of that worker.
func (p *Pool) EndVideo(id string, ev Evidence) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.endVideoLocked(id, ev)
}

func (p *Pool) endVideoLocked(id string, ev Evidence) {
	hv, ok := p.held[id]
	if !ok {
		return
	}
	delete(p.held, id)
	hv.timer.Stop()
	p.releaseLocked(hv.t, End{Worker: ev})
}

// endVideosOfLocked releases the video jobs w holds, which it lost: they
// say nothing more of it than what lost them.
func (p *Pool) endVideosOfLocked(w *worker) {
	for id, hv := range p.held {
		if hv.t.worker == w {
			p.endVideoLocked(id, Abandoned)
		}
	}
}
