package diffusionrouter_test

import (
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// spellings are the variants of a path (with its query) that stand for
// it: a trailing slash, repeated slashes, ;params.
func spellings(target string) []string {
	path, query, _ := strings.Cut(target, "?")
	if query != "" {
		query = "?" + query
	}
	variants := []string{path + "/", "/" + path, path + "//", path + ";x=1", path + ";x=1/"}
	if second := strings.IndexByte(path[1:], '/') + 1; second > 0 {
		variants = append(variants, path[:second]+"/"+path[second:], "/"+path[:second]+"//"+path[second:]+"/", path[:second]+";y"+path[second:])
	}
	for i := range variants {
		variants[i] += query
	}
	return variants
}

// A path the router answers itself or refuses is answered or refused the
// same way in every spelling that stands for it, in every forwarding mode,
// and none of them reaches a worker: uvicorn would take POST
// /v1/set_lora/ for a redirect to http://<worker address>/v1/set_lora.
func TestEverySpellingOfARefusedPathIsRefusedAlike(t *testing.T) {
	w := startDecodingWorker(t)
	lora := `{"lora_nickname":"evil","lora_path":"/ckpt/evil"}`
	cases := []struct {
		method, target, body string
		forwardPathsOnly     bool // refused only where forward_paths lists the paths sent on
	}{
		{"POST", "/v1/set_lora", lora, false},                                       // 403: admin
		{"POST", "/v1/unmerge_lora_weights", "{}", false},                           // 403
		{"POST", "/update_weights_from_disk", `{"model_path":"/ckpt/evil"}`, false}, // 403
		{"POST", "/add_worker?url=http://10.0.0.9:30000", "", false},                // 403
		{"POST", "/pause_generation", `{"mode":"abort"}`, false},                    // 403
		{"POST", "/continue_generation", "{}", false},                               // 403
		{"POST", "/update_weight_version", `{"new_version":"evil"}`, false},         // 403
		{"GET", "/get_weight_version", "", false},                                   // 200: anyone may read it
		{"POST", "/update_weights_from_tensor", "{}", false},                        // 400: the router never sends it on
		{"GET", "/v1/set_lora", "", false},                                          // 405
		{"GET", "/workers", "", false},                                              // 200: the router's own
		{"POST", "/v1/images/../update_weights_from_disk", "{}", false},             // 400: a dot segment
		{"POST", "/v1%2Fset_lora", lora, false},                                     // 400: an escaped slash
		{"GET", "/not_sglang", "", true},                                            // 404: not in forward_paths
	}
	modes := map[string]string{
		"every path forwarded":    "",
		"forward_paths sglang":    "forward_paths sglang",
		"forward_paths by prefix": "forward_paths /v1/* /update_weights_from_disk /workers*",
	}
	r := testrouter.Start(t, "diffusion_router {\n workers "+w.URL+"\n admin_allow 192.0.2.0/24\n}")
	for mode, option := range modes {
		r.Load("diffusion_router {\n workers " + w.URL + "\n admin_allow 192.0.2.0/24\n " + option + "\n}")
		for _, c := range cases {
			if c.forwardPathsOnly && option == "" {
				continue
			}
			do := func(target string) testrouter.Reply {
				return doUnfollowed(t, c.method, r.Base+target, c.body)
			}
			want := do(c.target)
			if want.Status < 400 && want.Status != http.StatusOK {
				t.Fatalf("%s: %s %s: %d; the canonical path must be answered or refused", mode, c.method, c.target, want.Status)
			}
			for _, variant := range spellings(c.target) {
				got := do(variant)
				if got.Status != want.Status {
					t.Errorf("%s: %s %s: %d %.200s; want %d, as %s", mode, c.method, variant, got.Status, got.Body, want.Status, c.target)
					continue
				}
				if want.Status >= 400 {
					if g, w := got.ErrorText(t), want.ErrorText(t); g != w {
						t.Errorf("%s: %s %s: error %q; want %q, as %s", mode, c.method, variant, g, w, c.target)
					}
				} else if g, w := keys(got.JSON(t)), keys(want.JSON(t)); !slices.Equal(g, w) {
					t.Errorf("%s: %s %s: an answer with %v; want %v, as %s", mode, c.method, variant, g, w, c.target)
				}
			}
		}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, path := range w.routed {
		if path != "/health" && path != "/v1/models" {
			t.Errorf("the worker was asked for %s; only the router's probes should reach it", path)
		}
	}
}

// keys are an object's keys, in order.
func keys(v map[string]any) []string {
	out := make([]string, 0, len(v))
	for k := range v {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// doUnfollowed is testrouter.Do with a client that follows no redirect:
// the answer is the router's own.
func doUnfollowed(t *testing.T, method, url, body string, header ...string) testrouter.Reply {
	t.Helper()
	saved := testrouter.Client
	testrouter.Client = &http.Client{Timeout: saved.Timeout, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	defer func() { testrouter.Client = saved }()
	return testrouter.Do(t, method, url, strings.NewReader(body), header...)
}

// uvicorn's router answers a trailing slash with a 307 to the Host it was
// sent, the worker's own address. Through the router, a path the router
// answers itself never gets there in that spelling, and a redirect of a
// path it sends on comes back as a path on the router: no answer names
// the worker.
func TestNoRedirectOfUvicornNamesTheWorker(t *testing.T) {
	worker := startUvicornWorker(t)
	rp := doUnfollowed(t, http.MethodPost, worker+"/v1/set_lora/", "{}")
	if rp.Status != http.StatusTemporaryRedirect || rp.Header.Get("Location") != worker+"/v1/set_lora" {
		t.Fatalf("POST /v1/set_lora/ straight to uvicorn: %d, Location %q; want 307 to %s/v1/set_lora", rp.Status, rp.Header.Get("Location"), worker)
	}

	r := testrouter.Start(t, "diffusion_router {\n workers "+worker+"\n admin_allow 192.0.2.0/24\n}")
	testrouter.WaitFor(t, func() bool { return r.Get("/readyz").Status == http.StatusOK })
	before := len(uvicornRouted(t, worker))
	address := strings.TrimPrefix(worker, "http://")
	for _, c := range []struct {
		method, path string
		status       int
		location     string
	}{
		{http.MethodPost, "/v1/set_lora/", http.StatusForbidden, ""},
		{http.MethodPost, "//v1/set_lora", http.StatusForbidden, ""},
		{http.MethodGet, "/health_generate/?probe=1", http.StatusTemporaryRedirect, "/health_generate?probe=1"},
	} {
		rp := doUnfollowed(t, c.method, r.Base+c.path, "{}")
		if rp.Status != c.status || rp.Header.Get("Location") != c.location {
			t.Errorf("%s %s: %d, Location %q; want %d, Location %q", c.method, c.path, rp.Status, rp.Header.Get("Location"), c.status, c.location)
		}
		for name, values := range rp.Header {
			if strings.Contains(strings.Join(values, " "), address) {
				t.Errorf("%s %s: %s names the worker: %v", c.method, c.path, name, values)
			}
		}
	}
	for _, path := range uvicornRouted(t, worker)[before:] {
		if path != "/health" && path != "/v1/models" && path != "/health_generate/" {
			t.Errorf("uvicorn was asked for %s", path)
		}
	}
}
