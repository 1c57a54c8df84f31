package diffusionrouter_test

// The router decides what a request is (its own endpoint, forwarded,
// refused) on the path as the worker will read it. sglang-diffusion runs
// on uvicorn, which unescapes the path before routing it, so these tests
// use workers that do the same: the fake behind a decoding front, and
// uvicorn itself with starlette's router, which FastAPI's is (Debian's
// python3-uvicorn and python3-starlette; the tests skip without them,
// unless CI=true).

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// decodingWorker is a fake worker that routes on the unescaped path, as
// uvicorn does, and records each path it routed.
type decodingWorker struct {
	*httptest.Server
	mu     sync.Mutex
	routed []string
}

func startDecodingWorker(t *testing.T) *decodingWorker {
	t.Helper()
	fake := fakeworker.New(fakeworker.Config{Name: "decoding", UnitMs: 1})
	w := &decodingWorker{}
	w.Server = httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		r.URL.RawPath = "" // from here on the path is routed unescaped
		w.mu.Lock()
		w.routed = append(w.routed, r.URL.Path)
		w.mu.Unlock()
		fake.Handler().ServeHTTP(rw, r)
	}))
	t.Cleanup(w.Close)
	return w
}

// saw reports whether the worker routed a request to path.
func (w *decodingWorker) saw(path string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Contains(w.routed, path)
}

// escapedSeparators are paths that reach a fleet-changing endpoint of a
// worker that unescapes them, each with the path it reaches.
var escapedSeparators = [][2]string{
	{"/v1%2Fset_lora", "/v1/set_lora"},
	{"/v1%2fset_lora", "/v1/set_lora"},
	{"/v1%2funmerge_lora_weights", "/v1/unmerge_lora_weights"},
	{"/v1%2Fmerge_lora_weights", "/v1/merge_lora_weights"},
	{"/v1%5Cset_lora", `/v1\set_lora`},
	{"/v1%5cimages/generations", `/v1\images/generations`},
	{"/v1/images%2Fgenerations", "/v1/images/generations"},
	{"/update_weights_from_disk%2F", "/update_weights_from_disk/"},
}

// expectPathRefused posts path to the router and checks that it was
// refused with a 400 JSON error naming the escape.
func expectPathRefused(t *testing.T, r *testrouter.Router, path string) {
	t.Helper()
	rp := r.Post(path, `{"lora_nickname":"evil","lora_path":"/ckpt/evil","prompt":"a","size":"64x64","model_path":"/ckpt/evil"}`)
	testrouter.ExpectStatus(t, "POST "+path, rp, http.StatusBadRequest)
	if msg := rp.ErrorText(t); !strings.Contains(msg, "%2F") {
		t.Errorf("POST %s: error %q does not say what is wrong with the path", path, msg)
	}
}

func TestEscapedSlashesNeverReachAWorker(t *testing.T) {
	w := startDecodingWorker(t)
	// Loopback is not in admin_allow: only the token may change the fleet.
	r := testrouter.Start(t, "diffusion_router {\n workers "+w.URL+"\n admin_allow 192.0.2.0/24\n admin_token secret\n}")
	testrouter.WaitFor(t, func() bool { return r.Get("/readyz").Status == http.StatusOK })
	version := r.Workers()[w.URL]["weight_version"]

	for _, p := range escapedSeparators {
		expectPathRefused(t, r, p[0])
		if w.saw(p[1]) {
			t.Fatalf("POST %s reached the worker's %s", p[0], p[1])
		}
	}
	if got := r.Workers()[w.URL]["weight_version"]; got != version {
		t.Fatalf("the worker's version went from %v to %v", version, got)
	}

	// Other escapes are read unescaped, as the worker reads them: %73 is
	// "s", so this is the router's own /v1/set_lora, which wants the token.
	rp := r.Post("/v1/%73et_lora", `{"lora_nickname":"evil","lora_path":"/ckpt/evil"}`)
	testrouter.ExpectStatus(t, "POST /v1/%73et_lora without the token", rp, http.StatusForbidden)
	if w.saw("/v1/set_lora") {
		t.Fatal("POST /v1/%73et_lora reached the worker")
	}
	// A generation spelled with an escape goes to the worker as the
	// router read it.
	rp = r.Post("/v1/images/%67enerations", `{"prompt":"a","size":"64x64","response_format":"b64_json"}`)
	testrouter.ExpectStatus(t, "POST /v1/images/%67enerations", rp, http.StatusOK)
	if !w.saw("/v1/images/generations") {
		t.Fatal("the generation did not reach the worker's /v1/images/generations")
	}

	// The router's own endpoints still take an escaped worker URL, as
	// the Python router's clients send it.
	rp = r.Get("/workers/" + url.PathEscape(w.URL))
	testrouter.ExpectStatus(t, "GET /workers/<escaped url>", rp, http.StatusOK)
}

func TestEscapedSlashesAreRefusedWhateverForwardPathsSays(t *testing.T) {
	w := startDecodingWorker(t)
	r := testrouter.Start(t, "diffusion_router {\n workers "+w.URL+"\n forward_paths sglang\n admin_allow 192.0.2.0/24\n}")
	for _, p := range escapedSeparators {
		expectPathRefused(t, r, p[0])
	}
	testrouter.ExpectStatus(t, "a generation after the refusals",
		r.Post("/v1/images/generations", `{"prompt":"a","size":"64x64","response_format":"b64_json"}`), http.StatusOK)
}

func TestEscapedSlashesNeverReachUvicorn(t *testing.T) {
	worker := startUvicornWorker(t)
	// The threat is real: uvicorn routes /v1%2Fset_lora to /v1/set_lora.
	rp := testrouter.Do(t, http.MethodPost, worker+"/v1%2Fset_lora", strings.NewReader("{}"))
	testrouter.ExpectStatus(t, "POST /v1%2Fset_lora straight to uvicorn", rp, http.StatusOK)

	r := testrouter.Start(t, "diffusion_router {\n workers "+worker+"\n forward_paths sglang\n admin_allow 192.0.2.0/24\n admin_token secret\n}")
	testrouter.WaitFor(t, func() bool { return r.Get("/readyz").Status == http.StatusOK })
	before := uvicornRouted(t, worker)
	for _, p := range escapedSeparators {
		expectPathRefused(t, r, p[0])
	}
	testrouter.ExpectStatus(t, "POST /v1/%73et_lora without the token", r.Post("/v1/%73et_lora", "{}"), http.StatusForbidden)
	for _, path := range uvicornRouted(t, worker)[len(before):] {
		if path != "/health" && path != "/v1/models" {
			t.Errorf("uvicorn routed %s, which only probes should reach", path)
		}
	}
}

// startUvicornWorker runs testdata/uvicorn_worker.py under Debian's
// uvicorn and starlette on a free port until the test ends, and returns
// its URL.
func startUvicornWorker(t *testing.T) string {
	t.Helper()
	const python = "/usr/bin/python3"
	if err := exec.Command(python, "-c", "import uvicorn, starlette").Run(); err != nil {
		msg := "needs uvicorn and starlette for " + python + " (Debian: apt-get install python3-uvicorn python3-starlette)"
		if os.Getenv("CI") == "true" {
			t.Fatal(msg + "; CI=true requires it")
		}
		t.Skip(msg)
	}
	port := testrouter.Port(t)
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, python, "-m", "uvicorn", "--app-dir", "testdata", "uvicorn_worker:app",
		"--host", "127.0.0.1", "--port", fmt.Sprint(port), "--log-level", "warning")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("uvicorn wrote:\n%s", stderr.String())
		}
	})
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	if !testkit.WaitUntil(30*time.Second, func() bool {
		resp, err := http.Get(base + "/health")
		if err == nil {
			resp.Body.Close()
		}
		return err == nil
	}) {
		t.Fatal("uvicorn did not answer within 30 s")
	}
	return base
}

// uvicornRouted is every path the uvicorn worker routed so far.
func uvicornRouted(t *testing.T, base string) []string {
	t.Helper()
	var paths []string
	if err := json.Unmarshal(testrouter.Do(t, http.MethodGet, base+"/routed", nil).Body, &paths); err != nil {
		t.Fatal(err)
	}
	return paths
}
