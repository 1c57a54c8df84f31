package diffusionrouter_test

import (
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

func TestMetricsCountWhatHappened(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a"}, fakeworker.Config{Name: "b"})
	r := testrouter.Start(t, testrouter.MetricsSite("diffusion_router metrics-pool {\n workers "+testrouter.URLs(ws)+"\n}"))

	pool := map[string]string{"pool": "metrics-pool"}
	with := func(kv ...string) map[string]string {
		m := map[string]string{"pool": "metrics-pool"}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	// The counters and histograms live as long as the process, over every
	// config and test that used the pool name: what this test did is how
	// much they grew. The per-worker series and gauges are read from the
	// pool, which is this test's own.
	grown := []struct {
		name string
		want map[string]string
		v    float64
	}{
		{"caddy_diffusion_requests_total", with("endpoint", "images", "code", "2xx"), 3},
		{"caddy_diffusion_requests_total", with("endpoint", "images", "code", "4xx"), 1},
		{"caddy_diffusion_requests_total", with("endpoint", "control", "code", "2xx"), 2},
		{"caddy_diffusion_routing_decisions_total", with("strategy", "least_work"), 3},
		{"caddy_diffusion_job_duration_seconds_count", pool, 3},
		{"caddy_diffusion_queue_wait_seconds_count", pool, 3},
		{"caddy_diffusion_prediction_error_ratio_count", pool, 3},
		{"caddy_diffusion_weight_updates_total", with("operation", "update_weights", "outcome", "success"), 1},
	}
	start := make([]float64, len(grown))
	for i, c := range grown {
		start[i] = testrouter.Value(t, r, c.name, c.want)
	}

	for range 3 {
		testrouter.ExpectStatus(t, "image", r.Post("/v1/images/generations", `{"response_format":"b64_json","prompt":"x","size":"1024x1024","num_inference_steps":2}`), 200)
	}
	testrouter.ExpectStatus(t, "bad JSON", r.Post("/v1/images/generations", `{`), 400)
	testrouter.ExpectStatus(t, "workers", r.Get("/workers"), 200)
	testrouter.ExpectStatus(t, "update", r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/m","weight_version":"m1"}`), 200)

	for i, c := range grown {
		if got := testrouter.Value(t, r, c.name, c.want) - start[i]; got != c.v {
			t.Errorf("%s%v grew by %v, want %v", c.name, c.want, got, c.v)
		}
	}
	for _, c := range []struct {
		name string
		want map[string]string
		v    float64
	}{
		{"caddy_diffusion_worker_jobs_total", pool, 3},
		{"caddy_diffusion_worker_cost_total", pool, 6}, // 3 jobs of 1024² x 2 steps
		{"caddy_diffusion_worker_weight_version_info", with("version", "m1"), 2},
		{"caddy_diffusion_worker_state", with("state", "serving"), 2},
		{"caddy_diffusion_worker_state", with("state", "unhealthy"), 0},
		{"caddy_diffusion_serving_workers", pool, 2},
		{"caddy_diffusion_queue_length", pool, 0},
		{"caddy_diffusion_worker_inflight_jobs", pool, 0},
		{"caddy_diffusion_worker_failures_total", pool, 0},
	} {
		if got := testrouter.Value(t, r, c.name, c.want); got != c.v {
			t.Errorf("%s%v = %v, want %v", c.name, c.want, got, c.v)
		}
	}
	if speeds := testrouter.Scrape(t, r, "caddy_diffusion_worker_speed"); len(speeds) != 2 {
		t.Errorf("%d speed series; want one per worker", len(speeds))
	}
}

func TestMetricsOfRemovedWorkerDisappear(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a"}, fakeworker.Config{Name: "b"})
	r := testrouter.Start(t, testrouter.MetricsSite("diffusion_router removal-pool {\n workers "+ws[0].URL()+"\n}"))
	testrouter.ExpectStatus(t, "register", r.Post("/workers", `{"url":"`+ws[1].URL()+`"}`), 200)
	series := func() int { return len(testrouter.Scrape(t, r, "caddy_diffusion_worker_inflight_jobs")) }
	if n := series(); n != 2 {
		t.Fatalf("%d in-flight series with two workers", n)
	}
	testrouter.ExpectStatus(t, "remove", testrouter.Do(t, "DELETE", r.Base+"/workers/"+url.QueryEscape(ws[1].URL()), nil), 200)
	for _, m := range testrouter.Scrape(t, r, "caddy_diffusion_worker_state") {
		if m.Labels["worker"] == ws[1].URL() {
			t.Fatalf("removed worker still has series: %v", m.Labels)
		}
	}
	if n := series(); n != 1 {
		t.Fatalf("%d in-flight series after removing one of two workers", n)
	}
}

func TestMetricsSurviveReloads(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{})
	site := testrouter.MetricsSite("diffusion_router reload-pool {\n workers " + testrouter.URLs(ws) + "\n}")
	r := testrouter.Start(t, site)
	for i := range 5 {
		r.Load(site + "\n# reload " + strconv.Itoa(i))
		testrouter.ExpectStatus(t, "image", r.Post("/v1/images/generations", testrouter.SmallImage), 200)
	}
	if got := testrouter.Value(t, r, "caddy_diffusion_worker_jobs_total", map[string]string{"pool": "reload-pool"}); got != 5 {
		t.Fatalf("jobs after 5 reloads: %v", got)
	}
}

func TestFinishedJobIsLogged(t *testing.T) {
	logFile := filepath.Join(t.TempDir(), "router.log")
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a"})
	jobLog := "log jobs {\n output file " + logFile + "\n format json\n level DEBUG\n include http.handlers.diffusion_router\n}"
	r := testrouter.StartWith(t, jobLog, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	rp := r.Post("/v1/images/generations", `{"response_format":"b64_json","prompt":"a secret prompt","size":"512x512","num_inference_steps":4}`, requestIDHeader, "req-42")
	testrouter.ExpectStatus(t, "image", rp, 200)
	if rp.Header.Get(requestIDHeader) != "req-42" {
		t.Fatalf("request id echoed as %q", rp.Header.Get(requestIDHeader))
	}
	if id := r.Post("/v1/images/generations", testrouter.SmallImage).Header.Get(requestIDHeader); len(id) != 16 {
		t.Fatalf("generated request id %q", id)
	}
	var entry map[string]any
	testrouter.WaitFor(t, func() bool {
		data, _ := os.ReadFile(logFile)
		for _, line := range strings.Split(string(data), "\n") {
			if strings.Contains(line, "a secret prompt") {
				t.Fatal("the prompt was logged")
			}
			if strings.Contains(line, `"job finished"`) && strings.Contains(line, "req-42") {
				return json.Unmarshal([]byte(line), &entry) == nil
			}
		}
		return false
	})
	for k, want := range map[string]any{
		"request_id": "req-42", "endpoint": "images", "worker": ws[0].URL(),
		"cost": 1.0, "status": 200.0, "weight_version": oldVersion,
	} {
		if entry[k] != want {
			t.Errorf("log field %s = %v, want %v", k, entry[k], want)
		}
	}
	for _, k := range []string{"queue_wait", "latency"} {
		if _, ok := entry[k].(float64); !ok {
			t.Errorf("log field %s = %v", k, entry[k])
		}
	}
}

// TestBacklogPredictsTheBatch reads caddy_diffusion_backlog_seconds once
// a batch of mixed jobs has all arrived, and times the batch to its last
// answer: the gauge is what an autoscaler scales on, and must be within
// a factor of 1.6 of the truth either way once speeds are learned.
func TestBacklogPredictsTheBatch(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{UnitMs: 20}, fakeworker.Config{UnitMs: 20}, fakeworker.Config{UnitMs: 20})
	r := testrouter.Start(t, testrouter.MetricsSite("diffusion_router backlog-pool {\n workers "+testrouter.URLs(ws)+"\n}"))
	pool := map[string]string{"pool": "backlog-pool"}
	image := func(steps int) string {
		return fmt.Sprintf(`{"response_format":"b64_json","prompt":"x","size":"1024x1024","num_inference_steps":%d}`, steps)
	}
	for range 2 { // every worker learns its speed
		batch(t, r, []string{image(2), image(2), image(2)})
	}
	if got := testrouter.Value(t, r, "caddy_diffusion_backlog_seconds", pool); got != 0 {
		t.Fatalf("backlog of an idle pool %v; want 0", got)
	}

	rng := rand.New(rand.NewPCG(1, 2))
	bodies := make([]string, 24)
	for i := range bodies {
		bodies[i] = image(2 + rng.IntN(7)) // 40 to 160 ms
	}
	done := testrouter.Value(t, r, "caddy_diffusion_worker_jobs_total", pool)
	answers := batchAsync(r, bodies)
	// The gauge is read in the scrape that shows the batch arrived, and
	// the batch timed from just before it: on a loaded machine a scrape
	// can take as long as the batch.
	deadline := time.Now().Add(30 * time.Second)
	var predicted time.Duration
	var read time.Time
	for {
		read = time.Now()
		scraped := testrouter.ScrapeAll(t, r)
		arrived := testrouter.ValueIn(scraped, "caddy_diffusion_queue_length", pool) + testrouter.ValueIn(scraped, "caddy_diffusion_worker_inflight_jobs", pool) +
			testrouter.ValueIn(scraped, "caddy_diffusion_worker_jobs_total", pool) - done
		if arrived >= float64(len(bodies)) {
			predicted = time.Duration(testrouter.ValueIn(scraped, "caddy_diffusion_backlog_seconds", pool) * float64(time.Second))
			break
		}
		if read.After(deadline) {
			t.Fatal("the batch never arrived whole")
		}
		time.Sleep(time.Millisecond)
	}
	for range bodies {
		if status := <-answers; status != 200 {
			t.Fatalf("a job of the batch got %d", status)
		}
	}
	took := time.Since(read)
	t.Logf("backlog %v; the batch took %v more (%.2fx)", predicted, took, took.Seconds()/predicted.Seconds())
	if ratio := took.Seconds() / predicted.Seconds(); ratio > 1.6 || ratio < 1/1.6 {
		t.Errorf("backlog %v; the batch took %v: off by more than 1.6x", predicted, took)
	}
	if got := testrouter.Value(t, r, "caddy_diffusion_backlog_seconds", pool); got != 0 {
		t.Errorf("backlog after the batch %v; want 0", got)
	}
}

// batch sends the image bodies to r at once and waits for every answer.
func batch(t *testing.T, r *testrouter.Router, bodies []string) {
	t.Helper()
	answers := batchAsync(r, bodies)
	for range bodies {
		if status := <-answers; status != 200 {
			t.Fatalf("a job got %d", status)
		}
	}
}

// batchAsync sends the image bodies to r at once; each answer's status
// arrives on the channel (0: no answer).
func batchAsync(r *testrouter.Router, bodies []string) <-chan int {
	answers := make(chan int, len(bodies))
	for _, body := range bodies {
		go func() {
			resp, err := testrouter.Client.Post(r.Base+"/v1/images/generations", "application/json", strings.NewReader(body))
			if err != nil {
				answers <- 0
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			answers <- resp.StatusCode
		}()
	}
	return answers
}
