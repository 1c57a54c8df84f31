package harness

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"
	"testing"
)

// TestRouterInFrontOfFleet starts two fake workers and a router config in
// front of them, and checks that a generation request gets through.
func TestRouterInFrontOfFleet(t *testing.T) {
	for _, v := range []string{"HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME"} {
		t.Setenv(v, os.Getenv(v)) // restored after the test
	}
	cleanHome, err := IsolateHome("harness-test-")
	if err != nil {
		t.Fatal(err)
	}
	defer cleanHome()

	f, err := StartFleet([]float64{1, 2}, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if len(f) != 2 || f[1].Name != "w2" || f[1].Speed != 2 || len(f.URLs()) != 2 {
		t.Fatalf("fleet %+v, urls %v", f, f.URLs())
	}

	port, err := FreePort()
	if err != nil {
		t.Fatal(err)
	}
	// No hedges: a job of a pool that has learned no speed yet may overrun
	// its prediction on a busy machine, and its copy would make two.
	text := fmt.Sprintf("{\n\tadmin off\n\tauto_https off\n\tpersist_config off\n\tlog {\n\t\tlevel ERROR\n\t}\n}\n:%d {\n\tbind 127.0.0.1\n\tdiffusion_router harnesstest {\n\t\tworkers %s\n\t\thedge_after off\n\t}\n}\n",
		port, strings.Join(f.URLs(), " "))
	cfg, _, err := Adapt([]byte(text), "test.Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	if err := StartRouter(context.Background(), cfg, url); err != nil {
		t.Fatal(err)
	}
	defer StopRouter()

	resp, err := http.Post(url+"/v1/images/generations", "application/json",
		strings.NewReader(`{"prompt": "a cat", "size": "64x64", "num_inference_steps": 1, "response_format": "b64_json"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("generation answered %s", resp.Status)
	}
	jobs := 0
	for _, st := range f.Stats() {
		jobs += st.Jobs
	}
	if jobs != 1 {
		t.Errorf("the fleet served %d jobs, want 1", jobs)
	}
}

func TestAdaptRejectsBadCaddyfile(t *testing.T) {
	_, _, err := Adapt([]byte(":1 {\n\tdiffusion_router p {\n\t\tpolcy round_robin\n\t}\n}\n"), "bad.Caddyfile")
	if err == nil || !strings.Contains(err.Error(), "bad.Caddyfile") || !strings.Contains(err.Error(), "polcy") {
		t.Errorf("an unknown option adapted, or its error names neither the file nor the option: %v", err)
	}
}

// The Caddyfile adapter reads syntax only; a bad value is refused when
// the router loads the config.
func TestStartRouterRefusesBadValue(t *testing.T) {
	cfg, _, err := Adapt([]byte("{\n\tadmin off\n}\n:1 {\n\tdiffusion_router p {\n\t\tpolicy nosuch\n\t}\n}\n"), "bad.Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	err = StartRouter(context.Background(), cfg, "http://127.0.0.1:1")
	if !errors.Is(err, ErrLoad) || !strings.Contains(err.Error(), "nosuch") {
		t.Errorf("got %v, want an error wrapping ErrLoad that names the policy", err)
	}
}

func TestStartRouterRefusedConfig(t *testing.T) {
	err := StartRouter(context.Background(), []byte(`{"admin": {"disabled": true}, "apps": {"nosuch": {}}}`), "http://127.0.0.1:1")
	if !errors.Is(err, ErrLoad) {
		t.Errorf("got %v, want an error wrapping ErrLoad", err)
	}
}

func TestRestartKeepsTheURL(t *testing.T) {
	f, err := StartFleet([]float64{2}, 1)
	if err != nil {
		t.Fatal(err)
	}
	old := f[0]
	old.Crash()
	m, err := old.Restart()
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if m.URL() != old.URL() || m.Name != "w1" || m.Config().Speed != 2 {
		t.Errorf("restarted as %s %s speed %g, want %s w1 speed 2", m.URL(), m.Name, m.Config().Speed, old.URL())
	}
	resp, err := http.Get(m.URL() + "/health")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("restarted worker's /health: %s", resp.Status)
	}
}
