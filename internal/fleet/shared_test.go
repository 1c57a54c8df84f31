package fleet

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/memstore"
)

// shared is a record a group of routers shares, seen from a standby: it
// writes nothing, and the leader's writes come through writes.
type shared struct {
	*memstore.Storage
	writes chan []byte
}

func (s *shared) Store(context.Context, string, []byte) error { return ErrNotWriter }

func (s *shared) Watch(ctx context.Context, _ string) <-chan []byte {
	out := make(chan []byte)
	go func() {
		defer close(out)
		for {
			select {
			case v := <-s.writes:
				out <- v
			case <-ctx.Done():
				return
			}
		}
	}()
	return out
}

// recordOf is the record of a pool with the workers registered and the
// fleet at version.
func recordOf(t *testing.T, version string, registered ...string) []byte {
	t.Helper()
	p := scheduler.New("leader", zap.NewNop())
	t.Cleanup(func() { _ = p.Close() })
	for _, u := range registered {
		p.Register(u, 10)
	}
	rec := p.Record()
	rec.WeightVersion = version
	rec.Updates = []scheduler.UpdateRecord{{Path: scheduler.DiskUpdatePath, WeightVersion: version, Body: json.RawMessage(`{"model_path":"/ckpt/` + version + `"}`)}}
	data, err := json.Marshal(rec)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// A standby's pool follows the leader's record as it is written, and the
// standby writes nothing, nor logs any failure to.
func TestStandbyFollowsTheRecordAndWritesNothing(t *testing.T) {
	storage := &shared{Storage: memstore.New(), writes: make(chan []byte)}
	p := scheduler.New(t.Name(), zap.NewNop())
	t.Cleanup(func() { _ = p.Close() })
	core, logs := observer.New(zap.WarnLevel)
	s := NewStore(p, New(p, zap.NewNop()), zap.New(core))
	s.Use(nil, storage, Rules{})
	s.StartOnce()
	ctx, cancel := context.WithCancel(context.Background())
	following := make(chan struct{})
	go func() { defer close(following); s.Follow(ctx) }()

	storage.writes <- recordOf(t, "step-1", "http://r:1", "http://s:1")
	storage.writes <- recordOf(t, "step-2", "http://s:1") // r deregistered on the leader
	storage.writes <- recordOf(t, "step-2", "http://s:1") // the same again: the one before was applied
	storage.writes <- recordOf(t, "step-2", "http://s:1")
	if got, want := p.URLs(), []string{"http://s:1"}; !slices.Equal(got, want) {
		t.Fatalf("the standby's workers: %v; want the leader's, %v", got, want)
	}
	if v := p.Stats().Version; v != "step-2" {
		t.Fatalf("the standby's weight version: %q; want the leader's, step-2", v)
	}
	p.Changed()
	if err := s.writeDue(ctx); err != nil {
		t.Fatalf("a standby's due write: %v; want nothing to do", err)
	}
	cancel()
	select {
	case <-following:
	case <-time.After(10 * time.Second):
		t.Fatal("Follow did not return once its context ended")
	}
	if n := logs.Len(); n != 0 {
		t.Fatalf("the standby logged %d warnings, first %q; want none", n, logs.All()[0].Message)
	}
}

// A router taking the lead reloads the record as stored: it drops what it
// saw of an older one and takes the weights, even past its own.
func TestReloadMirrorsTheStoredRecord(t *testing.T) {
	storage := memstore.New()
	p := scheduler.New(t.Name(), zap.NewNop())
	t.Cleanup(func() { _ = p.Close() })
	s := NewStore(p, New(p, zap.NewNop()), zap.NewNop())
	s.Use(nil, storage, Rules{})
	storage.Put(fleetKey(t.Name()), recordOf(t, "step-1", "http://old:1"))
	s.StartOnce()
	written := func(worker string) bool {
		stored := storage.Stored()
		return len(stored) > 0 && strings.Contains(string(stored[len(stored)-1]), worker)
	}
	if !testkit.WaitUntil(30*time.Second, func() bool { return written("http://old:1") }) {
		t.Fatal("the record read back was never written")
	}
	storage.Put(fleetKey(t.Name()), recordOf(t, "step-2", "http://new:1")) // as the leader before this one wrote it
	if err := s.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got, want := p.URLs(), []string{"http://new:1"}; !slices.Equal(got, want) {
		t.Fatalf("workers after the reload: %v; want %v", got, want)
	}
	if v := p.Stats().Version; v != "step-2" {
		t.Fatalf("weight version after the reload: %q; want step-2", v)
	}
	if !testkit.WaitUntil(30*time.Second, func() bool { return written("http://new:1") }) {
		t.Fatal("the leader never wrote the record it reloaded")
	}
}
