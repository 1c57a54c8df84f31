package scheduler

import (
	"context"
	"errors"
	"maps"
	"slices"
	"sync/atomic"
	"time"
)

// The fleet's weights, as routing needs them: which version each worker
// serves, whether an update or a sleep holds jobs back, and how a worker
// that missed updates catches up. The operations that change them, which
// call the workers, are internal/fleet's; they move the workers through
// the states here, under the pool's lock.

// fleetState is the fleet's side of the pool, guarded by the pool's mutex
// but for behind.
type fleetState struct {
	holding bool     // a drain is on: no job is handed out
	version string   // weight version of the last successful update
	history []Update // the last update and the LoRA calls since: what brings a worker to version
	running *Update  // the update in progress, recorded so that a router taking over can finish it
	// loaded is the workers that loaded the update in progress, or the one
	// inherited: a worker's version alone cannot say so, as an update that
	// reloads a checkpoint rewritten at its path keeps the version.
	loaded []string
	// inherited is the update the router's predecessor had in progress when
	// it left, finished here by catching the workers up; retrying is set
	// while a retry of it runs, which calls only the workers not loaded.
	inherited *Update
	retrying  bool
	// declared says the version is a trainer's word (declare.go), not an
	// update's: no history leads to it. checksums are the declaration's,
	// while the fleet is on its version; nil when it gave none.
	declared  bool
	checksums map[string]string

	behind atomic.Int32 // workers that wait for a catch-up to be started; read without mu

	// versions are the base-weight versions the fleet has had, oldest
	// first, the last MaxStaleness+1 of them (see staleness.go).
	versions []string
}

// target is the version the update in progress moves to; "" when none
// runs.
func (f *fleetState) target() string {
	if f.running == nil {
		return ""
	}
	return f.running.Version
}

// lag is how far a worker is in being brought to the pool's weights after
// it missed updates (it joined later, slept through them, was held back by
// an operator, or was down). It is stale all along but while the catch-up
// calls it: /workers shows updating only while a call runs.
type lag uint8

const (
	upToDate   lag = iota // nothing to catch up, or its catch-up calls it now
	lagging               // waits for a catch-up to be started (StartCatchUps, on a request or a passed probe)
	catchingUp            // its catch-up was started and waits for the fleet, busy with another operation
)

// Update is a call that changes the workers' weights, as the fleet sent
// it and replays it to a worker that missed it.
type Update struct {
	Path      string // the workers' endpoint: update_weights_from_disk or a LoRA call
	ModelPath string
	Version   string // the weight version the workers serve once it is done
	Mode      string
	Body      []byte
}

// DiskUpdatePath is where workers load new weights from disk; an update
// there starts the history a late worker replays anew.
const DiskUpdatePath = "/update_weights_from_disk"

// Update modes.
const (
	ModeDrain   = "drain"
	ModeRolling = "rolling"
)

// ErrNothingToDo is why a sleep or a wake has no worker to change.
var ErrNothingToDo = errors.New("no worker is in the state the operation changes")

// HoldJobs stops handing out jobs, as a drain update does; they wait in
// the queue. (A trainer's pause is of workers: see pause.go.)
func (p *Pool) HoldJobs() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.fleet.holding = true
}

// ReleaseJobs hands out jobs again.
func (p *Pool) ReleaseJobs() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.fleet.holding = false
	p.dispatchLocked()
}

// BeginUpdate picks the workers update u goes to (those serving and those
// stale from an earlier failed update) and, in drain mode, stops handing
// out jobs. A worker that waits for its catch-up is left to it, but by a
// retry of the update the router inherited from its predecessor: that one
// goes to every worker that has not loaded it, and the workers that have
// are returned as done.
func (p *Pool) BeginUpdate(u Update) (targets, done []string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	f := &p.fleet
	f.retrying = f.inherited != nil && f.inherited.sameCall(u)
	if !f.retrying {
		f.loaded = nil
	}
	f.inherited = nil
	for _, w := range p.workers {
		if w.life.dead || (w.life.state != Serving && w.life.state != Stale) {
			continue
		}
		switch {
		case w.life.unvouched && u.Path != DiskUpdatePath: // a LoRA call on weights nobody vouches for vouches for nothing
		case f.retrying && w.life.state == Serving && slices.Contains(f.loaded, w.url):
			done = append(done, w.url)
		case f.retrying:
			p.fleet.leaveLocked(w) // its catch-up is this call
			targets = append(targets, w.url)
		case w.life.behind == upToDate: // the catch-up replays this update after those it missed
			targets = append(targets, w.url)
		}
	}
	f.holding, f.running = u.Mode == ModeDrain, &u
	p.Changed()
	return targets, done
}

// sameCall reports whether u and v are one call: the same endpoint and
// model_path, to the same version.
func (u Update) sameCall(v Update) bool {
	return u.Path == v.Path && u.ModelPath == v.ModelPath && u.Version == v.Version
}

// FinishUpdate records one worker's update to version: it serves version
// if ok, and is stale otherwise; one that did not answer at all is
// caught up once a probe finds it again.
func (p *Pool) FinishUpdate(url, version string, ok, answered bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if w := p.findLocked(url); w != nil {
		if ok {
			w.life.version, w.life.state, w.life.missed = version, Serving, false
			w.life.source, w.life.unvouched, w.life.slept = SourceRouter, false, false
			p.remergeLocked(w)
			p.fleet.loadedLocked(url, version)
		} else {
			w.life.state, w.life.missed = Stale, !answered
			if p.fleet.declared { // a wake must not bring it back as if it held the fleet's weights
				w.life.unvouched, w.life.source = true, SourceUnknown
			}
		}
	}
	p.dispatchLocked()
	p.Changed()
}

// loadedLocked notes that the worker at url loaded version, if that is
// the version of the update in progress or of the one inherited.
func (fs *fleetState) loadedLocked(url, version string) {
	f := fs
	u := f.running
	if u == nil {
		u = f.inherited
	}
	if u != nil && u.Version == version && !slices.Contains(f.loaded, url) {
		f.loaded = append(f.loaded, url)
	}
}

// EndUpdate resumes handing out jobs. After an update that succeeded
// anywhere it remembers the new version and how to reach it from the
// weights the workers started with, to bring workers that missed it there.
func (p *Pool) EndUpdate(u Update, succeeded bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	f := &p.fleet
	if succeeded && !f.retrying { // the inherited update is in the history since it was inherited
		f.advance(u)
		p.catchUpUnvouchedLocked()
	}
	f.holding, f.running, f.loaded, f.retrying = false, nil, nil, false
	p.Changed()
	p.dispatchLocked()
}

// advance moves the fleet to the weights u leads to once it has run. An
// update from disk is the router's own: it starts anew the history a late
// worker replays, ends a declaration, and is the fleet's newest version. A LoRA call adds to the
// history, but after a declaration there is none to add to: no replay
// leads to declared weights. Either way the declared checksums no longer
// describe the weights.
func (f *fleetState) advance(u Update) {
	switch {
	case u.Path == DiskUpdatePath:
		f.history, f.declared = []Update{u}, false
		f.learnedLocked(u.Version)
	case !f.declared:
		f.history = append(slices.Clip(f.history), u)
	}
	f.version, f.checksums = u.Version, nil
}

// catchUpUnvouchedLocked brings the workers the router could not vouch
// for, and that an update from disk did not reach, to that update by a
// catch-up: once the fleet's weights are the router's again, a replay
// leads to them.
func (p *Pool) catchUpUnvouchedLocked() {
	if p.fleet.declared {
		return
	}
	for _, w := range p.workers {
		if w.life.unvouched {
			p.fleet.behindLocked(w)
		}
	}
}

// SetStates moves the workers named to state s.
func (p *Pool) SetStates(urls []string, s State) {
	p.move(urls, s, func(*worker) {})
}

// Moved moves the workers named to state s after a sleep or a wake; a
// worker woken with the weights it slept on catches up first.
func (p *Pool) Moved(urls []string, s State) {
	p.move(urls, s, func(w *worker) {
		if s == Serving { // awake now, whatever it said or did before
			p.wokeLocked(w)
		}
		p.fleet.holdIfBehindLocked(w)
	})
}

// move takes the pool's lock, moves the workers named to state s,
// doing then to each, and hands out jobs by the states now.
func (p *Pool) move(urls []string, s State, then func(*worker)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, u := range urls {
		if w := p.findLocked(u); w != nil {
			w.life.state = s
			then(w)
		}
	}
	p.dispatchLocked()
}

// InState returns the workers (not held back) in state s: ErrNoWorker
// when the pool has none at all, ErrNothingToDo when none is in s.
func (p *Pool) InState(s State) ([]string, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.workers) == 0 {
		return nil, ErrNoWorker
	}
	out := p.urlsLocked(func(w *worker) bool { return !w.life.dead && w.life.state == s })
	if len(out) == 0 {
		return nil, ErrNothingToDo
	}
	return out, nil
}

// wokeLocked notes that w answered a wake: whatever it said before, it is
// awake. Failures while it slept (sglang-diffusion answers an image job
// on a sleeping worker with a bare 500) end their ejection, into
// probation.
func (p *Pool) wokeLocked(w *worker) {
	w.evidence.naps, w.health.asleepUntil = 0, 0
	if w.health.ejectedUntil > p.now().UnixNano() {
		w.health.ejectedUntil = 0
	}
}

// NotHeldBack returns the workers an operator has not held back:
// ErrNoWorker when there are none.
func (p *Pool) NotHeldBack() ([]string, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := p.urlsLocked(func(w *worker) bool { return !w.life.dead })
	if len(out) == 0 {
		return nil, ErrNoWorker
	}
	return out, nil
}

// Awake returns the workers that are neither held back nor asleep.
func (p *Pool) Awake() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.urlsLocked(func(w *worker) bool { return !w.life.dead && w.life.state != Sleeping })
}

// WaitIdle waits, for at most timeout, until each of the workers named
// either has no job in flight or is taken for hung: it runs a job that
// health takes for stalled (it overran its prediction by the stall factor,
// and at least the probe timeout, on a worker whose /health still
// answers), or is suspect since a job of it overran. A drain must not wait
// on one sick worker; but it waits for a job nobody waits on a connection
// for (see headUnwatched), such as one an abort ended, which the pool lets
// go of at its predicted end. It returns the workers taken for hung, which
// the caller leaves out.
func (p *Pool) WaitIdle(ctx context.Context, urls []string, timeout time.Duration, health *HealthConfig) (hung []string, err error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for {
		p.mu.Lock()
		hung, busy, next := p.drainedLocked(urls, health)
		if !busy {
			p.mu.Unlock()
			return hung, nil
		}
		released := make(chan struct{})
		p.onRelease = append(p.onRelease, released)
		p.mu.Unlock()
		var overdue <-chan time.Time
		if next > 0 {
			timer := time.NewTimer(time.Duration(next - p.now().UnixNano()))
			defer timer.Stop()
			overdue = timer.C
		}
		select {
		case <-released:
		case <-overdue:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// drainedLocked returns the workers named whose running job is hung, and
// whether others still run jobs that are not, with the earliest time
// (Unix nanoseconds) one of those would be taken for hung; 0 when none
// can be.
func (p *Pool) drainedLocked(urls []string, health *HealthConfig) (hung []string, busy bool, next int64) {
	now := p.now().UnixNano()
	for _, u := range urls {
		w := p.findLocked(u)
		switch {
		case w == nil:
		case w.health.suspect || health != nil && p.overrunningLocked(w, now, health):
			// A job of it overran: one a copy overtook may still hold
			// its GPU, and a call would wait behind it.
			hung = append(hung, u)
		case w.adapter.calling: // a LoRA call under way: an update must not overlap it
			busy = true
		case w.load.inflight == 0:
		case health == nil || w.headUnwatched(): // it never hangs: the drain waits for its end
			busy = true
		default:
			busy = true
			if at := w.load.headSince + int64(p.stallLimitLocked(w, health)) + 1; next == 0 || at < next {
				next = at
			}
		}
	}
	return hung, busy, next
}

// LeaveOut keeps the workers named out of an update while a job of theirs
// hangs: they are stale, and are brought to the pool's weights once that
// job has ended and a probe finds them again.
func (p *Pool) LeaveOut(urls []string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, u := range urls {
		if w := p.findLocked(u); w != nil {
			w.life.state, w.life.missed = Stale, true
		}
	}
	p.dispatchLocked()
}

// recoveredLocked brings back a worker that did not answer a call of the
// fleet (it was down, or restarted on its old weights): once a probe
// finds it again, it catches up as a late joiner does, before its first
// job, or, unvouched, is asked for its checksums again.
func (fs *fleetState) recoveredLocked(w *worker) {
	if !w.life.missed || fs.target() != "" || w.load.inflight > 0 { // not while an operation runs, nor before a hung job ends
		return
	}
	switch {
	case w.life.state == Stale:
		w.life.state, w.life.missed = Serving, false
		fs.behindLocked(w) // it missed an update, whatever version it shows
	case w.life.unvouched:
		w.life.missed = false
		fs.behindLocked(w)
	}
}

// missedLocked takes w for a worker a record shows as not on the fleet's
// weights: stale until a probe finds it and a catch-up brings it there.
func (fs *fleetState) missedLocked(w *worker) {
	if w.life.state == Serving || w.life.state == Stale {
		fs.leaveLocked(w) // a catch-up is due once a probe passes, not before
		w.life.state, w.life.missed = Stale, true
	}
}

// behindLocked holds w out of serving, stale, until a catch-up has
// brought it to the pool's version, whatever version it shows. After a
// declaration no replay leads there: w is unvouched.
func (fs *fleetState) behindLocked(w *worker) {
	if fs.declared {
		fs.unvouchLocked(w)
		return
	}
	if len(fs.history) == 0 || w.life.dead || w.life.state != Serving {
		return
	}
	w.life.state = Stale
	if w.life.behind == upToDate {
		w.life.behind = lagging
		fs.behind.Add(1)
	}
}

// holdIfBehindLocked holds a worker that missed an update (it joined
// later, slept through it, was held back by an operator, or was down)
// out of serving, stale, until it has caught up with the pool's version.
// One whose catch-up is under way already (woken meanwhile) waits for it.
// After a declaration a worker not named keeps its version and serves on
// (see declare.go).
func (fs *fleetState) holdIfBehindLocked(w *worker) {
	if w.life.version != fs.version && !fs.declared {
		fs.behindLocked(w)
	}
}

// matchVersionLocked holds w back, stale, when a mirrored record says it
// is behind the fleet's weights, and lets it serve again when one says it
// has caught up.
func (fs *fleetState) matchVersionLocked(w *worker) {
	if w.life.state == Stale && (len(fs.history) == 0 || w.life.version == fs.version) {
		fs.leaveLocked(w) // no catch-up is due
		w.life.state, w.life.missed = Serving, false
	}
	fs.holdIfBehindLocked(w)
}

// leaveLocked forgets a worker that leaves before it caught up.
func (fs *fleetState) leaveLocked(w *worker) {
	if w.life.behind == lagging {
		fs.behind.Add(-1)
	}
	w.life.behind = upToDate
}

// AnyBehind reports whether workers wait for a catch-up to be started. It
// takes no lock: it is asked on every job and every passed probe.
func (p *Pool) AnyBehind() bool { return p.fleet.behind.Load() > 0 }

// TakeBehind returns the workers waiting for a catch-up to be started,
// which the caller now starts: each calls BeginCatchUp once it has the
// fleet.
func (p *Pool) TakeBehind() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := p.now().UnixNano()
	var out []string
	for _, w := range p.workers {
		// A paused worker's weights are the trainer's to move: its
		// catch-up waits until it continues. An unvouched worker that
		// said it is asleep is asked for its checksums once it may
		// serve again, not while a trainer may still be moving them, nor
		// while the router has put it to sleep.
		if w.life.behind == lagging && w.life.pausedAt == 0 && w.life.state != Sleeping && !(w.life.unvouched && now < w.health.asleepUntil) {
			w.life.behind = catchingUp
			out = append(out, w.url)
		}
	}
	p.fleet.behind.Add(-int32(len(out)))
	return out
}

// CatchUp is what brings a worker to the fleet's version: the calls to
// replay, or after a declaration, the checksums its weights must have.
type CatchUp struct {
	URL       string // the worker's
	join      uint64 // the worker's join: the check of one that left says nothing of its successor
	Version   string
	Replay    []Update
	Checksums map[string]string // set: check, do not replay
}

// BeginCatchUp moves the worker at url, whose catch-up now has the fleet,
// to updating while the catch-up calls it; FinishUpdate, or Verified,
// ends that. It reports false when there is nothing to call: the worker
// left, or came back anew with a catch-up of its own.
func (p *Pool) BeginCatchUp(url string) (CatchUp, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	w := p.findLocked(url)
	if w == nil || w.life.behind != catchingUp {
		return CatchUp{}, false
	}
	f := &p.fleet
	switch {
	case f.declared && f.checksums == nil: // a declaration since left nothing to check it by
		w.life.behind = upToDate
		return CatchUp{}, false
	case w.life.state == Sleeping: // put to sleep through the router since: caught up once woken
		w.life.behind = lagging
		f.behind.Add(1)
		return CatchUp{}, false
	}
	w.life.state, w.life.behind = Updating, upToDate
	plan := CatchUp{URL: url, Version: f.version, join: w.join}
	if f.declared {
		plan.Checksums = maps.Clone(f.checksums)
	} else {
		plan.Replay = slices.Clone(f.history)
	}
	return plan, true
}
