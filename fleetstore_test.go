package diffusionrouter

import (
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/certmagic"

	"github.com/miles-rollout/miles-diffusion-router/examples/fakeworker"
)

// applyUpdate records a weight update that succeeded on every worker of
// p, as the fleet does at the end of one.
func applyUpdate(p *pool, path, version, body string) {
	req := weightsRequest{path: path, version: version, mode: modeDrain, body: []byte(body)}
	p.mu.Lock()
	workers := slices.Clone(p.workers)
	p.mu.Unlock()
	results := make([]result, len(workers))
	for i := range results {
		results[i].ok = true
	}
	p.fleet.finishUpdate(workers, results, version)
	p.fleet.end(results, req)
}

// throughStorage is rec as a later process reads it back.
func throughStorage(t *testing.T, rec fleetRecord) fleetRecord {
	t.Helper()
	data, err := json.Marshal(rec)
	if err != nil {
		t.Fatal(err)
	}
	var back fleetRecord
	if err := json.Unmarshal(data, &back); err != nil {
		t.Fatal(err)
	}
	return back
}

func infoOf(t *testing.T, p *pool, u string) workerInfo {
	t.Helper()
	info, ok := p.worker(u)
	if !ok {
		t.Fatalf("worker %s is not in the pool", u)
	}
	return info
}

func TestFleetReadBackAfterRestart(t *testing.T) {
	before, _ := poolOf(t, 2) // a and b from the config
	registerRaw(before, "http://r:1")
	registerRaw(before, "http://s:1")
	applyUpdate(before, diskUpdatePath, "step-7", `{"model_path":"/ckpt/7"}`)
	applyUpdate(before, "/v1/set_lora", "step-7+lora:x", `{"lora_nickname":"x","lora_path":"/lora/x"}`)
	before.setDead("http://s:1", true)
	before.setDead("http://a:1", true)

	// The process starts again, with a config that lists a but no longer b.
	after := newPool(t.Name())
	after.declare([]string{"http://a:1"})
	joined, adopted := after.restore(throughStorage(t, before.record()))

	if joined != 2 || !adopted {
		t.Fatalf("restore: %d joined, weights taken %v; want 2 and true", joined, adopted)
	}
	if got, want := workerURLs(after), []string{"http://a:1", "http://r:1", "http://s:1"}; !slices.Equal(got, want) {
		t.Fatalf("workers read back: %v; want %v (b left the config)", got, want)
	}
	if v := after.stats().version; v != "step-7+lora:x" {
		t.Fatalf("weight version read back: %q", v)
	}
	for u, want := range map[string]workerState{"http://a:1": dead, "http://r:1": unhealthy, "http://s:1": dead} {
		info := infoOf(t, after, u)
		if info.State != want || info.Version != "step-7+lora:x" {
			t.Errorf("%s read back %s on %q; want %s on step-7+lora:x", u, info.State, info.Version, want)
		}
		if (info.Source == "registered") != (u != "http://a:1") {
			t.Errorf("%s read back from source %s", u, info.Source)
		}
	}
	// A worker that joins now is brought to the weights read back by the
	// same calls, in the same order.
	var replayed []string
	for _, req := range after.fleet.history {
		replayed = append(replayed, req.path+" "+string(req.body))
	}
	if want := []string{`/update_weights_from_disk {"model_path":"/ckpt/7"}`, `/v1/set_lora {"lora_nickname":"x","lora_path":"/lora/x"}`}; !slices.Equal(replayed, want) {
		t.Fatalf("updates read back: %q; want %q", replayed, want)
	}

	// The worker read back gets jobs once a probe passes, one being enough.
	if got := after.recordProbe("http://r:1", nil, testHealth); got != becameHealthy {
		t.Fatalf("first passed probe of a worker read back: %v; want becameHealthy", got)
	}
	if info := infoOf(t, after, "http://r:1"); info.State != serving {
		t.Fatalf("worker read back is %s after its probe passed", info.State)
	}
}

func TestWorkerReadBackFailingItsProbeIsUnhealthy(t *testing.T) {
	before := newPool(t.Name())
	registerRaw(before, "http://r:1")
	after := newPool(t.Name())
	after.restore(throughStorage(t, before.record()))
	if urls := after.unverified(); !slices.Equal(urls, []string{"http://r:1"}) {
		t.Fatalf("unverified = %v", urls)
	}
	after.recordProbe("http://r:1", errProbe, testHealth)
	if after.recordProbe("http://r:1", nil, testHealth) != unchanged || infoOf(t, after, "http://r:1").State != unhealthy {
		t.Fatal("a worker read back that failed its first probe serves after one pass; want health_passes (2)")
	}
	if after.recordProbe("http://r:1", nil, testHealth) != becameHealthy {
		t.Fatal("the worker read back did not come back after health_passes passes")
	}
	if urls := after.unverified(); len(urls) != 0 {
		t.Fatalf("unverified = %v after probes", urls)
	}
}

// An update that ran before the record was read is newer than it: the
// pool keeps its weights, and a worker read back catches up with them.
func TestRecordOlderThanAnUpdateLeavesTheWeights(t *testing.T) {
	before := newPool(t.Name())
	registerRaw(before, "http://r:1")
	applyUpdate(before, diskUpdatePath, "step-7", `{"model_path":"/ckpt/7"}`)

	after, _ := poolOf(t, 1)
	applyUpdate(after, diskUpdatePath, "step-8", `{"model_path":"/ckpt/8"}`)
	if _, adopted := after.restore(throughStorage(t, before.record())); adopted {
		t.Fatal("the record's weights replaced those of a later update")
	}
	if v := after.stats().version; v != "step-8" {
		t.Fatalf("weight version %q; want step-8", v)
	}
	if info := infoOf(t, after, "http://r:1"); info.Lifecycle != updating || info.Version == "step-8" {
		t.Fatalf("worker read back is %s on %q; want updating (to catch up with step-8)", info.Lifecycle, info.Version)
	}
}

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

// fakeStorage is a certmagic.Storage in memory whose reads and writes can
// be made to fail or to wait.
type fakeStorage struct {
	mu        sync.Mutex
	values    map[string][]byte
	stored    [][]byte      // every fleet record Store was given, in order
	loadFails int           // Load calls still to fail
	storeGate chan struct{} // when set, the next Store of a record waits for it to close and fails
	storing   chan struct{} // closed when a Store waits at the gate
}

func newFakeStorage() *fakeStorage {
	return &fakeStorage{values: map[string][]byte{}}
}

var errStorageDown = errors.New("storage is down")

func (s *fakeStorage) Store(_ context.Context, key string, value []byte) error {
	s.mu.Lock()
	if !strings.HasPrefix(key, "diffusion_router/") { // Caddy's own, such as its TLS app's
		defer s.mu.Unlock()
		s.values[key] = value
		return nil
	}
	gate := s.storeGate
	s.storeGate = nil
	s.stored = append(s.stored, value)
	s.mu.Unlock()
	if gate != nil {
		close(s.storing)
		<-gate
		return errStorageDown
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.values[key] = value
	return nil
}

func (s *fakeStorage) Load(_ context.Context, key string) ([]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.loadFails > 0 {
		s.loadFails--
		return nil, errStorageDown
	}
	v, ok := s.values[key]
	if !ok {
		return nil, fs.ErrNotExist
	}
	return v, nil
}

func (s *fakeStorage) Delete(_ context.Context, key string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.values, key)
	return nil
}

func (s *fakeStorage) Exists(_ context.Context, key string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.values[key]
	return ok
}

func (s *fakeStorage) List(context.Context, string, bool) ([]string, error) {
	return nil, errors.New("not listed")
}

func (s *fakeStorage) Stat(context.Context, string) (certmagic.KeyInfo, error) {
	return certmagic.KeyInfo{}, errors.New("no stat")
}

func (s *fakeStorage) Lock(context.Context, string) error   { return nil }
func (s *fakeStorage) Unlock(context.Context, string) error { return nil }

// record is the fleet record stored under the default pool's key.
func (s *fakeStorage) record(t *testing.T) (fleetRecord, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	data, ok := s.values[fleetKey(defaultPoolName)]
	var rec fleetRecord
	if ok {
		if err := json.Unmarshal(data, &rec); err != nil {
			t.Fatalf("stored record is not JSON: %v", err)
		}
	}
	return rec, ok
}

func (s *fakeStorage) stores() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.stored)
}

// testStorage is Caddy's storage module diffusion_test: the fakeStorage a
// test put in testStorages, for `storage diffusion_test` in the Caddyfile.
type testStorage struct{}

var testStorages atomic.Pointer[fakeStorage]

func init() {
	caddy.RegisterModule(testStorage{})
}

func (testStorage) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "caddy.storage.diffusion_test", New: func() caddy.Module { return new(testStorage) }}
}

func (testStorage) CertMagicStorage() (certmagic.Storage, error) { return testStorages.Load(), nil }

func (testStorage) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	return nil
}

// A write that fails is retried in the background, with the state as it
// is by then; requests meanwhile are answered at once, whatever storage
// does.
func TestFleetRecordWriteRetriedWithoutBlockingRequests(t *testing.T) {
	store := newFakeStorage()
	gate := make(chan struct{})
	store.storeGate, store.storing = gate, make(chan struct{})
	testStorages.Store(store)
	ws := startWorkers(t, fakeworker.Config{Name: "a"}, fakeworker.Config{Name: "b"}, fakeworker.Config{Name: "c"})
	r := startRouterWith(t, "storage diffusion_test", "diffusion_router {\n workers "+ws[0].URL()+"\n}")

	select { // the first write of the pool hangs in storage
	case <-store.storing:
	case <-time.After(30 * time.Second):
		t.Fatal("the pool wrote nothing within 30 s of starting")
	}
	expectStatus(t, "add_worker", r.post("/add_worker?url="+ws[1].URL(), ""), 200)
	expectStatus(t, "POST /workers", r.post("/workers", `{"url":"`+ws[2].URL()+`"}`), 200)
	expectStatus(t, "hold back", do(t, "PUT", r.base+"/workers/"+url.QueryEscape(ws[2].URL()), strings.NewReader(`{"is_dead":true}`)), 200)
	expectStatus(t, "generation", r.post("/v1/images/generations", smallImage), 200)
	close(gate) // the hung write fails

	want := []workerRecord{{URL: ws[0].URL()}, {URL: ws[1].URL(), Registered: true}, {URL: ws[2].URL(), Registered: true, IsDead: true}}
	var rec fleetRecord
	if !waitUntilOr(30*time.Second, func() bool {
		var ok bool
		rec, ok = store.record(t)
		return ok
	}) {
		t.Fatal("the failed write was not retried within 30 s")
	}
	for i := range rec.Workers {
		rec.Workers[i].WeightVersion = "" // the model id, known once a probe answered
	}
	if !slices.Equal(rec.Workers, want) {
		t.Fatalf("stored workers %+v; want %+v", rec.Workers, want)
	}
	if n := store.stores(); n != 2 {
		t.Fatalf("%d writes; want 2: the one that failed, then one with every change since", n)
	}
}

// Nothing is written before the record is read back: a write would
// overwrite the fleet the process is about to learn. A read that fails is
// retried.
func TestFleetRecordReadBeforeAnyWrite(t *testing.T) {
	store := newFakeStorage()
	before := newPool(t.Name())
	registerRaw(before, "http://r:1")
	data, _ := json.Marshal(before.record())
	store.values[fleetKey(t.Name())] = data
	store.loadFails = 2

	p := newPool(t.Name())
	t.Cleanup(func() { _ = p.Destruct() })
	p.store.retryMin = time.Millisecond
	p.store.use(nil, store)
	registerRaw(p, "http://n:1") // registered before the record was read
	p.store.startOnce()
	if got, want := workerURLs(p), []string{"http://n:1", "http://r:1"}; !slices.Equal(got, want) {
		t.Fatalf("workers once started: %v; want %v", got, want)
	}
	if !waitUntilOr(30*time.Second, func() bool { return store.stores() > 0 }) {
		t.Fatal("the merged fleet was never written")
	}
	store.mu.Lock()
	defer store.mu.Unlock()
	for _, v := range store.stored {
		if !strings.Contains(string(v), "http://r:1") || !strings.Contains(string(v), "http://n:1") {
			t.Fatalf("a write lost part of the fleet: %s", v)
		}
	}
}
