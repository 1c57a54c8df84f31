package diffusionrouter_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
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

// generations reports whether r asks for a generation: a job the router
// costs, queues and may run again.
func generations(r *http.Request) bool {
	return request.Endpoints.Match(r.Method, r.URL).Job(r.Method)
}

func TestJobRunsAgainAfterBadGateway(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "bad"}, fakeworker.Config{Name: "good"})
	bad, failed := fronted(t, ws[0], http.StatusServiceUnavailable, generations)
	r := testrouter.Start(t, testrouter.MetricsSite("diffusion_router {\n workers "+bad+" "+ws[1].URL()+"\n policy round_robin\n max_fails 100\n}"))
	before := testrouter.Value(t, r, "caddy_diffusion_job_reruns_total", map[string]string{"cause": "status"})
	for i := range 6 {
		rp := r.Post("/v1/images/generations", testrouter.SmallImage)
		testrouter.ExpectStatus(t, "a job its first worker answered 503", rp, 200)
		if got := rp.Header.Get("X-Fake-Worker"); got != "good" {
			t.Fatalf("request %d answered by %q", i, got)
		}
	}
	if failed.Load() == 0 {
		t.Fatal("no job reached the failing worker; the test proves nothing")
	}
	if got := testrouter.Value(t, r, "caddy_diffusion_job_reruns_total", map[string]string{"cause": "status"}) - before; got != float64(failed.Load()) {
		t.Fatalf("job_reruns_total{cause=status} rose by %g; the failing worker answered %d jobs", got, failed.Load())
	}
	if got := r.Workers()[bad]["failures"]; got != float64(failed.Load()) {
		t.Fatalf("the failing worker shows %v failures, want %d", got, failed.Load())
	}
}

// A job that two workers answer with a 5xx is taken as the job's own
// fault: it is not run again, its client gets the second answer, and the
// first worker's failure is taken back.
func TestJobFailingOnTwoWorkersIsTheJobsFault(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a"}, fakeworker.Config{Name: "b"}, fakeworker.Config{Name: "c"})
	a, failedA := fronted(t, ws[0], http.StatusBadGateway, generations)
	b, failedB := fronted(t, ws[1], http.StatusBadGateway, generations)
	r := testrouter.Start(t, "diffusion_router {\n workers "+a+" "+b+" "+ws[2].URL()+"\n policy round_robin\n max_attempts 3\n max_fails 100\n}")
	rp := r.Post("/v1/images/generations", testrouter.SmallImage)
	testrouter.ExpectStatus(t, "a job two workers fail", rp, http.StatusBadGateway)
	if !strings.Contains(string(rp.Body), "upstream unavailable") {
		t.Fatalf("body %s; want the second worker's answer", rp.Body)
	}
	if n := failedA.Load() + failedB.Load(); n != 2 || ws[2].Stats().Jobs != 0 {
		t.Fatalf("the job was sent %d times to the failing workers and %d to the good one; want 2 and 0", n, ws[2].Stats().Jobs)
	}
	for _, u := range []string{a, b} {
		if f := r.Workers()[u]["failures"]; f != 0.0 {
			t.Fatalf("worker %s shows %v failures for the job's own fault", u, f)
		}
	}
}

// A 503 says its worker takes no jobs now (shutting down, crashed), not
// that the job is bad: two workers answering a job 503 leave it to run on
// the third, as a worker that leaves the pool answers its jobs 503.
func TestJobAnswered503ByTwoWorkersRunsOnTheThird(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a"}, fakeworker.Config{Name: "b"}, fakeworker.Config{Name: "c"})
	a, _ := fronted(t, ws[0], http.StatusServiceUnavailable, generations)
	b, _ := fronted(t, ws[1], http.StatusServiceUnavailable, generations)
	r := testrouter.Start(t, "diffusion_router {\n workers "+a+" "+b+" "+ws[2].URL()+"\n policy round_robin\n max_attempts 3\n max_fails 100\n}")
	rp := r.Post("/v1/images/generations", testrouter.SmallImage)
	testrouter.ExpectStatus(t, "a job two workers answer 503", rp, http.StatusOK)
	if ws[2].Stats().Jobs != 1 {
		t.Fatalf("the third worker ran %d jobs; want the one two others answered 503", ws[2].Stats().Jobs)
	}
}

// A 5xx from a worker, 500 included (sglang-diffusion's answer to most
// scheduler errors), is its failure: the job runs again on another worker.
func TestA500RunsAgainElsewhere(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "bad", FailRate: 1}, fakeworker.Config{Name: "good"})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n policy round_robin\n max_fails 100\n}")
	for i := range 4 {
		rp := r.Post("/v1/images/generations", testrouter.SmallImage)
		testrouter.ExpectStatus(t, "a job beside a worker that fails every job with 500", rp, 200)
		if got := rp.Header.Get("X-Fake-Worker"); got != "good" {
			t.Fatalf("request %d answered by %q", i, got)
		}
	}
	if ws[0].Stats().Failed == 0 {
		t.Fatal("no job reached the failing worker; the test proves nothing")
	}
}

// TestNoRunAgainOnceTheAnswerBegan breaks answers that stream to the
// client as they come (max_held_answer off): once any of an answer has
// reached the client, the job cannot run again, and the client's
// connection is reset.
func TestNoRunAgainOnceTheAnswerBegan(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "breaks"}, fakeworker.Config{Name: "good"})
	breaks, failed := fronted(t, ws[0], 0, generations)
	r := testrouter.Start(t, "diffusion_router {\n workers "+breaks+" "+ws[1].URL()+"\n policy round_robin\n max_held_answer off\n}")
	broken, whole := 0, 0
	for failed.Load() == 0 && whole < 10 {
		resp, err := testrouter.Client.Post(r.Base+"/v1/images/generations", "application/json", strings.NewReader(testrouter.SmallImage))
		if err != nil {
			t.Fatal(err)
		}
		_, err = io.ReadAll(resp.Body)
		resp.Body.Close()
		switch {
		case resp.StatusCode == 200 && connectionReset(err):
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
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a", TaskType: "T2V"}, fakeworker.Config{Name: "b", TaskType: "T2V"})
	a, failed := fronted(t, ws[0], http.StatusServiceUnavailable, generations)
	r := testrouter.Start(t, "diffusion_router {\n workers "+a+" "+ws[1].URL()+"\n policy round_robin\n max_fails 100\n}")
	statuses := map[int]int{}
	for range 2 {
		statuses[r.Post("/v1/videos", `{"prompt":"a cat","num_frames":4,"num_inference_steps":1}`).Status]++
	}
	if failed.Load() != 1 || statuses[503] != 1 || statuses[200] != 1 {
		t.Fatalf("answers %v with %d failed at the worker; a video job its worker answered for may exist there, so its answer stands", statuses, failed.Load())
	}
}

func TestAsleepWorkerIsSleepingNotFailing(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "slept"}, fakeworker.Config{Name: "awake"})
	r := testrouter.Start(t, testrouter.MetricsSite("diffusion_router {\n workers "+testrouter.URLs(ws)+"\n policy round_robin\n}"))
	// A trainer puts one engine to sleep directly, not through the router.
	testrouter.ExpectStatus(t, "sleep", testrouter.Do(t, "POST", ws[0].URL()+"/release_memory_occupation", strings.NewReader("{}")), 200)
	before := testrouter.Value(t, r, "caddy_diffusion_job_reruns_total", map[string]string{"cause": "asleep"})
	rollout := `{"prompt":"a cat","width":null,"height":null,"num_inference_steps":2,"seed":7}`
	began := time.Now()
	for i := range 4 {
		rp := r.Post("/rollout/generate", rollout)
		testrouter.ExpectStatus(t, "a rollout while one engine sleeps", rp, 200)
		if got := rp.Header.Get("X-Fake-Worker"); got != "awake" {
			t.Fatalf("request %d answered by %q", i, got)
		}
	}
	if got, want := testrouter.Value(t, r, "caddy_diffusion_job_reruns_total", map[string]string{"cause": "asleep"})-before, asleepFindings(time.Since(began)); got < 1 || got > want {
		t.Fatalf("job_reruns_total{cause=asleep} rose by %g; one job found the engine asleep and then at most %g went there to look again", got, want)
	}
	st := r.Workers()[ws[0].URL()]
	if st["state"] != "sleeping" || st["is_sleeping"] != true || st["failures"] != 0.0 {
		t.Fatalf("the sleeping engine shows %v; want sleeping, with no failure", st)
	}
	// Woken directly too, it gets jobs again once it answers one.
	testrouter.ExpectStatus(t, "wake", testrouter.Do(t, "POST", ws[0].URL()+"/resume_memory_occupation", strings.NewReader("{}")), 200)
	testrouter.WaitFor(t, func() bool {
		return r.Post("/rollout/generate", rollout).Header.Get("X-Fake-Worker") == "slept"
	})
	if st := r.Workers()[ws[0].URL()]; st["state"] != "serving" {
		t.Fatalf("the woken engine shows %v", st)
	}
}

// asleepFindings is how many jobs may find an engine asleep within
// elapsed: the first, then one each time the router looks again, after 1 s
// and twice as long each time. On a machine slow enough that the rollouts
// outlast the first second, a second job looks.
func asleepFindings(elapsed time.Duration) float64 {
	n := 1.0
	for wait, at := time.Second, time.Second; at < elapsed; wait, at = 2*wait, at+2*wait {
		n++
	}
	return n
}

func TestEveryWorkerAsleepAnswers503AtOnce(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a"}, fakeworker.Config{Name: "b"})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	for _, w := range ws {
		testrouter.ExpectStatus(t, "sleep", testrouter.Do(t, "POST", w.URL()+"/release_memory_occupation", strings.NewReader("{}")), 200)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "POST", r.Base+"/rollout/generate", strings.NewReader(`{"prompt":"a cat","seed":1}`))
	resp, err := testrouter.Client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("status %d, Retry-After %q; with every engine asleep, 503 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	for _, w := range r.Workers() {
		if w["state"] != "sleeping" || w["failures"] != 0.0 {
			t.Fatalf("worker %v; want sleeping, no failure", w)
		}
	}
}

// A video creation whose worker was sent the job and then dropped the
// connection without an answer may exist there: it is not run again on
// another worker, where it would run twice, its id known to nobody, and
// the client is told why.
func TestVideoCreationSentIsNotRunAgain(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a", TaskType: "T2V"}, fakeworker.Config{Name: "b", TaskType: "T2V"})
	target, err := url.Parse(ws[0].URL())
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(target)
	var created atomic.Int64
	dropping := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || r.URL.Path != "/v1/videos" {
			proxy.ServeHTTP(rw, r)
			return
		}
		proxy.ServeHTTP(httptest.NewRecorder(), r) // the worker creates the job; its answer is lost
		created.Add(1)
		panic(http.ErrAbortHandler) // and the connection drops without an answer
	}))
	t.Cleanup(dropping.Close)
	r := testrouter.Start(t, "diffusion_router {\n workers "+dropping.URL+" "+ws[1].URL()+"\n policy round_robin\n max_fails 100\n}")
	var refused testrouter.Reply
	for range 2 {
		if rp := r.Post("/v1/videos", `{"prompt":"a cat","num_frames":4,"num_inference_steps":1}`); rp.Status != 200 {
			refused = rp
		}
	}
	if created.Load() != 1 || refused.Status != 502 || !strings.Contains(refused.ErrorText(t), "not run again") {
		t.Fatalf("%d jobs created at the dropping worker; the client got %d %s", created.Load(), refused.Status, refused.Body)
	}
	listed := testrouter.Do(t, "GET", ws[1].URL()+"/v1/videos", nil).JSON(t)["data"].([]any)
	if len(listed) != 1 {
		t.Fatalf("the other worker was given %d video jobs; only the one sent to it", len(listed))
	}
}

// A reverse_proxy block's lb_retries moves a job whose worker cannot be
// reached to another worker, as the router's own re-runs do, even with
// max_attempts 1 (no re-run of the router's): every job is answered, the
// worker's failures are counted, and the retry counts as an attempt.
func TestLbRetriesMoveAJobOffAWorkerThatCannotBeReached(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "live"})
	dead := fmt.Sprintf("http://127.0.0.1:%d", testrouter.Port(t))
	r := testrouter.Start(t, testrouter.MetricsSite("diffusion_router {\n workers "+dead+" "+ws[0].URL()+
		"\n policy round_robin\n max_attempts 1\n max_fails 100\n health_interval 1h\n reverse_proxy {\n lb_retries 1\n }\n}"))
	before := testrouter.Value(t, r, "caddy_diffusion_job_attempts_sum", nil)
	for i := range 4 {
		rp := r.Post("/v1/images/generations", testrouter.SmallImage)
		testrouter.ExpectStatus(t, fmt.Sprint("job ", i), rp, 200)
		if got := rp.Header.Get("X-Fake-Worker"); got != "live" {
			t.Fatalf("job %d answered by %q; want the live worker", i, got)
		}
	}
	failures := r.Workers()[dead]["failures"].(float64)
	if failures == 0 {
		t.Fatal("no job was sent to the worker that cannot be reached; the test proves nothing")
	}
	if got := testrouter.Value(t, r, "caddy_diffusion_job_attempts_sum", nil) - before; got != 4+failures {
		t.Fatalf("job_attempts rose by %g; want 4 jobs plus %g retries", got, failures)
	}
}
