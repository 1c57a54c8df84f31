package scheduler

import (
	"math"
	"slices"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/workerurl"
)

func workerURLs(p *Pool) []string {
	var urls []string
	for _, w := range p.Snapshot() {
		urls = append(urls, w.URL)
	}
	return urls
}

func TestRegisterDeduplicates(t *testing.T) {
	p := newPool("t")
	if _, created, err := registerRaw(p, "http://10.0.0.1:30000"); err != nil || !created {
		t.Fatalf("first register: created=%v err=%v", created, err)
	}
	for _, same := range []string{"http://10.0.0.1:30000/", "HTTP://10.0.0.1:30000"} {
		if _, created, err := registerRaw(p, same); err != nil || created {
			t.Fatalf("register(%q): created=%v err=%v; want a no-op", same, created, err)
		}
	}
	registerRaw(p, "http://10.0.0.2") // dials port 80
	if _, created, _ := registerRaw(p, "http://10.0.0.2:80"); created {
		t.Fatal("http://10.0.0.2:80 dials the same address as http://10.0.0.2 and must be the same worker")
	}
	if got := workerURLs(p); !slices.Equal(got, []string{"http://10.0.0.1:30000", "http://10.0.0.2"}) {
		t.Fatalf("workers = %v", got)
	}
}

func TestDeclarationsSurviveReload(t *testing.T) {
	p := newPool("t")
	oldCfg := []string{"http://a:1", "http://b:1"}
	newCfg := []string{"http://b:1", "http://c:1"}
	p.Declare(oldCfg)
	registerRaw(p, "http://d:1") // joined at run time
	registerRaw(p, "http://a:1") // listed and also registered: outlives the config

	// A reload provisions the new config before cleaning up the old one.
	p.Declare(newCfg)
	p.Undeclare(oldCfg)
	if got, want := workerURLs(p), []string{"http://a:1", "http://b:1", "http://d:1", "http://c:1"}; !slices.Equal(got, want) {
		t.Fatalf("after reload workers = %v; want %v", got, want)
	}

	// A reload that fails to provision undoes its own declarations.
	p.Declare([]string{"http://e:1"})
	p.Undeclare([]string{"http://e:1"})
	if slices.Contains(workerURLs(p), "http://e:1") {
		t.Fatal("a failed config's worker stayed in the pool")
	}
}

func TestRemoveKeepsInflightAccounting(t *testing.T) {
	p, _ := poolOf(t, 1)
	tk, _ := choose(t, p, config(LeastRequest{}, 0), 1)
	w := p.byDial["a:1"]
	if !p.Remove("http://a:1") {
		t.Fatal("remove failed")
	}
	p.Release(tk, End{Worker: Succeeded})
	if w.load.inflight != 0 || w.stats.served != 1 {
		t.Fatalf("removed worker inflight=%d served=%d; want 0 and 1", w.load.inflight, w.stats.served)
	}
	if p.Remove("http://a:1") {
		t.Fatal("second remove reported success")
	}
}

// registerRaw registers a worker as POST /workers does: URL parsed first.
func registerRaw(p *Pool, raw string) (WorkerInfo, bool, error) {
	u, err := workerurl.Parse(raw)
	if err != nil {
		return WorkerInfo{}, false, err
	}
	return p.Register(u, 4096)
}

// The count of unprobed workers lets image requests skip the pool's lock
// once every worker is known: it must follow joins, probes and removals.
func TestUnknownWorkersCounted(t *testing.T) {
	p := newPool("t")
	for _, u := range []string{"http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.0.3:30000"} {
		if _, _, err := registerRaw(p, u); err != nil {
			t.Fatal(err)
		}
	}
	p.SetCapabilities("http://10.0.0.1:30000", []string{"T2I"}, "m")
	p.SetCapabilities("http://10.0.0.1:30000", []string{"T2I"}, "m") // a second probe of a known worker
	p.SetCapabilities("http://10.0.0.2:30000", []string{}, "m")      // answered, with no models
	if n := p.unknown.Load(); n != 1 {
		t.Fatalf("unknown = %d after two of three workers answered; want 1", n)
	}
	p.Remove("http://10.0.0.1:30000")
	p.Remove("http://10.0.0.3:30000")
	if n := p.unknown.Load(); n != 0 {
		t.Fatalf("unknown = %d after the unprobed worker left; want 0", n)
	}
	if urls := p.Unprobed(p.now(), 0); len(urls) != 0 {
		t.Fatalf("unprobed = %v with unknown = 0", urls)
	}
}
func TestNewWorkerStartsFromPoolMedianSpeed(t *testing.T) {
	p, clock := poolOf(t, 3)
	teach(t, p, clock, config(LeastWork{}, 0), map[string]float64{"a": 1, "b": 3, "c": 5})
	registerRaw(p, "http://d:1")
	d, _ := p.Worker("http://d:1")
	if d.SpeedLearned || math.Abs(d.Speed-3) > 1e-6 {
		t.Fatalf("new worker's speed %v (learned %v); want the median 3", d.Speed, d.SpeedLearned)
	}
}

// The speed assumed before anything is learned is the config's, and gives
// way to the learned ones.
func TestInitialSpeedHoldsUntilASpeedIsLearned(t *testing.T) {
	p, clock := poolOf(t, 2)
	p.SetInitialSpeed(4)
	cfg := config(LeastWork{}, 1)
	first, _ := choose(t, p, cfg, 20)
	second, _ := choose(t, p, cfg, 20)
	if got := second.Due(); got != 5*time.Second {
		t.Fatalf("due at an initial speed of 4 units/s: %v; want 5 s", got)
	}
	clock.advance(2 * time.Second)
	p.Release(first, End{Worker: Succeeded}) // 10 units/s
	p.SetInitialSpeed(4)                     // a reload: what was learned stays
	if got := second.Due(); got != 2*time.Second {
		t.Fatalf("due once a worker learned 10 units/s: %v; want 2 s", got)
	}
	p.Release(second, End{Worker: Succeeded})
}

// Spellings of one address are one worker: one GPU must not draw the
// jobs of three.
func TestOneAddressIsOneWorker(t *testing.T) {
	p := newPool(t.Name())
	for i, raw := range []string{"http://127.0.0.1:30000", "http://localhost:30000", "http://[::ffff:127.0.0.1]:30000"} {
		info, created, err := registerRaw(p, raw)
		if err != nil || created != (i == 0) || info.URL != "http://127.0.0.1:30000" {
			t.Fatalf("register %s: %+v, new %v, %v; want the first worker", raw, info, created, err)
		}
	}
	if n := len(p.Snapshot()); n != 1 {
		t.Fatalf("%d workers for one address", n)
	}
	if !p.Remove("http://localhost:30000") || len(p.Snapshot()) != 0 {
		t.Fatal("the worker was not removed by another spelling of its address")
	}
}

// newPool makes a pool that logs nowhere.
func newPool(name string) *Pool { return New(name, zap.NewNop()) }
