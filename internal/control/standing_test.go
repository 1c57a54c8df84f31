package control

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// standing is a fixed place in an HA group.
type standing struct {
	leading bool
	leader  string
}

func (s standing) Leading() bool  { return s.leading }
func (s standing) Leader() string { return s.leader }

func getJSON(t *testing.T, a *API, path string) (int, map[string]any) {
	t.Helper()
	rec := httptest.NewRecorder()
	a.Mux().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	var body map[string]any
	if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
		t.Fatalf("%s: %v: %s", path, err, rec.Body)
	}
	return rec.Code, body
}

func standingAPI(t *testing.T, ha Standing) *API {
	p := scheduler.New(t.Name(), zap.NewNop())
	t.Cleanup(func() { _ = p.Close() })
	p.Declare([]string{"http://w:1"})
	return &API{Pool: p, Logger: zap.NewNop(), MinReady: 1, Dashboard: true, HA: ha}
}

func TestStandbyIsNotReadyAndNamesTheLeader(t *testing.T) {
	a := standingAPI(t, standing{leading: false, leader: "http://router-a:8080"})
	code, body := getJSON(t, a, "/readyz")
	ha, _ := body["ha"].(map[string]any)
	if code != http.StatusServiceUnavailable || body["standby"] != true || ha["leader"] != "http://router-a:8080" || ha["leading"] != false {
		t.Fatalf("standby's /readyz: %d %v; want 503, standby, leader router-a", code, body)
	}
	for _, path := range []string{"/health", "/workers", "/dashboard/data"} {
		_, body := getJSON(t, a, path)
		if ha, _ := body["ha"].(map[string]any); ha["leader"] != "http://router-a:8080" || ha["leading"] != false {
			t.Errorf("standby's %s shows ha %v; want leader router-a, not leading", path, body["ha"])
		}
	}
}

func TestLeaderIsReadyAndSaysItLeads(t *testing.T) {
	a := standingAPI(t, standing{leading: true, leader: "http://router-b:8080"})
	code, body := getJSON(t, a, "/readyz")
	if ha, _ := body["ha"].(map[string]any); code != http.StatusOK || body["standby"] != nil || ha["leading"] != true {
		t.Fatalf("leader's /readyz: %d %v; want 200, leading", code, body)
	}
}

func TestNoGroupNoStanding(t *testing.T) {
	a := standingAPI(t, nil)
	for _, path := range []string{"/readyz", "/health", "/workers"} {
		if _, body := getJSON(t, a, path); body["ha"] != nil || body["standby"] != nil {
			t.Errorf("%s of a router without ha shows %v", path, body)
		}
	}
}
