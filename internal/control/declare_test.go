package control

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// Each bad declaration is refused with a 4xx JSON error that says what
// is wrong, and changes neither the fleet's version nor any worker's.
func TestBadDeclarationsChangeNothing(t *testing.T) {
	a, p := pauseAPI(t)
	sum := strings.Repeat("0f", 32)
	for _, c := range []struct {
		body   string
		status int
		says   string
	}{
		{`{}`, 400, "new_version is required"},
		{``, 400, "new_version is required"},
		{`{"new_version":""}`, 400, "new_version must be a non-empty string"},
		{`{"new_version":null}`, 400, "new_version must be a non-empty string"},
		{`{"new_version":7}`, 400, "new_version must be a non-empty string"},
		{`{"new_version":"` + strings.Repeat("v", 513) + `"}`, 400, "513 bytes long; at most 512"},
		{`{"new_version":"step\u00012"}`, 400, "printable ASCII"},
		{`{"new_version":"schritt-zwei-ü"}`, 400, "printable ASCII"},
		{`{"new_version":"v2","checksums":{}}`, 400, "non-empty object"},
		{`{"new_version":"v2","checksums":["` + sum + `"]}`, 400, "non-empty object"},
		{`{"new_version":"v2","checksums":{"transformer":"` + sum[:63] + `"}}`, 400, `checksums["transformer"] must be a SHA-256 in 64 hex digits`},
		{`{"new_version":"v2","checksums":{"transformer":"` + sum[:62] + `zz"}}`, 400, "64 hex digits"},
		{`{"new_version":"v2","checksums":{"vae":7}}`, 400, "non-empty object"},
		{`{"new_version":"v2","checksums":{"":"` + sum + `"}}`, 400, "empty name"},
		{`{"new_version":"v2","checksums":{"vae":"` + sum + `","vae":"` + sum + `"}}`, 400, "appears twice"},
		{`{"new_version":"v2","workers":["http://x:1"]}`, 404, "workers[0]: http://x:1 is not a worker of the pool"},
		{`{"new_version":"v2","workers":[]}`, 400, "workers must be a non-empty list"},
		{`{"new_version":"v2","weight_version":"v2"}`, 400, `unknown field "weight_version": update_weight_version takes abort_all_requests, checksums, new_version, workers`},
		{`{"new_version":"v2","abort_all_requests":"yes"}`, 400, "abort_all_requests must be a boolean"},
		{`{"new_version":"v2","New_version":"v3"}`, 400, "New_version"},
		{`"v2"`, 400, "JSON object"},
	} {
		status, answer := call(t, a, "127.0.0.1", "/update_weight_version", c.body)
		msg, _ := answer["error"].(string)
		if status != c.status || !strings.Contains(msg, c.says) {
			t.Errorf("%s: %d %v; want %d saying %q", c.body, status, answer, c.status, c.says)
		}
		if v := p.Version(); v != "" {
			t.Fatalf("%s made the fleet's version %q", c.body, v)
		}
	}
	if status, answer := call(t, a, "192.0.2.1", "/update_weight_version", `{"new_version":"v2"}`); status != http.StatusForbidden {
		t.Errorf("a declaration from a client outside admin_allow: %d %v; want 403", status, answer)
	}
	for _, w := range p.Snapshot() {
		if w.Version != "" || w.VersionFrom != "" {
			t.Errorf("refused declarations left %s on %q (%s)", w.URL, w.Version, w.VersionFrom)
		}
	}
}

// A declaration without checksums is taken at its word: the workers
// named hold the version, declared, the others keep theirs, and the
// fleet's version, which anyone may read, is the one declared.
func TestDeclarationWithoutChecksums(t *testing.T) {
	a, p := pauseAPI(t)
	status, answer := call(t, a, "127.0.0.1", "/update_weight_version", `{"new_version":"step-2","workers":["http://b:1"],"abort_all_requests":false}`)
	results, _ := answer["results"].([]any)
	if status != http.StatusOK || answer["success"] != true || answer["weight_version"] != "step-2" || len(results) != 1 {
		t.Fatalf("declaration: %d %v", status, answer)
	}
	if r := results[0].(map[string]any); r["worker_url"] != "http://b:1" || r["status_code"] != 200.0 ||
		r["body"].(map[string]any)["source"] != scheduler.SourceDeclared {
		t.Errorf("b's result: %v", r)
	}
	for _, w := range p.Snapshot() {
		want := map[string][2]string{"http://a:1": {"", ""}, "http://b:1": {"step-2", "declared"}}[w.URL]
		if [2]string{w.Version, w.VersionFrom} != want {
			t.Errorf("%s: on %q (%s); want %q", w.URL, w.Version, w.VersionFrom, want)
		}
	}
	r := httptest.NewRequest(http.MethodGet, "/get_weight_version", nil)
	r.RemoteAddr = "192.0.2.1:5000" // not an admin
	rec := httptest.NewRecorder()
	a.Mux().ServeHTTP(rec, r)
	if rec.Code != http.StatusOK || strings.TrimSpace(rec.Body.String()) != `{"weight_version":"step-2"}` {
		t.Errorf("get_weight_version: %d %s", rec.Code, rec.Body)
	}
}
