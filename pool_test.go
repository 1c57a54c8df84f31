package diffusionrouter

import (
	"slices"
	"strings"
	"testing"
)

func workerURLs(p *pool) []string {
	var urls []string
	for _, w := range p.snapshot() {
		urls = append(urls, w.URL)
	}
	return urls
}

func TestNormalizeWorkerURL(t *testing.T) {
	good := map[string]string{
		"http://10.0.0.1:30000":     "http://10.0.0.1:30000",
		" HTTP://Worker-A:30000/ ":  "http://worker-a:30000",
		"https://gpu.example.com":   "https://gpu.example.com",
		"http://[::1]:30000":        "http://[::1]:30000",
		"http://127.0.0.1:30001/":   "http://127.0.0.1:30001",
		"https://[fd00::1]":         "https://[fd00::1]",
		"http://localhost:8080":     "http://localhost:8080",
		"http://10.0.0.1:30000/#":   "http://10.0.0.1:30000",
		"http://node-7.cluster:300": "http://node-7.cluster:300",
	}
	for in, want := range good {
		got, err := normalizeWorkerURL(in)
		if err != nil || got != want {
			t.Errorf("normalizeWorkerURL(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	bad := map[string]string{
		"":                                     "empty",
		"ftp://10.0.0.1":                       "http:// or https://",
		"10.0.0.1:30000":                       "http:// or https://",
		"http://user:pw@10.0.0.1:30000":        "credentials",
		"http://10.0.0.1:30000/generate":       "path",
		"http://10.0.0.1:30000?x=1":            "query",
		"http://169.254.169.254":               "blocked",
		"http://metadata.google.internal":      "blocked",
		"http://169.254.10.1:30000":            "link-local",
		"http://[fe80::1]:30000":               "link-local",
		"http://":                              "host",
		"http://10.0.0.1:30000/v1/#x/../../..": "fragment",
	}
	for in, want := range bad {
		if _, err := normalizeWorkerURL(in); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("normalizeWorkerURL(%q) error = %v; want one mentioning %q", in, err, want)
		}
	}
}

func TestRegisterDeduplicates(t *testing.T) {
	p := newPool("t")
	if _, created, err := p.register("http://10.0.0.1:30000"); err != nil || !created {
		t.Fatalf("first register: created=%v err=%v", created, err)
	}
	for _, same := range []string{"http://10.0.0.1:30000/", "HTTP://10.0.0.1:30000"} {
		if _, created, err := p.register(same); err != nil || created {
			t.Fatalf("register(%q): created=%v err=%v; want a no-op", same, created, err)
		}
	}
	p.register("http://10.0.0.2") // dials port 80
	if _, created, _ := p.register("http://10.0.0.2:80"); created {
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
	p.declare(oldCfg)
	p.register("http://d:1") // joined at run time
	p.register("http://a:1") // listed and also registered: outlives the config

	// A reload provisions the new config before cleaning up the old one.
	p.declare(newCfg)
	p.undeclare(oldCfg)
	if got, want := workerURLs(p), []string{"http://a:1", "http://b:1", "http://d:1", "http://c:1"}; !slices.Equal(got, want) {
		t.Fatalf("after reload workers = %v; want %v", got, want)
	}

	// A reload that fails to provision undoes its own declarations.
	p.declare([]string{"http://e:1"})
	p.undeclare([]string{"http://e:1"})
	if slices.Contains(workerURLs(p), "http://e:1") {
		t.Fatal("a failed config's worker stayed in the pool")
	}
}

func TestRemoveKeepsInflightAccounting(t *testing.T) {
	p, _ := poolOf(t, 1)
	tk, _ := choose(t, p, config(leastRequest{}, 0), 1)
	w := p.byDial["a:1"]
	if !p.remove("http://a:1") {
		t.Fatal("remove failed")
	}
	p.release(tk, succeeded)
	if w.load.inflight != 0 || w.stats.served != 1 {
		t.Fatalf("removed worker inflight=%d served=%d; want 0 and 1", w.load.inflight, w.stats.served)
	}
	if p.remove("http://a:1") {
		t.Fatal("second remove reported success")
	}
}

func TestPoolSharedAcrossLoadsAndReleased(t *testing.T) {
	a, err := loadPool("shared-test")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := loadPool("shared-test")
	if a != b {
		t.Fatal("two loads of one pool name gave different pools")
	}
	a.register("http://a:1")
	releasePool("shared-test")
	c, _ := loadPool("shared-test")
	if c != a || len(c.snapshot()) != 1 {
		t.Fatal("pool did not survive while still referenced")
	}
	releasePool("shared-test")
	releasePool("shared-test")
	d, _ := loadPool("shared-test")
	defer releasePool("shared-test")
	if d == a || len(d.snapshot()) != 0 {
		t.Fatal("a pool no config uses was not released")
	}
}
