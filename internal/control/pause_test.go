package control

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/fleet"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/memstore"
)

// pauseAPI is the control API of a pool of the workers a and b, its
// record in memory, called from loopback, which admin_allow admits.
func pauseAPI(t *testing.T) (*API, *scheduler.Pool) {
	t.Helper()
	p := scheduler.New(t.Name(), zap.NewNop())
	t.Cleanup(func() { _ = p.Close() })
	p.Declare([]string{"http://a:1", "http://b:1"})
	f := fleet.New(p, zap.NewNop())
	store := fleet.NewStore(p, f, zap.NewNop())
	store.Use(nil, memstore.New(), fleet.Rules{})
	store.StartOnce()
	return &API{
		Pool: p, Fleet: f, Store: store, Weights: &fleet.Config{DrainTimeout: time.Minute}, Logger: zap.NewNop(),
		Allow:      []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")},
		ClientIP:   func(r *http.Request) (string, error) { host, _, _ := strings.Cut(r.RemoteAddr, ":"); return host, nil },
		Operations: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ops"}, []string{"pool", "operation", "outcome"}),
	}, p
}

// call POSTs body to path on a from client and returns the status and
// the JSON answer.
func call(t *testing.T, a *API, client, path, body string) (int, map[string]any) {
	t.Helper()
	r := httptest.NewRequest(http.MethodPost, path, strings.NewReader(body))
	r.RemoteAddr = client + ":5000"
	rec := httptest.NewRecorder()
	a.Mux().ServeHTTP(rec, r)
	var answer map[string]any
	if err := json.Unmarshal(rec.Body.Bytes(), &answer); err != nil || rec.Header().Get("Content-Type") != "application/json" {
		t.Fatalf("%s %s: %d %q, not a JSON answer", path, body, rec.Code, rec.Body)
	}
	return rec.Code, answer
}

// Each bad call is refused with a 4xx JSON error that says what is
// wrong, and pauses or continues nothing; the calls that follow work.
func TestBadPausesAndContinuesChangeNothing(t *testing.T) {
	a, p := pauseAPI(t)
	p.PauseWorkers([]string{"http://b:1"}) // a continue refused must leave it paused
	for _, c := range []struct {
		path, body string
		status     int
		says       string
	}{
		{"/pause_generation", `{"workers":["http://a:1"],"abort_all":true}`, 400, `unknown field "abort_all"`},
		{"/pause_generation", `{"new_version":"v2"}`, 400, `unknown field "new_version"`},
		{"/pause_generation", `{"workers":"http://a:1"}`, 400, "workers must be a non-empty list"},
		{"/pause_generation", `{"workers":[]}`, 400, "workers must be a non-empty list"},
		{"/pause_generation", `{"workers":["http://a:1",7]}`, 400, "workers must be a non-empty list"},
		{"/pause_generation", `{"workers":["http://a:1","not a url"]}`, 400, "workers[1]"},
		{"/pause_generation", `{"workers":["http://a:1","http://x:1"]}`, 404, "workers[1]: http://x:1 is not a worker of the pool"},
		{"/pause_generation", `{"mode":"sleep"}`, 400, "mode must be one of abort, retract, in_place"},
		{"/pause_generation", `{"mode":null}`, 400, "mode must be one of"},
		{"/pause_generation", `{"mode":"abort","Mode":"abort"}`, 400, "Mode"},
		{"/pause_generation", `{"workers":["http://a:1"]`, 400, ""},
		{"/pause_generation", `["http://a:1"]`, 400, "JSON object"},
		{"/continue_generation", `{"new_version":""}`, 400, "new_version must be a non-empty string"},
		{"/continue_generation", `{"workers":["http://b:1"],"new_version":"v2","checksums":{"transformer":"00"}}`, 400, "64 hex digits"},
		{"/continue_generation", `{"checksums":{"transformer":"` + strings.Repeat("ab", 32) + `"}}`, 400, "checksums need new_version"},
		{"/continue_generation", `{"torch_empty_cache":"yes"}`, 400, "torch_empty_cache must be a boolean"},
		{"/continue_generation", `{"mode":"abort"}`, 400, `unknown field "mode"`},
		{"/continue_generation", `{"workers":["http://x:1"]}`, 404, "not a worker of the pool"},
	} {
		status, answer := call(t, a, "127.0.0.1", c.path, c.body)
		msg, _ := answer["error"].(string)
		if status != c.status || msg == "" || !strings.Contains(msg, c.says) {
			t.Errorf("%s %s: %d %v; want %d saying %q", c.path, c.body, status, answer, c.status, c.says)
		}
		if got := p.PausedWorkers(); len(got) != 1 || got[0] != "http://b:1" {
			t.Fatalf("%s %s changed the paused workers to %v", c.path, c.body, got)
		}
	}
	for _, path := range []string{"/pause_generation", "/continue_generation"} {
		if status, answer := call(t, a, "192.0.2.1", path, `{}`); status != http.StatusForbidden {
			t.Errorf("%s from a client outside admin_allow: %d %v; want 403", path, status, answer)
		}
	}
	if got := p.PausedWorkers(); len(got) != 1 || got[0] != "http://b:1" {
		t.Fatalf("refused calls changed the paused workers to %v", got)
	}
	if status, answer := call(t, a, "127.0.0.1", "/pause_generation", `{"mode":"in_place","workers":["http://a:1"]}`); status != 200 || answer["success"] != true {
		t.Fatalf("a pause after the refused calls: %d %v", status, answer)
	}
	if status, answer := call(t, a, "127.0.0.1", "/continue_generation", `{"torch_empty_cache":false}`); status != 200 || len(answer["results"].([]any)) != 2 || len(p.PausedWorkers()) != 0 {
		t.Fatalf("a continue of every paused worker: %d %v, paused %v", status, answer, p.PausedWorkers())
	}
}
