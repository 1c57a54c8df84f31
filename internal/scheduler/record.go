package scheduler

import (
	"encoding/json"
	"maps"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/workerurl"
)

// Record is a pool's state as kept in storage, in JSON.
type Record struct {
	// Workers are the pool's workers in order of joining, those the config
	// lists too: whether an operator held them back and which weights they
	// serve outlive the process as well.
	Workers []WorkerRecord `json:"workers"`

	// WeightVersion is the version of the fleet's last successful weight
	// update; empty before any.
	WeightVersion string `json:"weight_version,omitempty"`

	// Updates bring a worker to WeightVersion: the last update from disk
	// and the LoRA calls since, in order, as the fleet replays them to a
	// worker that missed them.
	Updates []UpdateRecord `json:"updates,omitempty"`

	// Declared says WeightVersion is a trainer's declaration, which no
	// update leads to; Checksums are the declaration's, by module, while
	// the fleet is on its version.
	Declared  bool              `json:"declared,omitempty"`
	Checksums map[string]string `json:"checksums,omitempty"`

	// Versions are the base-weight versions the fleet has had, oldest
	// first: those a job's version policy may admit (see staleness.go).
	Versions []string `json:"versions,omitempty"`

	// Adapters are the declared adapters published since they were
	// declared: a router that restarts serves their latest path, not the
	// one its config names.
	Adapters []AdapterRecord `json:"adapters,omitempty"`

	// Updating is the update in progress as the record was written: a
	// router that takes over from one that left during it finishes it.
	Updating *RunningRecord `json:"updating,omitempty"`
}

// RunningRecord is the update in progress of a Record.
type RunningRecord struct {
	UpdateRecord
	// Loaded is the workers that had loaded it: any other is behind it,
	// whatever version it shows.
	Loaded []string `json:"loaded,omitempty"`
}

// AdapterRecord is one adapter of a Record.
type AdapterRecord struct {
	Name     string  `json:"name"`
	Path     string  `json:"path"`
	Strength float64 `json:"strength,omitempty"`
	Publish  int     `json:"publish"`
}

// WorkerRecord is one worker of a Record.
type WorkerRecord struct {
	URL           string `json:"url"`
	Registered    bool   `json:"registered,omitempty"` // joined at run time, not from a config
	IsDead        bool   `json:"is_dead,omitempty"`    // held back by an operator
	WeightVersion string `json:"weight_version,omitempty"`
	// Stale says the worker has not loaded the fleet's weights (its update
	// failed or got no answer, or its catch-up has not run), whatever
	// version it shows: an update that reloads a checkpoint rewritten at
	// its path keeps the version.
	Stale bool `json:"stale,omitempty"`
	// WeightVersionSource is where the router learned WeightVersion (see
	// VersionSources); empty for SourceReported.
	WeightVersionSource string `json:"weight_version_source,omitempty"`
	// Unvouched says that, since the fleet's weights were declared, the
	// router cannot vouch for the worker's (see declare.go): it stays out
	// until a declaration names it, its checksums match, or an update
	// from disk through the router reaches it.
	Unvouched bool `json:"unvouched,omitempty"`
	// PausedSince is when a trainer paused the worker (pause_generation);
	// zero: not paused. A pause outlives the process: the trainer that
	// moves the weights may not be done when a router takes over.
	PausedSince time.Time `json:"paused_since,omitzero"`
}

// UpdateRecord is one call of a Record's updates, sent to workers as
// it was sent to the fleet.
type UpdateRecord struct {
	Path          string          `json:"path"`
	WeightVersion string          `json:"weight_version"`
	Body          json.RawMessage `json:"body"`
}

// Record is the pool's state to keep in storage.
func (p *Pool) Record() Record {
	p.mu.Lock()
	defer p.mu.Unlock()
	rec := Record{WeightVersion: p.fleet.version, Declared: p.fleet.declared, Checksums: maps.Clone(p.fleet.checksums),
		Versions: slices.Clone(p.fleet.versions), Workers: make([]WorkerRecord, len(p.workers))}
	for _, pol := range p.placement.order {
		if pol.publish > 0 {
			rec.Adapters = append(rec.Adapters, AdapterRecord{Name: pol.Name, Path: pol.Path, Strength: pol.Strength, Publish: pol.publish})
		}
	}
	for i, w := range p.workers {
		rec.Workers[i] = WorkerRecord{URL: w.url, Registered: w.registered, IsDead: w.life.dead, WeightVersion: w.life.version,
			Stale: w.life.state == Stale || w.life.behind != upToDate, PausedSince: pausedSince(w),
			WeightVersionSource: w.life.source, Unvouched: w.life.unvouched}
	}
	for _, u := range p.fleet.history {
		rec.Updates = append(rec.Updates, u.record())
	}
	if u := p.fleet.running; u != nil {
		rec.Updating = &RunningRecord{UpdateRecord: u.record(), Loaded: slices.Clone(p.fleet.loaded)}
	}
	return rec
}

// pausedSince is when w was paused, in UTC; zero when it is not.
func pausedSince(w *worker) time.Time {
	if w.life.pausedAt == 0 {
		return time.Time{}
	}
	return time.Unix(0, w.life.pausedAt).UTC()
}

// pausedAt is the pause r records, as a worker keeps it.
func (r WorkerRecord) pausedAt() int64 {
	if r.PausedSince.IsZero() {
		return 0
	}
	return r.PausedSince.UnixNano()
}

func (u Update) record() UpdateRecord {
	return UpdateRecord{Path: u.Path, WeightVersion: u.Version, Body: u.Body}
}

// update is the call r records, as the fleet replays it.
func (r UpdateRecord) update() Update {
	var body struct {
		ModelPath string `json:"model_path"`
	}
	_ = json.Unmarshal(r.Body, &body) // a LoRA call names none
	return Update{Path: r.Path, ModelPath: body.ModelPath, Version: r.WeightVersion, Mode: ModeDrain, Body: r.Body}
}

// Restore applies a record read back to the pool. Registered workers the
// pool lacks join, out until a health probe passes; workers held back
// stay held back. The record's weights (the fleet's version, the updates
// that lead there, each worker's version) are taken only if no update has
// run since the pool was made: otherwise the fleet is past them, and the
// workers read back catch up with it as any late joiner does. An update
// in progress as the record was written, its writer gone before it ended,
// is taken over as Inherit takes it over. It returns how many workers
// joined and whether the weights were taken.
func (p *Pool) Restore(rec Record) (joined int, adopted bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	f := &p.fleet
	adopted = f.version == "" && len(f.history) == 0
	var running *RunningRecord
	if adopted {
		rec, running = rec.finishing()
	}
	inRecord := make(map[*worker]bool, len(rec.Workers))
	for _, r := range rec.Workers {
		u, err := workerurl.Parse(r.URL)
		if err != nil {
			p.logger.Warn("worker read back from storage is not a worker URL; left out", zap.String("worker", r.URL), zap.Error(err))
			continue
		}
		w := p.findLocked(u)
		switch {
		case w == nil && !r.Registered:
			continue // the config listed it, and no longer does
		case w == nil:
			w = p.addLocked(u)
			w.health.down, w.health.unverified = true, true
			joined++
		}
		inRecord[w] = true
		w.registered = w.registered || r.Registered
		w.life.dead = w.life.dead || r.IsDead
		if w.life.pausedAt == 0 {
			w.life.pausedAt = r.pausedAt()
		}
		if adopted && r.WeightVersion != "" {
			w.life.version, w.life.source = r.WeightVersion, r.WeightVersionSource
		}
		w.life.unvouched = w.life.unvouched || adopted && r.Unvouched
		if adopted && r.Stale {
			p.fleet.missedLocked(w)
		}
	}
	if adopted && (len(rec.Updates) > 0 || rec.Declared) {
		f.version, f.history = rec.WeightVersion, rec.history()
		f.declared, f.checksums = rec.Declared, rec.Checksums
	}
	if adopted {
		f.versions = lastVersions(rec.Versions)
	}
	for _, w := range p.workers {
		switch {
		case adopted && !inRecord[w]:
			f.changedLocked(w) // only this config names it: no declaration did
		case adopted:
			f.recheckLocked(w)
		}
		f.holdIfBehindLocked(w)
	}
	if running != nil {
		p.inheritLocked(running)
	}
	p.takePublishesLocked(rec.Adapters, true)
	p.dispatchLocked()
	return joined, adopted
}

// history is the updates that bring a worker to the record's version.
func (rec Record) history() []Update {
	var out []Update
	for _, u := range rec.Updates {
		out = append(out, u.update())
	}
	return out
}

// Inherit mirrors rec for a router that takes the lead from the one that
// wrote it. An update that router had in progress is the fleet's from now
// on, as if it had ended there (see inheritLocked).
func (p *Pool) Inherit(rec Record) (joined, left int) {
	folded, running := rec.finishing()
	joined, left = p.Mirror(folded)
	if running != nil {
		p.mu.Lock()
		defer p.mu.Unlock()
		p.inheritLocked(running)
		p.dispatchLocked()
	}
	return joined, left
}

// finishing is rec with its update in progress, if any, folded in as if it
// had ended: the fleet on its version, the history after it. It returns
// that update too, nil when none was in progress.
func (rec Record) finishing() (Record, *RunningRecord) {
	running := rec.Updating
	if running == nil {
		return rec, nil
	}
	f := fleetState{version: rec.WeightVersion, history: rec.history(), declared: rec.Declared, checksums: rec.Checksums, versions: rec.Versions}
	f.advance(running.update())
	rec.WeightVersion, rec.Declared, rec.Checksums, rec.Versions = f.version, f.declared, f.checksums, f.versions
	rec.Updating, rec.Updates = nil, nil
	for _, h := range f.history {
		rec.Updates = append(rec.Updates, h.record())
	}
	return rec, running
}

// inheritLocked takes over running, the update the record's writer had in
// progress when it left, once the fleet is on its version: a worker the
// record shows as having loaded it serves, and every other one is stale
// until a catch-up, or the caller's retry of the update (see BeginUpdate),
// brings it there, whatever version it shows, so that no job is answered
// from the weights the update replaces.
func (p *Pool) inheritLocked(running *RunningRecord) {
	u := running.update()
	p.fleet.inherited, p.fleet.loaded = &u, nil
	for _, w := range p.workers {
		if slices.Contains(running.Loaded, w.url) {
			p.fleet.loaded = append(p.fleet.loaded, w.url)
		} else {
			p.fleet.behindLocked(w)
		}
	}
}

// Mirror makes what the record holds of the pool the record's, where
// Restore only adds to it: a standby follows the active router's record
// this way, and a router that takes the lead starts from the last record
// its predecessor wrote. Registered workers join and leave as the record
// has them (a worker that joins is out until a health probe passes),
// workers are held back or not, paused or not, and serve the weights the
// record says, and the fleet's weights are the record's even where the
// pool had others. It returns how many workers joined and left.
func (p *Pool) Mirror(rec Record) (joined, left int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	inRecord := make(map[*worker]bool, len(rec.Workers))
	var stale []*worker
	for _, r := range rec.Workers {
		u, err := workerurl.Parse(r.URL)
		if err != nil {
			continue // Restore logged it when the record was first read
		}
		w := p.findLocked(u)
		switch {
		case w == nil && !r.Registered:
			continue
		case w == nil:
			w = p.addLocked(u)
			w.health.down, w.health.unverified = true, true
			joined++
		}
		inRecord[w] = true
		w.registered, w.life.dead, w.life.version, w.life.pausedAt = r.Registered, r.IsDead, r.WeightVersion, r.pausedAt()
		w.life.source, w.life.unvouched = r.WeightVersionSource, r.Unvouched
		if r.Stale {
			stale = append(stale, w)
		}
	}
	for _, w := range slices.Clone(p.workers) {
		if !inRecord[w] && w.registered {
			w.registered = false
			if !p.heldLocked(w) {
				p.removeLocked(w)
				left++
			}
		}
	}
	p.fleet.version, p.fleet.history, p.fleet.inherited = rec.WeightVersion, rec.history(), nil
	p.fleet.declared, p.fleet.checksums = rec.Declared, rec.Checksums
	p.fleet.versions = lastVersions(rec.Versions)
	for _, w := range p.workers {
		if !inRecord[w] {
			p.fleet.changedLocked(w) // only this router's config names it: no declaration did
		}
		if slices.Contains(stale, w) {
			p.fleet.missedLocked(w)
		} else {
			p.fleet.matchVersionLocked(w)
		}
	}
	p.takePublishesLocked(rec.Adapters, false)
	p.dispatchLocked()
	return joined, left
}

// Reverify makes every worker unverified: out until a health probe
// passes, as the workers read back from storage are. A router that takes
// over its pool from another calls it: what it knows of the workers is as
// old as its last probe, and a worker that died meanwhile must not get the
// first jobs; with declared checksums, one that restarted meanwhile must
// not either.
func (p *Pool) Reverify() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, w := range p.workers {
		w.health.down, w.health.unverified = true, true
		p.fleet.recheckLocked(w)
	}
}

// Unverified returns the workers read back from storage, or left
// unverified by Reverify, that no health probe has judged yet.
func (p *Pool) Unverified() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []string
	for _, w := range p.workers {
		if w.health.unverified {
			out = append(out, w.url)
		}
	}
	return out
}
