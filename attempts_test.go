package diffusionrouter

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/examples/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/request"
)

// fronted puts a stand-in before a fake worker, as a failing ingress or a
// worker going down would be: requests that fail picks get status (or, for
// status 0, a broken-off answer); the rest reach the worker. It reports how
// many requests it failed.
func fronted(t *testing.T, w *fakeworker.Worker, status int, fail func(*http.Request) bool) (string, *atomic.Int64) {
	t.Helper()
	target, err := url.Parse(w.URL())
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(target)
	failed := new(atomic.Int64)
	srv := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if !fail(r) {
			proxy.ServeHTTP(rw, r)
			return
		}
		failed.Add(1)
		if status == 0 { // the answer begins, then the worker goes away
			rw.Header().Set("Content-Type", "application/json")
			rw.WriteHeader(http.StatusOK)
			rw.Write([]byte(`{"created": 1, "data": [{"b64_json": "iVBO`))
			http.NewResponseController(rw).Flush()
			panic(http.ErrAbortHandler)
		}
		rw.Header().Set("Content-Type", "application/json")
		rw.WriteHeader(status)
		rw.Write([]byte(`{"detail": "upstream unavailable"}`))
	}))
	t.Cleanup(srv.Close)
	return srv.URL, failed
}

func generations(r *http.Request) bool {
	return request.Endpoints.Match(r.Method, r.URL).Job(r.Method)
}

func TestJobRunsAgainAfterBadGateway(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "bad"}, fakeworker.Config{Name: "good"})
	bad, failed := fronted(t, ws[0], http.StatusServiceUnavailable, generations)
	r := startRouter(t, metricsSite("diffusion_router {\n workers "+bad+" "+ws[1].URL()+"\n policy round_robin\n max_fails 100\n}"))
	before := value(t, r, "caddy_diffusion_job_reruns_total", map[string]string{"cause": "status"})
	for i := range 6 {
		rp := r.post("/v1/images/generations", smallImage)
		expectStatus(t, "a job its first worker answered 503", rp, 200)
		if got := rp.header.Get("X-Fake-Worker"); got != "good" {
			t.Fatalf("request %d answered by %q", i, got)
		}
	}
	if failed.Load() == 0 {
		t.Fatal("no job reached the failing worker; the test proves nothing")
	}
	if got := value(t, r, "caddy_diffusion_job_reruns_total", map[string]string{"cause": "status"}) - before; got != float64(failed.Load()) {
		t.Fatalf("job_reruns_total{cause=status} rose by %g; the failing worker answered %d jobs", got, failed.Load())
	}
	if got := workerStates(t, r)[bad]["failures"]; got != float64(failed.Load()) {
		t.Fatalf("the failing worker shows %v failures, want %d", got, failed.Load())
	}
}

func TestJobFailingEverywhereAnswersTheLastError(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "a"}, fakeworker.Config{Name: "b"})
	a, failedA := fronted(t, ws[0], http.StatusBadGateway, generations)
	b, failedB := fronted(t, ws[1], http.StatusBadGateway, generations)
	r := startRouter(t, "diffusion_router {\n workers "+a+" "+b+"\n max_attempts 3\n max_fails 100\n}")
	rp := r.post("/v1/images/generations", smallImage)
	expectStatus(t, "a job every worker fails", rp, http.StatusBadGateway)
	if !strings.Contains(string(rp.body), "upstream unavailable") {
		t.Fatalf("body %s; want the last worker's answer", rp.body)
	}
	if n := failedA.Load() + failedB.Load(); n != 3 {
		t.Fatalf("the job was sent %d times; want max_attempts, 3", n)
	}
}

func TestNoRunAgainOnceTheAnswerBegan(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "breaks"}, fakeworker.Config{Name: "good"})
	breaks, failed := fronted(t, ws[0], 0, generations)
	r := startRouter(t, "diffusion_router {\n workers "+breaks+" "+ws[1].URL()+"\n policy round_robin\n}")
	broken, whole := 0, 0
	for failed.Load() == 0 && whole < 10 {
		resp, err := client.Post(r.base+"/v1/images/generations", "application/json", strings.NewReader(smallImage))
		if err != nil {
			t.Fatal(err)
		}
		_, err = io.ReadAll(resp.Body)
		resp.Body.Close()
		switch {
		case resp.StatusCode == 200 && err != nil:
			broken++
		case resp.StatusCode == 200:
			whole++
		default:
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	if failed.Load() != 1 || broken != 1 {
		t.Fatalf("%d broken answers to the client after %d at the worker; the client gets the broken answer itself", broken, failed.Load())
	}
	if jobs := ws[1].Stats().Jobs; jobs != whole {
		t.Fatalf("the other worker ran %d jobs for %d whole answers; a job whose answer began must not run again", jobs, whole)
	}
}

func TestVideoJobAnsweredIsNotRunAgain(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "a", TaskType: "T2V"}, fakeworker.Config{Name: "b", TaskType: "T2V"})
	a, failed := fronted(t, ws[0], http.StatusServiceUnavailable, generations)
	r := startRouter(t, "diffusion_router {\n workers "+a+" "+ws[1].URL()+"\n policy round_robin\n max_fails 100\n}")
	statuses := map[int]int{}
	for range 2 {
		statuses[r.post("/v1/videos", `{"prompt":"a cat","num_frames":4,"num_inference_steps":1}`).status]++
	}
	if failed.Load() != 1 || statuses[503] != 1 || statuses[200] != 1 {
		t.Fatalf("answers %v with %d failed at the worker; a video job its worker answered for may exist there, so its answer stands", statuses, failed.Load())
	}
}

func TestAsleepWorkerIsSleepingNotFailing(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "slept"}, fakeworker.Config{Name: "awake"})
	r := startRouter(t, metricsSite("diffusion_router {\n workers "+urlsOf(ws)+"\n policy round_robin\n}"))
	// A trainer puts one engine to sleep directly, not through the router.
	expectStatus(t, "sleep", do(t, "POST", ws[0].URL()+"/release_memory_occupation", strings.NewReader("{}")), 200)
	before := value(t, r, "caddy_diffusion_job_reruns_total", map[string]string{"cause": "asleep"})
	rollout := `{"prompt":"a cat","width":null,"height":null,"num_inference_steps":2,"seed":7}`
	for i := range 4 {
		rp := r.post("/rollout/generate", rollout)
		expectStatus(t, "a rollout while one engine sleeps", rp, 200)
		if got := rp.header.Get("X-Fake-Worker"); got != "awake" {
			t.Fatalf("request %d answered by %q", i, got)
		}
	}
	if got := value(t, r, "caddy_diffusion_job_reruns_total", map[string]string{"cause": "asleep"}) - before; got != 1 {
		t.Fatalf("job_reruns_total{cause=asleep} rose by %g; one job found the engine asleep and then none went there", got)
	}
	st := workerStates(t, r)[ws[0].URL()]
	if st["state"] != "sleeping" || st["is_sleeping"] != true || st["failures"] != 0.0 {
		t.Fatalf("the sleeping engine shows %v; want sleeping, with no failure", st)
	}
	// Woken directly too, it gets jobs again once it answers one.
	expectStatus(t, "wake", do(t, "POST", ws[0].URL()+"/resume_memory_occupation", strings.NewReader("{}")), 200)
	waitFor(t, func() bool {
		return r.post("/rollout/generate", rollout).header.Get("X-Fake-Worker") == "slept"
	})
	if st := workerStates(t, r)[ws[0].URL()]; st["state"] != "serving" {
		t.Fatalf("the woken engine shows %v", st)
	}
}

func TestEveryWorkerAsleepAnswers503AtOnce(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "a"}, fakeworker.Config{Name: "b"})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n}")
	for _, w := range ws {
		expectStatus(t, "sleep", do(t, "POST", w.URL()+"/release_memory_occupation", strings.NewReader("{}")), 200)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "POST", r.base+"/rollout/generate", strings.NewReader(`{"prompt":"a cat","seed":1}`))
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("status %d, Retry-After %q; with every engine asleep, 503 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	for _, w := range workerStates(t, r) {
		if w["state"] != "sleeping" || w["failures"] != 0.0 {
			t.Fatalf("worker %v; want sleeping, no failure", w)
		}
	}
}
