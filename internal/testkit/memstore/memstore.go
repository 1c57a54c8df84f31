// Package memstore is a storage in memory whose reads and writes of the
// router's records can be made to fail or to wait, for tests of the fleet
// record. It has every method of a certmagic.Storage but Stat, which
// would make it import Caddy: internal/testrouter adds that one, so that
// routers started in tests can keep their records in it, while the
// scheduler's own tests use it as it is.
package memstore

import (
	"context"
	"errors"
	"io/fs"
	"slices"
	"strings"
	"sync"
)

// ErrDown is what a read or write made to fail returns.
var ErrDown = errors.New("storage is down")

// routerKeys starts the keys the router writes; Caddy's own (such as its
// TLS app's) are kept but never failed, gated or counted.
const routerKeys = "diffusion_router/"

// Storage is the storage. The zero value is not ready: use New.
type Storage struct {
	mu        sync.Mutex
	values    map[string][]byte
	stored    [][]byte      // every router record Store was given, in order
	loadFails int           // Load calls still to fail
	loadGate  chan struct{} // when set, Load waits for it to close, whatever its context says
	storeGate chan struct{} // when set, the next Store of a record waits for it to close and fails
	storing   chan struct{} // closed when a Store waits at the gate
}

// New returns an empty storage.
func New() *Storage {
	return &Storage{values: map[string][]byte{}}
}

// Put sets key to value, as a write by an earlier process left it.
func (s *Storage) Put(key string, value []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.values[key] = value
}

// Value returns what key holds.
func (s *Storage) Value(key string) ([]byte, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := s.values[key]
	return v, ok
}

// FailLoads makes the next n Load calls fail with ErrDown.
func (s *Storage) FailLoads(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.loadFails = n
}

// HangLoads makes Load wait, ignoring its context as a file system
// blocked on a FIFO does, until release is called.
func (s *Storage) HangLoads() (release func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	gate := make(chan struct{})
	s.loadGate = gate
	return sync.OnceFunc(func() { close(gate) })
}

// GateNextStore makes the next Store of a router record wait until release
// is called and then fail with ErrDown; storing is closed once it waits.
func (s *Storage) GateNextStore() (storing <-chan struct{}, release func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	gate := make(chan struct{})
	s.storeGate, s.storing = gate, make(chan struct{})
	return s.storing, sync.OnceFunc(func() { close(gate) })
}

// Stored returns every router record Store was given, in order, including
// the ones it failed.
func (s *Storage) Stored() [][]byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.stored)
}

// Store implements certmagic.Storage.
func (s *Storage) Store(_ context.Context, key string, value []byte) error {
	s.mu.Lock()
	if !strings.HasPrefix(key, routerKeys) {
		defer s.mu.Unlock()
		s.values[key] = value
		return nil
	}
	gate, storing := s.storeGate, s.storing
	s.storeGate = nil
	s.stored = append(s.stored, value)
	s.mu.Unlock()
	if gate != nil {
		close(storing)
		<-gate
		return ErrDown
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.values[key] = value
	return nil
}

// Load implements certmagic.Storage.
func (s *Storage) Load(_ context.Context, key string) ([]byte, error) {
	s.mu.Lock()
	if gate := s.loadGate; gate != nil {
		s.mu.Unlock()
		<-gate
		s.mu.Lock()
	}
	defer s.mu.Unlock()
	if s.loadFails > 0 {
		s.loadFails--
		return nil, ErrDown
	}
	v, ok := s.values[key]
	if !ok {
		return nil, fs.ErrNotExist
	}
	return v, nil
}

// Delete implements certmagic.Storage.
func (s *Storage) Delete(_ context.Context, key string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.values, key)
	return nil
}

// Exists implements certmagic.Storage.
func (s *Storage) Exists(_ context.Context, key string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.values[key]
	return ok
}

// List implements certmagic.Storage: the keys under prefix, at any depth.
func (s *Storage) List(_ context.Context, prefix string, _ bool) ([]string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var keys []string
	for k := range s.values {
		if strings.HasPrefix(k, prefix) {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	return keys, nil
}

// Lock implements certmagic.Storage; one process uses it.
func (s *Storage) Lock(context.Context, string) error { return nil }

// Unlock implements certmagic.Storage.
func (s *Storage) Unlock(context.Context, string) error { return nil }
