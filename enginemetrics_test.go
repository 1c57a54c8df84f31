package diffusionrouter_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

func TestEngineMetricsGathersEveryWorker(t *testing.T) {
	metrics := func(n string) *httptest.Server {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/metrics" {
				_, _ = w.Write([]byte("# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs " + n + "\n"))
				return
			}
			http.NotFound(w, r)
		}))
		t.Cleanup(srv.Close)
		return srv
	}
	a, b := metrics("1"), metrics("2")
	r := testrouter.Start(t, "diffusion_router {\n workers "+a.URL+" "+b.URL+"\n}")
	rp := r.Get("/engine_metrics")
	testrouter.ExpectStatus(t, "engine metrics", rp, http.StatusOK)
	for _, want := range []string{
		`sglang:num_running_reqs{worker_addr="` + strings.TrimPrefix(a.URL, "http://") + `"} 1`,
		`sglang:num_running_reqs{worker_addr="` + strings.TrimPrefix(b.URL, "http://") + `"} 2`,
	} {
		if !strings.Contains(string(rp.Body), want) {
			t.Errorf("engine metrics lack %s:\n%s", want, rp.Body)
		}
	}
	if strings.Count(string(rp.Body), "# TYPE") != 1 {
		t.Errorf("TYPE line repeated:\n%s", rp.Body)
	}
}
