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

func TestFleetKeyStaysInItsFolder(t *testing.T) {
	for pool, want := range map[string]string{
		"default":  "diffusion_router/default/fleet.json",
		"..":       "diffusion_router/%2E./fleet.json",
		"a/../../": "diffusion_router/a%2F..%2F..%2F/fleet.json",
		`a\b`:      "diffusion_router/a%5Cb/fleet.json",
	} {
		if got := fleetKey(pool); got != want {
			t.Errorf("fleetKey(%q) = %q; want %q", pool, got, want)
		}
	}
}

// Nothing is written before the record is read back: a write would
// overwrite the fleet the process is about to learn. A read that fails is
// retried.
func TestFleetRecordReadBeforeAnyWrite(t *testing.T) {
	store := memstore.New()
	before := scheduler.New(t.Name(), zap.NewNop())
	before.Register("http://r:1", 10)
	data, _ := json.Marshal(before.Record())
	store.Put(fleetKey(t.Name()), data)
	store.FailLoads(2)

	p := scheduler.New(t.Name(), zap.NewNop())
	t.Cleanup(func() { _ = p.Close() })
	s := NewStore(p, New(p, zap.NewNop()), zap.NewNop())
	s.retryMin = time.Millisecond
	s.Use(nil, store, Rules{})
	p.Register("http://n:1", 10) // registered before the record was read
	s.StartOnce()
	if got, want := p.URLs(), []string{"http://n:1", "http://r:1"}; !slices.Equal(got, want) {
		t.Fatalf("workers once started: %v; want %v", got, want)
	}
	if !testkit.WaitUntil(30*time.Second, func() bool { return len(store.Stored()) > 0 }) {
		t.Fatal("the merged fleet was never written")
	}
	for _, v := range store.Stored() {
		if !strings.Contains(string(v), "http://r:1") || !strings.Contains(string(v), "http://n:1") {
			t.Fatalf("a write lost part of the fleet: %s", v)
		}
	}
}

// A pool that ends while its record waits to be written, as at every
// reload, logs no error: nothing failed, and nothing is retried.
func TestAnEndedPoolLogsNoFailedWrite(t *testing.T) {
	p := scheduler.New(t.Name(), zap.NewNop())
	t.Cleanup(func() { _ = p.Close() })
	core, logs := observer.New(zap.InfoLevel)
	s := NewStore(p, New(p, zap.NewNop()), zap.New(core))
	s.Use(nil, memstore.New(), Rules{})
	s.writing <- struct{}{} // a write under way, as a control call's Persist makes
	ended, end := context.WithCancel(context.Background())
	end()
	if s.retry(ended, "write", s.write) {
		t.Fatal("the write of an ended pool reported success")
	}
	if n := logs.Len(); n != 0 {
		t.Fatalf("the ended pool logged %d lines, first %q; want none", n, logs.All()[0].Message)
	}
}
