package fleet

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

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
