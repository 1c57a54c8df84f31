package fleet

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
)

// checksumWorker is a worker whose /get_weights_checksum answers sums for
// the modules asked, or fails with status when it is not 200.
func checksumWorker(t *testing.T, status int, sums map[string]string) string {
	t.Helper()
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var asked struct {
			ModuleNames []string `json:"module_names"`
		}
		if r.URL.Path != checksumPath || json.NewDecoder(r.Body).Decode(&asked) != nil || len(asked.ModuleNames) == 0 {
			t.Errorf("the router asked %s without module_names", r.URL.Path)
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		out := map[string]string{}
		for _, m := range asked.ModuleNames {
			out[m] = sums[m]
		}
		_ = json.NewEncoder(w).Encode(out)
	}))
	t.Cleanup(s.Close)
	return s.URL
}

// Each worker's result says whether it matched the declaration's
// checksums, which module differed, or what failed; only those that
// matched hold the version, and the others are stale.
func TestDeclareChecksTheWorkersChecksums(t *testing.T) {
	good, other := strings.Repeat("a", 64), strings.Repeat("b", 64)
	match := checksumWorker(t, 200, map[string]string{"transformer": good, "vae": good})
	differ := checksumWorker(t, 200, map[string]string{"transformer": good, "vae": other})
	broken := checksumWorker(t, 500, nil)
	gone := httptest.NewServer(http.NotFoundHandler())
	gone.Close()
	p, f, _ := pausePool(t, match, differ, broken, gone.URL)

	results, err := f.Declare(context.Background(), Declaration{Version: "step-2", Checksums: map[string]string{"transformer": good, "vae": good}}, &Config{})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]struct {
		status int
		says   string
	}{
		match:    {200, "verified"},
		differ:   {409, "module vae differs"},
		broken:   {500, "could not be read"},
		gone.URL: {502, "could not be read"},
	}
	for _, r := range results {
		body, _ := json.Marshal(r.Body)
		if w := want[r.WorkerURL]; r.StatusCode != w.status || r.OK != (w.status == 200) || !strings.Contains(string(body), w.says) {
			t.Errorf("%s: %d %s; want %d saying %q", r.WorkerURL, r.StatusCode, body, w.status, w.says)
		}
		info, _ := p.Worker(r.WorkerURL)
		if matched := r.WorkerURL == match; (info.Version == "step-2") != matched || (info.State == scheduler.Stale) == matched {
			t.Errorf("%s after the declaration: %s on %q", r.WorkerURL, info.State, info.Version)
		}
	}
	if len(results) != 4 || p.Version() != "step-2" {
		t.Fatalf("%d results, the fleet on %q; want 4 and step-2", len(results), p.Version())
	}
}

// Checksums match in either case of hex, as sha256 tools print both.
func TestDeclaredChecksumsMatchInEitherCase(t *testing.T) {
	sum := strings.Repeat("ab", 32)
	w := checksumWorker(t, 200, map[string]string{"transformer": strings.ToUpper(sum)})
	p, f, _ := pausePool(t, w)
	results, err := f.Declare(context.Background(), Declaration{Version: "step-2", Checksums: map[string]string{"transformer": sum}}, &Config{})
	if err != nil || len(results) != 1 || !results[0].OK {
		t.Fatalf("declaration: %+v, %v; want the worker verified", results, err)
	}
	if info, _ := p.Worker(w); info.VersionFrom != scheduler.SourceVerified {
		t.Fatalf("the worker's version is %s; want verified", info.VersionFrom)
	}
}

// A worker that joins after a declaration with checksums is checked by
// the router itself before it serves: it serves the declared version if
// its checksums match, and nothing if not.
func TestAWorkerThatJoinsIsCheckedBeforeItServes(t *testing.T) {
	sum, other := strings.Repeat("ab", 32), strings.Repeat("cd", 32)
	first := checksumWorker(t, 200, map[string]string{"transformer": sum})
	match := checksumWorker(t, 200, map[string]string{"transformer": sum})
	differ := checksumWorker(t, 200, map[string]string{"transformer": other})
	p, f, _ := pausePool(t, first)
	if _, err := f.Declare(context.Background(), Declaration{Version: "step-2", Checksums: map[string]string{"transformer": sum}}, &Config{}); err != nil {
		t.Fatal(err)
	}
	for _, u := range []string{match, differ} {
		if _, _, err := p.Register(u, 10); err != nil {
			t.Fatal(err)
		}
	}
	f.StartCatchUps(&Config{Timeout: 10 * time.Second})
	checked := func() bool {
		return !slices.ContainsFunc(p.Snapshot(), func(w scheduler.WorkerInfo) bool {
			return w.State == scheduler.Updating || w.VersionFrom == scheduler.SourceUnknown && w.URL == match
		})
	}
	if !testkit.WaitUntil(10*time.Second, checked) {
		t.Fatal("the joiners' checks did not end")
	}
	want := map[string]scheduler.State{match: scheduler.Serving, differ: scheduler.Stale}
	for u, state := range want {
		if info, _ := p.Worker(u); info.State != state || (state == scheduler.Serving) != (info.Version == "step-2") {
			t.Errorf("%s after its check: %s on %q (%s); want %s", u, info.State, info.Version, info.VersionFrom, state)
		}
	}
}
