package scheduler

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/workerurl"
)

// The fleet outlives the process. Workers registered at run time (which
// is how miles adds its engines), the workers an operator held back and
// the weights the fleet was last brought to are kept in Caddy's
// configured storage (the file system by default, or whatever storage
// module a cluster already uses): written in the background on every
// change and read back when the pool first starts, so that a router
// killed and started again knows its fleet and its weight version. A
// worker read back gets no job before a health probe passes: it may have
// gone while the router was away.

// Timing of the fleet's record.
const (
	storeTimeout  = 30 * time.Second // one read or write of the record
	restoreWait   = 5 * time.Second  // longest a pool's first start waits for its record
	storeRetryMin = time.Second      // first wait after a failed read or write; doubles
	storeRetryMax = time.Minute
)

// Storage is what the pool needs of a certmagic.Storage, the type of
// caddy.Context.Storage. Load reports fs.ErrNotExist for a key never
// stored.
type Storage interface {
	Load(ctx context.Context, key string) ([]byte, error)
	Store(ctx context.Context, key string, value []byte) error
}

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
}

// WorkerRecord is one worker of a fleetRecord.
type WorkerRecord struct {
	URL           string `json:"url"`
	Registered    bool   `json:"registered,omitempty"` // joined at run time, not from a config
	IsDead        bool   `json:"is_dead,omitempty"`    // held back by an operator
	WeightVersion string `json:"weight_version,omitempty"`
}

// UpdateRecord is one call of a fleetRecord's updates, sent to workers as
// it was sent to the fleet.
type UpdateRecord struct {
	Path          string          `json:"path"`
	WeightVersion string          `json:"weight_version"`
	Body          json.RawMessage `json:"body"`
}

// fleetKey is where a pool's record lives in storage. The pool's name is
// escaped so that no name reaches outside diffusion_router/ or into
// another pool's folder.
func fleetKey(pool string) string {
	name := url.PathEscape(pool)
	if strings.HasPrefix(name, ".") { // "." and ".." are path segments of their own
		name = "%2E" + name[1:]
	}
	return "diffusion_router/" + name + "/fleet.json"
}

// FleetStore keeps a pool's record in storage. Changes only mark a write
// as due, so no request ever waits on storage; one goroutine of the pool
// writes the latest state, retrying in the background when storage fails.
type FleetStore struct {
	pool     *Pool
	key      string
	due      chan struct{} // holds a token while a write is due
	ready    chan struct{} // closed once the record was read back, or restoreWait after the pool started
	start    sync.Once
	setReady sync.Once
	retryMin time.Duration // storeRetryMin; tests shorten it

	restored atomic.Bool // the record was read back: writes may replace it

	// writing holds a token while a write runs: writes take turns, so that
	// the last one stored carries the newest state. A channel rather than a
	// mutex, so that a caller can give up waiting. Taken before mu.
	writing chan struct{}

	mu   sync.Mutex   // guards uses; taken before pool.mu when both are held
	uses []storageUse // one per loaded handler of the pool, the newest last
}

// errNotReadBack is why a change cannot be written yet: the record in
// storage has not been read back, and writing now would replace it.
var errNotReadBack = errors.New("the fleet's record in storage is not read back yet; the change is written once it is")

// storageUse is the storage one handler keeps its pool's record in.
type storageUse struct {
	owner   any
	storage Storage // nil: persist off
}

func newFleetStore(p *Pool) *FleetStore {
	return &FleetStore{
		pool: p, key: fleetKey(p.name), retryMin: storeRetryMin,
		due: make(chan struct{}, 1), ready: make(chan struct{}), writing: make(chan struct{}, 1),
	}
}

// Use keeps the record in storage (nil: nowhere) while owner's config is
// loaded; the config loaded last decides.
func (s *FleetStore) Use(owner any, storage Storage) {
	s.mu.Lock()
	s.uses = append(s.uses, storageUse{owner, storage})
	s.mu.Unlock()
	s.Changed() // the storage may be another
}

// Drop forgets owner's storage when its config is unloaded. A failed
// reload drops the new config's and leaves the old one's in use; once the
// last config is gone nothing is written, so that a shutdown, which
// withdraws the config's workers, is not recorded as workers leaving.
func (s *FleetStore) Drop(owner any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.uses = slices.DeleteFunc(s.uses, func(u storageUse) bool { return u.owner == owner })
}

// storageLocked is where the record goes now; nil: nowhere.
func (s *FleetStore) storageLocked() Storage {
	if len(s.uses) == 0 {
		return nil
	}
	return s.uses[len(s.uses)-1].storage
}

// Changed marks a write as due. It never blocks: writes coalesce, and the
// next one writes the state as it is then.
func (s *FleetStore) Changed() {
	select {
	case s.due <- struct{}{}:
	default:
	}
}

// StartOnce reads the record back and starts writing it, the first time
// the pool starts; it waits up to restoreWait for the record.
func (s *FleetStore) StartOnce() {
	s.start.Do(func() {
		s.pool.bg.Go("fleet record of pool "+s.pool.name, s.run)
		t := time.NewTimer(restoreWait)
		defer t.Stop()
		select {
		case <-s.ready:
		case <-t.C:
			s.pool.logger.Warn("the fleet's record is not read back yet; serving without it meanwhile", zap.String("key", s.key))
			s.markReady()
		}
	})
}

func (s *FleetStore) markReady() { s.setReady.Do(func() { close(s.ready) }) }

// AwaitReady holds a request that arrives while the pool, just started,
// reads its record back (at most restoreWait), so that nobody sees the
// fleet without the workers it had.
func (s *FleetStore) AwaitReady(ctx context.Context) {
	select {
	case <-s.ready:
	case <-ctx.Done():
	}
}

// run reads the record back, then writes it whenever it changes, until
// the pool ends.
func (s *FleetStore) run(ctx context.Context) {
	defer s.markReady()
	if !s.retry(ctx, "read", s.restore) {
		return
	}
	s.restored.Store(true)
	s.markReady()
	for {
		select {
		case <-s.due:
		case <-ctx.Done():
			return
		}
		if !s.retry(ctx, "write", s.write) {
			return
		}
	}
}

// retry runs op until it succeeds, waiting longer after each failure; it
// reports false if the pool ended first.
func (s *FleetStore) retry(ctx context.Context, what string, op func(context.Context) error) bool {
	wait := time.Duration(0)
	for {
		err := op(ctx)
		if err == nil {
			if wait > 0 {
				s.pool.logger.Info("storage works again for the fleet's record", zap.String("key", s.key), zap.String("operation", what))
			}
			return true
		}
		wait = min(max(2*wait, s.retryMin), storeRetryMax)
		s.pool.logger.Error("could not "+what+" the fleet's record in storage; retrying",
			zap.String("key", s.key), zap.Error(err), zap.Duration("retry_in", wait))
		if !Sleep(ctx, wait) {
			return false
		}
	}
}

// Persist writes the record now, for a control call that tells its
// caller whether its change is durable, and returns why not: the write's
// error, or errNotReadBack. Without storage there is nothing to write.
// A change it could not write stays due: the background writer retries.
func (s *FleetStore) Persist(ctx context.Context) error {
	s.mu.Lock()
	storage := s.storageLocked()
	s.mu.Unlock()
	switch {
	case storage == nil:
		return nil
	case !s.restored.Load():
		return errNotReadBack
	}
	err := s.write(ctx)
	if err != nil {
		s.Changed()
	}
	return err
}

// write stores the pool's state as it is now, which includes every change
// marked so far: a retry after a failure writes them all at once.
func (s *FleetStore) write(ctx context.Context) error {
	select {
	case s.writing <- struct{}{}:
		defer func() { <-s.writing }()
	case <-ctx.Done():
		return fmt.Errorf("storage is still busy with an earlier write: %w", ctx.Err())
	}
	select {
	case <-s.due:
	default:
	}
	s.mu.Lock()
	storage := s.storageLocked()
	var rec Record
	if storage != nil {
		rec = s.pool.record() // under s.mu: no config leaves between choosing the storage and reading the state
	}
	s.mu.Unlock()
	if storage == nil {
		return nil
	}
	data, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, storeTimeout)
	defer cancel()
	return storage.Store(ctx, s.key, data)
}

// restore reads the record back and applies it to the pool. No record is
// a new pool; a record that does not decode is logged and overwritten at
// the next change, since retrying cannot mend it.
func (s *FleetStore) restore(ctx context.Context) error {
	s.mu.Lock()
	storage := s.storageLocked()
	s.mu.Unlock()
	if storage == nil {
		return nil
	}
	loadCtx, cancel := context.WithTimeout(ctx, storeTimeout)
	data, err := storage.Load(loadCtx, s.key)
	cancel()
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil
	case err != nil:
		return err
	}
	var rec Record
	if err := json.Unmarshal(data, &rec); err != nil {
		return s.keepAside(ctx, storage, data, err)
	}
	// Not while a weight update runs: one that came in before the record
	// was read has moved the fleet past it.
	unlock, err := s.pool.fleet.Lock(ctx, true)
	if err != nil {
		return err
	}
	defer unlock()
	restored, adopted := s.pool.restore(rec)
	s.Changed() // the state read back and what changed meanwhile, merged
	s.pool.logger.Info("fleet read back from storage", zap.String("key", s.key),
		zap.Int("workers_read_back", restored), zap.Bool("weights_read_back", adopted), zap.String("weight_version", rec.WeightVersion))
	return nil
}

// keepAside stores a record that does not decode under a name of its own
// before the pool starts without it, since the next write replaces it:
// an operator can still read what it held. A record that cannot be kept
// aside is not replaced either: reading back is tried again.
func (s *FleetStore) keepAside(ctx context.Context, storage Storage, data []byte, why error) error {
	aside := s.key + ".unreadable-" + s.pool.now().UTC().Format("20060102T150405Z")
	ctx, cancel := context.WithTimeout(ctx, storeTimeout)
	defer cancel()
	if err := storage.Store(ctx, aside, data); err != nil {
		return fmt.Errorf("the record does not decode (%v) and could not be kept aside as %s: %w", why, aside, err)
	}
	s.pool.logger.Error("the fleet's record in storage is not valid; it is kept aside and the pool starts without it",
		zap.String("key", s.key), zap.String("kept_as", aside), zap.Error(why))
	return nil
}

// record is the pool's state to keep.
func (p *Pool) record() Record {
	p.mu.Lock()
	defer p.mu.Unlock()
	rec := Record{WeightVersion: p.fleet.version, Workers: make([]WorkerRecord, len(p.workers))}
	for i, w := range p.workers {
		rec.Workers[i] = WorkerRecord{URL: w.url, Registered: w.registered, IsDead: w.life.dead, WeightVersion: w.life.version}
	}
	for _, u := range p.fleet.history {
		rec.Updates = append(rec.Updates, UpdateRecord{Path: u.Path, WeightVersion: u.Version, Body: u.Body})
	}
	return rec
}

// restore applies a record read back to the pool. Registered workers the
// pool lacks join, out until a health probe passes; workers held back
// stay held back. The record's weights (the fleet's version, the updates
// that lead there, each worker's version) are taken only if no update has
// run since the pool was made: otherwise the fleet is past them, and the
// workers read back catch up with it as any late joiner does. It returns
// how many workers joined and whether the weights were taken.
func (p *Pool) restore(rec Record) (joined int, adopted bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	f := &p.fleet
	adopted = f.version == "" && len(f.history) == 0
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
		w.registered = w.registered || r.Registered
		w.life.dead = w.life.dead || r.IsDead
		if adopted && r.WeightVersion != "" {
			w.life.version = r.WeightVersion
		}
	}
	if adopted && len(rec.Updates) > 0 {
		f.version = rec.WeightVersion
		for _, u := range rec.Updates {
			f.history = append(f.history, Update{Path: u.Path, Version: u.WeightVersion, Mode: ModeDrain, Body: u.Body})
		}
	}
	for _, w := range p.workers {
		f.holdIfBehindLocked(w)
	}
	p.dispatchLocked()
	return joined, adopted
}

// Unverified returns the workers read back from storage that no health
// probe has judged yet.
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
