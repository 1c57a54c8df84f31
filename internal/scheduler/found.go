package scheduler

import (
	"slices"

	"github.com/miles-rollout/miles-diffusion-router/internal/request"
)

// Workers a lookup finds: a DNS name's answer names addresses alone; the
// Kubernetes API's EndpointSlices also name each endpoint's pod and its
// conditions, which the pool follows as kube-proxy does. A ready endpoint
// serves; one serving but terminating takes a job only when no worker
// that is not terminating would take it, and finishes the jobs it has;
// one neither ready nor serving stays in the pool with no job, until it
// is ready or gone.

// Found is a worker a lookup names.
type Found struct {
	URL    string
	Source string // the lookup's kind, as /workers shows it: "dns" (the default) or "kubernetes"
	// Namespace and Pod name the worker's pod; Identity is its uid. A
	// worker found with another identity at its address is a new
	// process: its pod was replaced.
	Namespace, Pod, Identity string
	Condition                Condition
}

// Condition is how far a found worker is ready, as its endpoint says.
type Condition uint8

// The conditions of an endpoint.
const (
	EndpointReady       Condition = iota // serves
	EndpointTerminating                  // serving, but its pod is going: the last resort
	EndpointNotReady                     // neither ready nor serving: no job
)

// source is the kind of lookup that found f.
func (f Found) source() string {
	if f.Source == "" {
		return "dns"
	}
	return f.Source
}

// refoundLocked takes what a lookup now says of w, a worker of the pool.
// Another identity at its address is a new process: w starts over, as a
// worker that joins does.
func (p *Pool) refoundLocked(w *worker, f Found) {
	replaced := w.found.Identity != "" && f.Identity != "" && w.found.Identity != f.Identity
	w.found = f
	if replaced {
		p.replacedLocked(w)
	}
}

// replacedLocked starts w over after its process was replaced: its
// capabilities and weights are read again, it is out until a probe
// passes, and it is brought to the fleet's weights before its first job,
// as a late joiner is. Jobs it had run on the process that is gone, and
// fail there.
func (p *Pool) replacedLocked(w *worker) {
	if w.caps.taskTypes != nil {
		p.unknown.Add(1)
	}
	w.caps = capabilities{makes: request.Unprobed}
	w.health = workerHealth{down: true, unverified: true} // the old process's verdicts are not this one's
	w.evidence = healthEvidence{}
	// A trainer's pause, or an operator's hold, was of the process that
	// is gone: a worker that leaves and comes back has neither either.
	w.life.pausedAt, w.life.dead = 0, false
	w.life.version, w.life.source, w.life.slept = "", "", false
	p.forgetAdapterLocked(w)
	p.joins++
	w.join = p.joins
	p.fleet.changedLocked(w)
	p.fleet.holdIfBehindLocked(w)
}

// lastResortLocked reports whether w, serving but terminating, may take
// t's request at now: only when no worker that is not terminating would.
func (p *Pool) lastResortLocked(t *Ticket, w *worker, now int64) bool {
	return !slices.ContainsFunc(p.workers, func(o *worker) bool {
		return o != w && o.serving(now) && p.mayTakeLocked(t, o, now, question{asks: couldServe})
	})
}
