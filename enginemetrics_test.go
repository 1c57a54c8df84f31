package diffusionrouter

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestLabelSamples(t *testing.T) {
	var out bytes.Buffer
	seen := map[string]bool{}
	text := "# HELP x_total Xs.\n# TYPE x_total counter\nx_total 3\ny{a=\"{}\"} 1.5\nz{} 2\n"
	labelSamples(&out, []byte(text), "10.0.0.1:30000", seen)
	labelSamples(&out, []byte(text), "10.0.0.2:30000", seen)
	want := "# HELP x_total Xs.\n# TYPE x_total counter\n" +
		"x_total{worker_addr=\"10.0.0.1:30000\"} 3\ny{worker_addr=\"10.0.0.1:30000\",a=\"{}\"} 1.5\nz{worker_addr=\"10.0.0.1:30000\"} 2\n" +
		"x_total{worker_addr=\"10.0.0.2:30000\"} 3\ny{worker_addr=\"10.0.0.2:30000\",a=\"{}\"} 1.5\nz{worker_addr=\"10.0.0.2:30000\"} 2\n"
	if out.String() != want {
		t.Fatalf("labelled:\n%s\nwant:\n%s", out.String(), want)
	}
}

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
	r := startRouter(t, "diffusion_router {\n workers "+a.URL+" "+b.URL+"\n}")
	rp := r.get("/engine_metrics")
	expectStatus(t, "engine metrics", rp, http.StatusOK)
	for _, want := range []string{
		`sglang:num_running_reqs{worker_addr="` + strings.TrimPrefix(a.URL, "http://") + `"} 1`,
		`sglang:num_running_reqs{worker_addr="` + strings.TrimPrefix(b.URL, "http://") + `"} 2`,
	} {
		if !strings.Contains(string(rp.body), want) {
			t.Errorf("engine metrics lack %s:\n%s", want, rp.body)
		}
	}
	if strings.Count(string(rp.body), "# TYPE") != 1 {
		t.Errorf("TYPE line repeated:\n%s", rp.body)
	}
}
