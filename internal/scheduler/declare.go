package scheduler

import (
	"maps"
	"slices"
)

// A trainer that moves weights into the workers itself (miles_diffusion
// pushes tensors into each engine over CUDA IPC, and sleeps and wakes the
// engines itself) tells the router what they hold: a declaration. The
// router cannot ask an engine for its version (sglang-diffusion keeps
// none), but it can ask for the checksums of its weights.
//
// Once the fleet's weights are declared, no replay of the updates before
// leads to them, and the router no longer vouches for a worker whose
// weights may have moved since it last knew them: it is unvouched, stale
// whatever its lifecycle state, until a declaration names it, its own
// checksums match the declared ones (asked once it may serve again), or
// an update from disk through the router reaches it. Such a worker
// joined after the declaration; missed a call through the router;
// waited, at the declaration, to be caught up with updates the
// declaration made moot; did not match the declaration's checksums; or
// changed behind the router's back: it could not be connected to (a
// restart), its /v1/models answer changed, or it answered a job as
// asleep. A worker the declaration does not name, and that is none of
// these, keeps its own version and serves on: a trainer that refits a few
// workers at a time leaves the others serving, and a request's version
// policy (staleness.go) chooses among them.

// Where the router learned a worker's weight version, as /workers shows
// it in weight_version_source.
const (
	SourceReported = "reported" // the model id its /v1/models gives, before any update
	SourceRouter   = "router"   // an update through the router
	SourceDeclared = "declared" // a trainer's declaration
	SourceVerified = "verified" // a declaration whose checksums the worker matched
	SourceUnknown  = "unknown"  // its weights may have moved since the router knew them
)

// VersionSources are the values of weight_version_source, in the order
// the docs list them.
var VersionSources = []string{SourceReported, SourceRouter, SourceDeclared, SourceVerified, SourceUnknown}

// Declaration is a trainer's word that workers hold a weight version, as
// far as the router could check it.
type Declaration struct {
	Version string
	// Holds are the workers that hold Version, each with where the router
	// learned it: SourceDeclared, or SourceVerified when they matched
	// Checksums.
	Holds map[string]string
	// Differ are the workers named that did not match Checksums, or whose
	// checksums could not be read: the router cannot vouch for them.
	Differ []string
	// Checksums are the declared SHA-256 of each module, in lower-case
	// hex; nil when the declaration gave none. A worker that changes
	// behind the router's back later proves with them that it still
	// holds Version.
	Checksums map[string]string
	// Continue ends the pause of the workers named: continue_generation
	// with new_version declares and lets them serve in one step.
	Continue bool
}

// DeclareTargets returns the workers a declaration that names none is
// about: the paused ones, or with none paused every worker that is up:
// neither held back, nor put to sleep through the router, nor failing
// its health probes (a trainer could not have reached it). One the
// router cannot vouch for is among them: the trainer's word is what
// brings it back. ErrNoWorker when there are none.
func (p *Pool) DeclareTargets() ([]string, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := p.urlsLocked(func(w *worker) bool { return w.life.pausedAt != 0 })
	if len(out) == 0 {
		out = p.urlsLocked(func(w *worker) bool { return !w.life.dead && w.life.state != Sleeping && !w.health.down })
	}
	if len(out) == 0 {
		return nil, ErrNoWorker
	}
	return out, nil
}

// DeclareVersion records d: the workers it holds for are on its version,
// those that differ are unvouched, and so is every other worker that
// waited to be caught up with the updates before, which no longer lead
// to the fleet's weights. The fleet's version becomes d's. A worker that
// left since it was named is skipped.
func (p *Pool) DeclareVersion(d Declaration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	f := &p.fleet
	f.version, f.history, f.inherited = d.Version, nil, nil
	f.declared, f.checksums = true, maps.Clone(d.Checksums)
	f.learnedLocked(d.Version)
	for _, w := range p.workers {
		source, holds := d.Holds[w.url]
		differs := slices.Contains(d.Differ, w.url)
		switch {
		case holds:
			f.vouchLocked(w, d.Version, source)
			// Awake, in the trainer's word: a job that found it asleep
			// before its wake no longer holds it out.
			w.evidence.naps, w.health.asleepUntil = 0, 0
		case differs: // it just failed its check: not asked again
			f.distrustLocked(w)
		case w.life.behind != upToDate || w.life.missed || w.life.state == Stale:
			f.unvouchLocked(w)
		}
		if d.Continue && (holds || differs) {
			w.life.pausedAt = 0
		}
	}
	p.Changed()
	p.dispatchLocked()
}

// vouchLocked takes w to hold version, learned as source says.
func (fs *fleetState) vouchLocked(w *worker, version, source string) {
	fs.leaveLocked(w)
	w.life.version, w.life.source, w.life.unvouched, w.life.missed, w.life.slept = version, source, false, false, false
	if w.life.state == Stale {
		w.life.state = Serving
	}
}

// unvouchLocked takes w for a worker whose weights the router cannot
// vouch for. With the declaration's checksums, it asks the worker for its
// own before it serves again, a catch-up that checks rather than replays,
// unless it was found asleep since it was last vouched for (see
// sleptLocked).
func (fs *fleetState) unvouchLocked(w *worker) {
	fs.distrustLocked(w)
	if fs.checksums != nil && !w.life.slept {
		w.life.behind = lagging
		fs.behind.Add(1)
	}
}

// distrustLocked takes w for a worker whose weights the router cannot
// vouch for until a declaration names it: it asks nothing of it.
func (fs *fleetState) distrustLocked(w *worker) {
	fs.leaveLocked(w) // a catch-up it waited for leads elsewhere
	w.life.unvouched, w.life.source, w.life.missed = true, SourceUnknown, false
	if w.life.state == Stale {
		w.life.state = Serving // unvouched says it all: no update of it is pending
	}
}

// changedLocked notes that w may have changed behind the router's back
// (see the top of this file); before any declaration nothing tells, and
// the router behaves as it always has.
func (fs *fleetState) changedLocked(w *worker) {
	if fs.declared {
		fs.unvouchLocked(w)
	}
}

// sleptLocked notes that w answered a job as asleep: a trainer put it to
// sleep behind the router's back, to wake it, move its weights and
// declare them. Its own checksums would tell nothing: asked between the
// wake and the transfer, they match the weights it is about to lose. It
// waits for the declaration.
func (fs *fleetState) sleptLocked(w *worker) {
	if fs.declared {
		fs.distrustLocked(w)
		w.life.slept = true
	}
}

// recheckLocked has w asked for its checksums again before its next job
// when the fleet's version was declared with them and w is taken to hold
// it: a router that restarts or takes over did not watch the workers
// meanwhile, and one may have restarted on its checkpoint. A worker on an
// older version, which a declaration did not name, keeps it: the
// checksums are not its weights'.
func (fs *fleetState) recheckLocked(w *worker) {
	if fs.declared && fs.checksums != nil && !w.life.unvouched && w.life.version == fs.version {
		fs.unvouchLocked(w)
	}
}

// Verified records the check plan began of a worker against the
// checksums of the fleet's declared version: it holds the version when
// matched; when it answered otherwise it stays unvouched until a
// declaration names it; when it did not answer, its checksums are asked
// again once a probe finds it. A worker that left since, and any that
// joined at its URL, is not judged by it.
func (p *Pool) Verified(plan CatchUp, matched, answered bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	w := p.findLocked(plan.URL)
	if w == nil || w.join != plan.join {
		return
	}
	w.life.state = Serving
	switch {
	case matched && plan.Version == p.fleet.version:
		p.fleet.vouchLocked(w, plan.Version, SourceVerified)
	case !answered:
		w.life.missed = true
	}
	p.dispatchLocked()
	p.Changed()
}

// versionSource is where the router learned w's version: "" while it
// knows none.
func (w *worker) versionSource() string {
	switch {
	case w.life.unvouched:
		return SourceUnknown
	case w.life.version == "":
		return ""
	case w.life.source == "":
		return SourceReported
	}
	return w.life.source
}
