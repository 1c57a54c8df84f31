package fleet

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

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
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
	storeTimeout  = 3 * time.Second // one read or write of the record: start, reload and SIGTERM wait no longer
	restoreWait   = 5 * time.Second // longest a pool's first start waits for its record
	storeRetryMin = time.Second     // first wait after a failed read or write; doubles
	storeRetryMax = time.Minute
)

// Storage is what the pool needs of a certmagic.Storage, the type of
// caddy.Context.Storage. Load reports fs.ErrNotExist for a key never
// stored.
type Storage interface {
	Load(ctx context.Context, key string) ([]byte, error)
	Store(ctx context.Context, key string, value []byte) error
}

// ErrNotWriter is what a Storage that a group of routers shares returns
// from Store on a router that must not write the record: the group's
// active router writes it. It is no failure: nothing is retried.
var ErrNotWriter = errors.New("another router of the pool's group writes the fleet's record")

// Watcher is a Storage whose record another router writes: a standby
// follows it from there, to take over with the fleet as it was.
type Watcher interface {
	// Watch sends the record under key as it is, then each time it is
	// written, until ctx ends.
	Watch(ctx context.Context, key string) <-chan []byte
}

// Fenced is a Storage shared by a group of routers whose writer changes:
// the state a write carries must have been read while the router held the
// right to write it, not before it took over from another.
type Fenced interface {
	// Writer, asked before the state is read, is a Store bound to the
	// right to write the router holds now; false when it holds none.
	Writer() (store func(ctx context.Context, key string, value []byte) error, ok bool)
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

// Store keeps a pool's record in storage. Changes only mark a write
// as due, so no request ever waits on storage; one goroutine of the pool
// writes the latest state, retrying in the background when storage fails.
type Store struct {
	pool     Recorded
	fleet    *Fleet
	logger   *zap.Logger
	key      string
	ready    chan struct{} // closed once the record was read back, or restoreWait after the pool started
	start    sync.Once
	setReady sync.Once
	retryMin time.Duration // storeRetryMin; tests shorten it

	restored atomic.Bool // the record was read back: writes may replace it

	// writing holds a token while a write runs: writes take turns, so that
	// the last one stored carries the newest state. A channel rather than a
	// mutex, so that a caller can give up waiting. Taken before mu.
	writing chan struct{}

	mu   sync.Mutex   // guards uses; taken before the pool's lock when both are held
	uses []storageUse // one per loaded handler of the pool, the newest last
}

// errNotReadBack is why a change cannot be written yet: the record in
// storage has not been read back, and writing now would replace it.
var errNotReadBack = errors.New("the fleet's record in storage is not read back yet; the change is written once it is")

// storageUse is the storage one handler keeps its pool's record in.
type storageUse struct {
	owner   any
	storage Storage // nil: persist off
	rules   Rules   // what a record read back must pass
}

// NewStore returns the keeper of pool's record, whose reading back waits
// for fleet's other operations, and which logs to logger.
func NewStore(pool Recorded, fleet *Fleet, logger *zap.Logger) *Store {
	return &Store{
		pool: pool, fleet: fleet, logger: logger, key: fleetKey(pool.Name()), retryMin: storeRetryMin,
		ready: make(chan struct{}), writing: make(chan struct{}, 1),
	}
}

// Use keeps the record in storage (nil: nowhere) while owner's config is
// loaded, a record read back checked by rules; the config loaded last
// decides.
func (s *Store) Use(owner any, storage Storage, rules Rules) {
	s.mu.Lock()
	s.uses = append(s.uses, storageUse{owner, storage, rules})
	s.mu.Unlock()
	s.Changed() // the storage may be another
}

// Drop forgets owner's storage when its config is unloaded. A failed
// reload drops the new config's and leaves the old one's in use; once the
// last config is gone nothing is written, so that a shutdown, which
// withdraws the config's workers, is not recorded as workers leaving.
func (s *Store) Drop(owner any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.uses = slices.DeleteFunc(s.uses, func(u storageUse) bool { return u.owner == owner })
}

// storageLocked is where the record goes now; nil: nowhere.
func (s *Store) storageLocked() Storage {
	return s.useLocked().storage
}

// useLocked is the use of the config loaded last; none without a config.
func (s *Store) useLocked() storageUse {
	if len(s.uses) == 0 {
		return storageUse{}
	}
	return s.uses[len(s.uses)-1]
}

// Changed marks a write as due. It never blocks: writes coalesce, and the
// next one writes the state as it is then.
func (s *Store) Changed() { s.pool.Changed() }

// StartOnce reads the record back and starts writing it, the first time
// the pool starts; it waits up to restoreWait for the record.
func (s *Store) StartOnce() {
	s.start.Do(func() {
		s.pool.Go("fleet record of pool "+s.pool.Name(), s.run)
		t := time.NewTimer(restoreWait)
		defer t.Stop()
		select {
		case <-s.ready:
		case <-t.C:
			s.logger.Warn("the fleet's record is not read back yet; serving without it meanwhile", zap.String("key", s.key))
			s.markReady()
		}
	})
}

func (s *Store) markReady() { s.setReady.Do(func() { close(s.ready) }) }

// AwaitReady holds a request that arrives while the pool, just started,
// reads its record back (at most restoreWait), so that nobody sees the
// fleet without the workers it had.
func (s *Store) AwaitReady(ctx context.Context) {
	select {
	case <-s.ready:
		return // as for every request once the pool has started: no select over ctx too
	default:
	}
	select {
	case <-s.ready:
	case <-ctx.Done():
	}
}

// run reads the record back, then writes it whenever it changes, until
// the pool ends.
func (s *Store) run(ctx context.Context) {
	defer s.markReady()
	if !s.retry(ctx, "read", s.restore) {
		return
	}
	s.restored.Store(true)
	s.markReady()
	for {
		select {
		case <-s.pool.Changes():
		case <-ctx.Done():
			return
		}
		if !s.retry(ctx, "write", s.writeDue) {
			return
		}
	}
}

// writeDue writes the record if this router is its writer.
func (s *Store) writeDue(ctx context.Context) error {
	if err := s.write(ctx); !errors.Is(err, ErrNotWriter) {
		return err
	}
	return nil
}

// retry runs op until it succeeds, waiting longer after each failure; it
// reports false if the pool ended first.
func (s *Store) retry(ctx context.Context, what string, op func(context.Context) error) bool {
	wait := time.Duration(0)
	for {
		err := op(ctx)
		if err == nil {
			if wait > 0 {
				s.logger.Info("storage works again for the fleet's record", zap.String("key", s.key), zap.String("operation", what))
			}
			return true
		}
		if ctx.Err() != nil {
			return false // the pool ended, as at every reload: nothing failed, nothing is retried
		}
		wait = min(max(2*wait, s.retryMin), storeRetryMax)
		s.logger.Error("could not "+what+" the fleet's record in storage; retrying",
			zap.String("key", s.key), zap.Error(err), zap.Duration("retry_in", wait))
		if !scheduler.Sleep(ctx, wait) {
			return false
		}
	}
}

// Persist writes the record now, for a control call that tells its
// caller whether its change is durable, and returns why not: the write's
// error, or errNotReadBack. Without storage there is nothing to write.
// A change it could not write stays due: the background writer retries.
func (s *Store) Persist(ctx context.Context) error {
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
func (s *Store) write(ctx context.Context) error {
	select {
	case s.writing <- struct{}{}:
		defer func() { <-s.writing }()
	case <-ctx.Done():
		return fmt.Errorf("storage is still busy with an earlier write: %w", ctx.Err())
	}
	select {
	case <-s.pool.Changes():
	default:
	}
	s.mu.Lock()
	storage := s.storageLocked()
	if storage == nil {
		s.mu.Unlock()
		return nil
	}
	store, ok := writerOf(storage)
	var rec scheduler.Record
	if ok {
		rec = s.pool.Record() // under s.mu: no config leaves between choosing the storage and reading the state
	}
	s.mu.Unlock()
	if !ok {
		return ErrNotWriter
	}
	data, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	return within(ctx, func(ctx context.Context) error { return store(ctx, s.key, data) })
}

// writerOf is how a write of the pool's state goes to storage: for a
// Fenced storage, bound to the right to write this router holds as the
// state is read, so that a write carries only state read while it held it.
func writerOf(storage Storage) (store func(ctx context.Context, key string, value []byte) error, ok bool) {
	if f, fenced := storage.(Fenced); fenced {
		return f.Writer()
	}
	return storage.Store, true
}

// within runs a storage call for at most storeTimeout, and returns when
// that has passed even if the call has not: a storage that ignores its
// context (a file system blocked on a FIFO, a hung network volume) must
// not hold up a start, a reload or a shutdown. Such a call ends on its
// own, or with the process. A call that ctx ends early is waited for,
// so that no write outlives the pool that made it.
func within(ctx context.Context, call func(ctx context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, storeTimeout)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- call(ctx) }()
	limit := time.NewTimer(storeTimeout)
	defer limit.Stop()
	select {
	case err := <-done:
		return err
	case <-limit.C:
		return fmt.Errorf("storage did not answer within %s", storeTimeout)
	}
}

// restore reads the record back and applies it to the pool. No record is
// a new pool. What does not pass the checks of the config loaded last is
// left out, entry by entry, and logged; whenever anything is left out, a
// copy of the record as read is kept aside first, since the next write
// replaces it. A record that cannot be kept aside is not replaced either:
// reading back is tried again.
func (s *Store) restore(ctx context.Context) error {
	use := s.use()
	data, err := s.load(ctx, use)
	if data == nil {
		return err
	}
	rec, err := s.checked(ctx, use, data)
	if rec == nil {
		return err
	}
	return s.apply(ctx, func() {
		restored, adopted := s.pool.Restore(*rec)
		s.logger.Info("fleet read back from storage", zap.String("key", s.key),
			zap.Int("workers_read_back", restored), zap.Bool("weights_read_back", adopted), zap.String("weight_version", rec.WeightVersion))
	})
}

// Reload makes the pool a mirror of its record as stored now, for a
// router that takes the lead of its group from another: it starts from
// the last record its predecessor wrote, not from what it saw of it. It
// checks the record as restore does; with no record it leaves the pool as
// it is.
func (s *Store) Reload(ctx context.Context) error {
	use := s.use()
	data, err := s.load(ctx, use)
	var rec *scheduler.Record
	if data != nil {
		rec, err = s.checked(ctx, use, data)
	}
	if rec != nil {
		err = s.apply(ctx, func() {
			joined, left := s.pool.Inherit(*rec)
			s.logger.Info("fleet read from the group's record as this router takes the lead", zap.String("key", s.key),
				zap.Int("workers_joined", joined), zap.Int("workers_left", left), zap.String("weight_version", s.pool.Stats().Version),
				zap.Bool("update_inherited", rec.Updating != nil))
		})
	}
	if err == nil {
		s.restored.Store(true)
		s.markReady()
	}
	return err
}

// Follow keeps the pool a mirror of the record another router writes,
// until ctx ends: a standby's view of the fleet stays warm, so that it
// can take over at once. A storage that is not a Watcher has no other
// writer, and Follow returns at once.
func (s *Store) Follow(ctx context.Context) {
	watcher, ok := s.use().storage.(Watcher)
	if !ok {
		return
	}
	for data := range watcher.Watch(ctx, s.key) {
		rec, _ := s.checked(ctx, s.use(), data) // by the rules of the config loaded last; what cannot be read is logged
		if rec == nil {
			continue // the standby keeps its view
		}
		if s.apply(ctx, func() { s.mirror(*rec) }) != nil {
			return
		}
	}
}

// mirror applies rec with Pool.Mirror, as a standby follows the record.
func (s *Store) mirror(rec scheduler.Record) {
	joined, left := s.pool.Mirror(rec)
	s.logger.Debug("fleet mirrored from the group's record", zap.String("key", s.key),
		zap.Int("workers_joined", joined), zap.Int("workers_left", left), zap.String("weight_version", rec.WeightVersion))
}

// use is the storage of the config loaded last.
func (s *Store) use() storageUse {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.useLocked()
}

// load reads the record from use's storage: nil and no error for none.
func (s *Store) load(ctx context.Context, use storageUse) ([]byte, error) {
	if use.storage == nil {
		return nil, nil
	}
	var data []byte
	err := within(ctx, func(ctx context.Context) (err error) {
		data, err = use.storage.Load(ctx, s.key)
		return err
	})
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	return data, err
}

// checked is the record in data as use's rules let it be read, nil if
// none of it can be: what does not pass is left out and logged, once the
// record as read is kept aside.
func (s *Store) checked(ctx context.Context, use storageUse, data []byte) (*scheduler.Record, error) {
	if len(data) > maxRecord {
		return nil, s.keepAside(ctx, use.storage, data, fmt.Errorf("the record is %d bytes; a pool's record is at most %d", len(data), maxRecord))
	}
	rec, left, err := readRecord(data, use.rules)
	if err != nil {
		return nil, s.keepAside(ctx, use.storage, data, err)
	}
	if len(left) > 0 {
		if err := s.keepAside(ctx, use.storage, data, fmt.Errorf("%d entries do not pass the checks", len(left))); err != nil {
			return nil, err
		}
		for _, d := range left {
			s.logger.Warn("entry of the fleet's record read back left out", zap.String("key", s.key), zap.String("entry", d.entry), zap.Error(d.why))
		}
	}
	return &rec, nil
}

// apply changes the pool by a record read, not while a weight update
// runs: one that came in before the record was read has moved the fleet
// past it. What changed meanwhile is merged into the next write.
func (s *Store) apply(ctx context.Context, change func()) error {
	unlock, err := s.fleet.Lock(ctx, true)
	if err != nil {
		return err
	}
	defer unlock()
	change()
	s.Changed()
	return nil
}

// keepAside stores the record as read under a name of its own before the
// pool starts without it, or without part of it, as why says: an operator
// can still read what it held.
func (s *Store) keepAside(ctx context.Context, storage Storage, data []byte, why error) error {
	aside := s.key + ".unreadable-" + time.Now().UTC().Format("20060102T150405Z")
	err := within(ctx, func(ctx context.Context) error { return storage.Store(ctx, aside, data) })
	if errors.Is(err, ErrNotWriter) {
		s.logger.Warn("the fleet's record is not all valid; the pool's active router keeps it aside, and this one reads it without what is not",
			zap.String("key", s.key), zap.Error(why))
		return nil
	}
	if err != nil {
		return fmt.Errorf("the record read back is not all valid (%v) and could not be kept aside as %s: %w", why, aside, err)
	}
	s.logger.Error("the fleet's record in storage is not all valid; it is kept aside as read, and the pool starts without what is not",
		zap.String("key", s.key), zap.String("kept_as", aside), zap.Error(why))
	return nil
}
