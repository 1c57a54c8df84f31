package fleet

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
)

// How a check reads a worker's checksum answer when it is not what was
// asked: a 5xx, or no checksum for the module.

// sglang-diffusion's /get_weights_checksum answers 500 {"error": ...}
// when its scheduler client raised (weights_api.py), which says nothing
// of the weights: a check that got one is tried again at the next passed
// probe, as a catch-up that got a 5xx is.
func TestACheckThatGot500IsAskedAgain(t *testing.T) {
	sum := strings.Repeat("ab", 32)
	first := checksumWorker(t, 200, map[string]string{"transformer": sum})
	var calls atomic.Int32
	flaky := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		if calls.Add(1) == 1 {
			w.WriteHeader(http.StatusInternalServerError)
			_, _ = w.Write([]byte(`{"error":"scheduler did not answer"}`))
			return
		}
		_ = json.NewEncoder(w).Encode(map[string]string{"transformer": sum})
	}))
	t.Cleanup(flaky.Close)
	p, f, _ := pausePool(t, first)
	cfg := &Config{Timeout: 10 * time.Second}
	if _, err := f.Declare(context.Background(), Declaration{Version: "step-2", Checksums: map[string]string{"transformer": sum}}, cfg); err != nil {
		t.Fatal(err)
	}
	if _, _, err := p.Register(flaky.URL, 10); err != nil {
		t.Fatal(err)
	}
	health := &scheduler.HealthConfig{Interval: time.Second, Timeout: time.Second, Fails: 3, Passes: 1, StallFactor: 5}
	checked := func(n int32) func() bool {
		return func() bool {
			info, _ := p.Worker(flaky.URL)
			return calls.Load() >= n && info.State != scheduler.Updating
		}
	}
	p.RecordProbe(flaky.URL, nil, health)
	f.StartCatchUps(cfg)
	if !testkit.WaitUntil(10*time.Second, checked(1)) {
		t.Fatal("the joiner was not checked")
	}
	p.RecordProbe(flaky.URL, nil, health) // its probes pass: each passed probe starts the catch-ups due
	f.StartCatchUps(cfg)
	testkit.WaitUntil(5*time.Second, checked(2))
	if info, _ := p.Worker(flaky.URL); info.VersionFrom != scheduler.SourceVerified {
		t.Errorf("after a 500 and passed probes the worker is %s (%s), asked %d times; want verified", info.State, info.VersionFrom, calls.Load())
	}
}

// sglang-diffusion answers 200 {"error": "Pipeline is not initialized"}
// (gpu_worker.get_weights_checksum), a body without the module asked:
// the result says so in words.
func TestAMissingModuleIsReportedReadably(t *testing.T) {
	sum := strings.Repeat("ab", 32)
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"error":"Pipeline is not initialized"}`))
	}))
	t.Cleanup(s.Close)
	_, f, _ := pausePool(t, s.URL)
	results, err := f.Declare(context.Background(), Declaration{Version: "step-2", Checksums: map[string]string{"transformer": sum}}, &Config{Timeout: 10 * time.Second})
	if err != nil || len(results) != 1 {
		t.Fatalf("declaration: %+v, %v", results, err)
	}
	body, _ := json.Marshal(results[0].Body)
	if strings.Contains(string(body), "%!") {
		t.Errorf("the result reads %s", body)
	}
}
