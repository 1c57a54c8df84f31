package fleet

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/memstore"
	"github.com/miles-rollout/miles-diffusion-router/internal/workerurl"
)

// readBack starts a pool whose storage holds data as its record, checked
// by rules, and returns the pool once the record was read back.
func readBack(t *testing.T, data string, rules Rules) (*scheduler.Pool, *memstore.Storage) {
	t.Helper()
	store := memstore.New()
	store.Put(fleetKey(t.Name()), []byte(data))
	p := scheduler.New(t.Name(), zap.NewNop())
	t.Cleanup(func() { _ = p.Close() })
	s := NewStore(p, New(p, zap.NewNop()), zap.NewNop())
	s.Use(nil, store, rules)
	s.StartOnce()
	return p, store
}

// keptAside reports whether the record as read was stored under another
// name.
func keptAside(t *testing.T, store *memstore.Storage, data string) bool {
	keys, _ := store.List(context.Background(), fleetKey(t.Name())+".unreadable-", true)
	for _, k := range keys {
		if v, _ := store.Value(k); bytes.Equal(v, []byte(data)) {
			return true
		}
	}
	return false
}

func TestRecordReadBackPassesTheAPIsChecks(t *testing.T) {
	var workers []string
	for i := range 300 {
		workers = append(workers, fmt.Sprintf(`{"url":"http://10.0.%d.%d:30000","registered":true}`, i/256, i%256))
	}
	workers = append([]string{
		`{"url":"http://10.1.0.1:30000","registered":"yes"}`, // a field of the wrong type
		`{"url":"http://127.0.0.1:2019","registered":true}`,  // Caddy's admin endpoint
		`{"url":"ftp://10.1.0.2","registered":true}`,
		`{"url":"http://10.1.0.3:30000","registered":true,"weight_version":"` + strings.Repeat("v", 600) + `"}`,
		`{"url":"http://10.1.0.4:30000","registered":true,"paused_since":"yesterday"}`, // not RFC 3339
		`{"url":"http://10.1.0.5:30000","registered":true,"weight_version":"x","weight_version_source":"rumour"}`,
	}, workers...)
	data := `{"workers":[` + strings.Join(workers, ",") + `],"weight_version":"x",` +
		`"updates":[{"path":"@127.0.0.1:41099/pwned","weight_version":"x","body":{"model_path":"/ckpt/x"}}]}`
	p, store := readBack(t, data, Rules{MaxWorkers: 10, Guard: workerurl.NewGuard([]uint16{2019}), Weights: &Config{}})

	urls := p.URLs()
	if len(urls) != 10 || urls[0] != "http://10.0.0.0:30000" {
		t.Fatalf("workers read back under max_workers 10: %v", urls)
	}
	if v := p.Stats().Version; v != "" {
		t.Fatalf("weights read back with an update to another path: %q", v)
	}
	if !keptAside(t, store, data) {
		t.Fatal("the record as read was not kept aside")
	}
}

func TestRecordUpdatesOutsideThePathRulesAreNotReplayed(t *testing.T) {
	rules := Rules{MaxWorkers: 10, Weights: &Config{PathPrefixes: []string{"/ckpt"}}}
	for body, adopted := range map[string]bool{
		`{"model_path":"/ckpt/step-3"}`:                true,
		`{"model_path":"../../../../root/.ssh"}`:       false,
		`{"model_path":"/etc/secrets"}`:                false,
		`{"model_path":"/ckpt/a","model_path":"/etc"}`: false,
		`"not an object"`:                              false,
	} {
		t.Run(body, func(t *testing.T) {
			data := `{"workers":[{"url":"http://10.0.0.1:30000","registered":true}],"weight_version":"v3",` +
				`"updates":[{"path":"/update_weights_from_disk","weight_version":"v3","body":` + body + `}]}`
			p, store := readBack(t, data, rules)
			if got := p.Stats().Version == "v3"; got != adopted {
				t.Fatalf("weights read back: %v; want %v", got, adopted)
			}
			if len(p.URLs()) != 1 {
				t.Fatalf("the registration was lost with the weights: %v", p.URLs())
			}
			if keptAside(t, store, data) == adopted {
				t.Fatalf("kept aside: %v; want %v", !adopted, !adopted)
			}
		})
	}
}

func TestOversizedRecordIsKeptAside(t *testing.T) {
	data := `{"workers":[{"url":"http://10.0.0.1:30000","registered":true,"weight_version":"` + strings.Repeat("v", maxRecord) + `"}]}`
	p, store := readBack(t, data, Rules{})
	if len(p.URLs()) != 0 || !keptAside(t, store, data) {
		t.Fatalf("a record over %d bytes: workers %v, kept aside %v", maxRecord, p.URLs(), keptAside(t, store, data))
	}
}

// Storage that never answers (a FIFO in the record's place, a hung
// volume) holds up neither the start nor the end of the pool for long.
func TestStorageThatHangsHoldsUpNothing(t *testing.T) {
	store := memstore.New()
	release := store.HangLoads()
	t.Cleanup(release)
	p := scheduler.New(t.Name(), zap.NewNop())
	s := NewStore(p, New(p, zap.NewNop()), zap.NewNop())
	s.Use(nil, store, Rules{})
	const bound = 30 * time.Second // restoreWait and storeTimeout are seconds; generous for a loaded machine
	start := time.Now()
	s.StartOnce()
	if took := time.Since(start); took > bound {
		t.Fatalf("the start waited %s on storage", took)
	}
	start = time.Now()
	_ = p.Close()
	if took := time.Since(start); took > bound {
		t.Fatalf("closing the pool waited %s on storage", took)
	}
}

// The versions a record names pass the checks of a weight version one by
// one: a bad one is left out, the rest kept in their order.
func TestRecordVersionsReadBackOneByOne(t *testing.T) {
	data := `{"workers":[],"versions":["v1", 7, "", "` + strings.Repeat("v", 600) + `", "v\u0001", "v2"]}`
	rec, out, err := readRecord([]byte(data), Rules{})
	if err != nil || len(out) != 4 {
		t.Fatalf("read: %v, %d entries left out (%v); want 4", err, len(out), out)
	}
	if got := fmt.Sprint(rec.Versions); got != "[v1 v2]" {
		t.Fatalf("versions read back: %s; want [v1 v2]", got)
	}
	for i, d := range out {
		if want := fmt.Sprintf("versions[%d]", i+1); d.entry != want {
			t.Fatalf("left out %s; want %s", d.entry, want)
		}
	}
}
