package diffusionrouter_test

import (
	"context"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// A trainer that moves the weights into the engines itself pauses them
// through the router first (docs/operations.md, "Using with miles").

// longJob is the body of an image job predicted to run for many seconds
// (50 cost units), so that one a test holds on its worker is neither
// overdue (which would let the worker take one more) nor hung while the
// test runs.
const longJob = `{"response_format":"b64_json","prompt":"a cat","size":"1024x1024","num_inference_steps":50}`

// pauseOf is a pause's (or a continue's) body naming workers.
func pauseOf(workers ...*fakeworker.Worker) string {
	urls := make([]string, len(workers))
	for i, w := range workers {
		urls[i] = `"` + w.URL() + `"`
	}
	return `{"workers": [` + strings.Join(urls, ",") + `]}`
}

// async POSTs body to path on r and delivers the answer.
func async(r *testrouter.Router, path, body string) <-chan testrouter.Reply {
	out := make(chan testrouter.Reply, 1)
	go func() { out <- r.Post(path, body) }()
	return out
}

// notYet fails t if the call has answered.
func notYet(t *testing.T, what string, call <-chan testrouter.Reply) {
	t.Helper()
	select {
	case rp := <-call:
		t.Fatalf("%s answered %d %s too early", what, rp.Status, rp.Body)
	default:
	}
}

// pausedSince is when r shows the worker at u paused; zero when it is not.
func pausedSince(t *testing.T, r *testrouter.Router, u string) time.Time {
	t.Helper()
	s, _ := r.Workers()[u]["paused_since"].(string)
	if s == "" {
		return time.Time{}
	}
	at, err := time.Parse(time.RFC3339, s)
	if err != nil {
		t.Fatalf("paused_since %q is not RFC 3339: %v", s, err)
	}
	return at
}

// jobOn sends a small image job and fails t unless worker (a fake's
// name) answers it.
func jobOn(t *testing.T, r *testrouter.Router, worker, what string) {
	t.Helper()
	rp := r.Post("/v1/images/generations", testrouter.SmallImage)
	testrouter.ExpectStatus(t, what, rp, 200)
	if by := rp.Header.Get("X-Fake-Worker"); by != worker {
		t.Fatalf("%s: served by %s; want %s", what, by, worker)
	}
}

// A pause answers once the jobs its workers hold have ended. Meanwhile
// the paused worker gets no job, though free, the jobs waiting go to the
// worker not paused, and the pause shows in /workers, /health, /readyz,
// the metrics and /fleet_operation; continue lets the worker serve again.
func TestPauseAnswersOnceItsWorkersJobsHaveEnded(t *testing.T) {
	ws := namedWorkers(t, 2, fakeworker.Config{})
	a, b := ws[0], ws[1]
	r := testrouter.Start(t, testrouter.MetricsSite("diffusion_router pause-pool {\n workers "+testrouter.URLs(ws)+"\n min_ready 2\n}"))
	releaseA, releaseB := a.Hold(), b.Hold()
	held := make(chan testrouter.Reply, 2) // in the order they end
	for range 2 {
		go func() { held <- r.Post("/v1/images/generations", longJob) }()
	}
	testrouter.WaitFor(t, func() bool {
		workers := r.Workers()
		return workers[a.URL()]["active_requests"] == 1.0 && workers[b.URL()]["active_requests"] == 1.0
	})

	asked := time.Now()
	pause := async(r, "/pause_generation", pauseOf(a))
	testrouter.WaitFor(t, func() bool { return r.Workers()[a.URL()]["state"] == "paused" })
	if since := pausedSince(t, r, a.URL()); since.Before(asked) || since.After(time.Now()) {
		t.Fatalf("a shows paused since %v; want the time of the pause, %v", since, asked)
	}
	if !pausedSince(t, r, b.URL()).IsZero() {
		t.Fatal("b, not named, shows paused")
	}
	health := r.Get("/health").JSON(t)
	if health["paused_workers"] != 1.0 || health["healthy_workers"] != 1.0 || health["status"] != "healthy" {
		t.Fatalf("/health while a is paused: %v", health)
	}
	ready := r.Get("/readyz")
	testrouter.ExpectStatus(t, "/readyz with min_ready 2 while one of two workers is paused", ready, 200)
	if body := ready.JSON(t); body["paused_workers"] != 1.0 || body["serving_workers"] != 1.0 {
		t.Fatalf("/readyz while a is paused: %s", ready.Body)
	}
	if v := testrouter.Value(t, r, "caddy_diffusion_worker_state", map[string]string{"pool": "pause-pool", "worker": a.URL(), "state": "paused"}); v != 1 {
		t.Fatalf("caddy_diffusion_worker_state{state=\"paused\"} of a is %v; want 1", v)
	}
	notYet(t, "the pause, while a job of a runs", pause)

	waiting := async(r, "/v1/images/generations", testrouter.SmallImage) // a is paused, b is busy
	testrouter.WaitFor(t, func() bool { return r.Get("/health").JSON(t)["queued_requests"] == 1.0 })
	releaseB()
	for what, call := range map[string]<-chan testrouter.Reply{"b's job": held, "the job that waited": waiting} {
		rp := <-call
		testrouter.ExpectStatus(t, what, rp, 200)
		if by := rp.Header.Get("X-Fake-Worker"); by != "b" {
			t.Fatalf("%s was served by %s; want b", what, by)
		}
	}
	notYet(t, "the pause, while a job of a runs", pause)

	releaseA()
	rp := <-pause
	testrouter.ExpectStatus(t, "the pause once a's job ended", rp, 200)
	testrouter.ExpectStatus(t, "a's job, which the pause waited for", <-held, 200)
	body := rp.JSON(t)
	results, _ := body["results"].([]any)
	if body["success"] != true || body["status"] != "ok" || len(results) != 1 || results[0].(map[string]any)["worker_url"] != a.URL() {
		t.Fatalf("the pause answered %s; want success with a's result", rp.Body)
	}
	if op := r.Get("/fleet_operation").JSON(t); op["operation"] != "pause_generation" || op["running"] != false {
		t.Fatalf("/fleet_operation after the pause: %v", op)
	}
	for i := range 4 {
		jobOn(t, r, "b", "a job while a is paused "+string(rune('0'+i)))
	}

	testrouter.ExpectStatus(t, "continue a", r.Post("/continue_generation", pauseOf(a)), 200)
	if st := r.Workers()[a.URL()]; st["state"] != "serving" || st["paused_since"] != nil {
		t.Fatalf("a after continue: %v", st)
	}
	testrouter.ExpectStatus(t, "pause b", r.Post("/pause_generation", pauseOf(b)), 200) // idle: at once
	jobOn(t, r, "a", "a job once a continued and b paused")
	testrouter.ExpectStatus(t, "continue every paused worker", r.Post("/continue_generation", ""), 200)
	if v := testrouter.Value(t, r, "caddy_diffusion_worker_state", map[string]string{"pool": "pause-pool", "worker": b.URL(), "state": "serving"}); v != 1 {
		t.Fatalf("caddy_diffusion_worker_state{state=\"serving\"} of b after continue is %v; want 1", v)
	}
}

// A job that hangs does not hold a pause, as it does not hold an update's
// drain: the pause answers once the job is taken for hung, its worker
// stays paused, and the batch beside it loses nothing.
func TestPauseDoesNotWaitForAHungJob(t *testing.T) {
	const hangBound = time.Second // health_timeout; the jobs take tens of milliseconds
	ws, r := warmRouter(t, 2)
	batchDone := batchBesideAHungWorker(t, r, ws[0], 8)

	start := time.Now()
	rp := r.Post("/pause_generation", pauseOf(ws[0]))
	took := time.Since(start)
	testrouter.ExpectStatus(t, "the pause beside a hung job", rp, 200)
	if limit := hangBound + 5*time.Second; took > limit {
		t.Fatalf("the pause took %s; at most %s (the hang bound and 5 s)", took, limit)
	}
	result := rp.JSON(t)["results"].([]any)[0].(map[string]any)
	if msg, _ := result["body"].(map[string]any)["message"].(string); !strings.Contains(msg, "hung") {
		t.Fatalf("the hung worker's result is %v; want it to say its job hung", result)
	}
	if pausedSince(t, r, ws[0].URL()).IsZero() {
		t.Fatalf("the worker of the hung job is not paused: %v", r.Workers()[ws[0].URL()])
	}
	batchDone("the pause")
}

// A pause whose workers' jobs outlast drain_timeout answers 504 and is
// undone: the workers it paused serve again; one paused before stays so.
func TestPauseBeyondDrainTimeoutServesAgain(t *testing.T) {
	ws := namedWorkers(t, 2, fakeworker.Config{})
	a, b := ws[0], ws[1]
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n drain_timeout 300ms\n}")
	testrouter.ExpectStatus(t, "pause b", r.Post("/pause_generation", pauseOf(b)), 200)
	release := a.Hold()
	job := testrouter.BusyWith(t, r, a.URL(), longJob)
	rp := r.Post("/pause_generation", "")
	testrouter.ExpectStatus(t, "a pause beside a job that outlasts drain_timeout", rp, 504)
	if msg := rp.ErrorText(t); !strings.Contains(msg, "drain_timeout") {
		t.Fatalf("the 504 says %q; want it to name drain_timeout", msg)
	}
	workers := r.Workers()
	if workers[a.URL()]["state"] != "serving" || workers[b.URL()]["state"] != "paused" {
		t.Fatalf("after the pause ran out of time: a %v, b %v; want a serving, b paused as before", workers[a.URL()], workers[b.URL()])
	}
	release()
	testrouter.ExpectStatus(t, "the job the pause did not outwait", <-job, 200)
	jobOn(t, r, "a", "a job after the pause ran out of time")
}

// While every worker is paused a job waits in the queue, until a continue
// or queue_timeout; /readyz stays ready. Pausing a paused worker changes
// nothing, and an operator's PUT /workers/{id} ends a pause.
func TestJobsWaitWhileEveryWorkerIsPaused(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{})
	site := "diffusion_router {\n workers " + testrouter.URLs(ws) + "\n"
	r := testrouter.Start(t, site+"}")
	testrouter.ExpectStatus(t, "pause", r.Post("/pause_generation", `{"mode": "abort"}`), 200)
	testrouter.ExpectStatus(t, "/readyz while the only worker is paused", r.Get("/readyz"), 200)
	testrouter.ExpectStatus(t, "/health while the only worker is paused", r.Get("/health"), 200)
	job := async(r, "/v1/images/generations", testrouter.SmallImage)
	testrouter.WaitFor(t, func() bool { return r.Get("/health").JSON(t)["queued_requests"] == 1.0 })
	notYet(t, "a job while every worker is paused", job)
	testrouter.ExpectStatus(t, "continue", r.Post("/continue_generation", ""), 200)
	testrouter.ExpectStatus(t, "the job that waited for the continue", <-job, 200)

	r.Load(site + " queue_timeout 200ms\n}")
	testrouter.ExpectStatus(t, "pause", r.Post("/pause_generation", ""), 200)
	since := pausedSince(t, r, ws[0].URL())
	rp := r.Post("/v1/images/generations", testrouter.SmallImage)
	testrouter.ExpectStatus(t, "a job while every worker is paused, with queue_timeout", rp, 503)
	if msg := rp.ErrorText(t); !strings.Contains(msg, "queue_timeout") {
		t.Fatalf("the 503 says %q; want it to name queue_timeout", msg)
	}
	again := r.Post("/pause_generation", pauseOf(ws[0]))
	testrouter.ExpectStatus(t, "a pause of a paused worker", again, 200)
	if msg := again.JSON(t)["results"].([]any)[0].(map[string]any)["body"].(map[string]any)["message"].(string); !strings.HasPrefix(msg, "already paused") {
		t.Fatalf("the pause of a paused worker says %q", msg)
	}
	if got := pausedSince(t, r, ws[0].URL()); !got.Equal(since) {
		t.Fatalf("paused again, the worker shows paused since %v; want %v, the first pause", got, since)
	}
	r.Load(site + " queue_timeout 300ms\n}") // a reload keeps the pool, and with it the pause
	if got := pausedSince(t, r, ws[0].URL()); !got.Equal(since) {
		t.Fatalf("after a reload, the worker shows paused since %v; want %v", got, since)
	}
	testrouter.ExpectStatus(t, "a job while every worker is paused, after a reload", r.Post("/v1/images/generations", testrouter.SmallImage), 503)

	put := testrouter.Do(t, "PUT", r.Base+"/workers/"+url.QueryEscape(ws[0].URL()), strings.NewReader(`{"is_dead": false}`))
	testrouter.ExpectStatus(t, "an operator's PUT", put, 200)
	if st := r.Workers()[ws[0].URL()]; st["state"] != "serving" || st["paused_since"] != nil {
		t.Fatalf("after the operator's PUT: %v; want serving, not paused", st)
	}
	jobOn(t, r, "a", "a job after the operator's PUT")
}

// An update, a sleep and a wake through the router reach the paused
// workers and leave them paused.
func TestUpdateSleepAndWakeLeaveWorkersPaused(t *testing.T) {
	ws := namedWorkers(t, 2, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	testrouter.ExpectStatus(t, "pause", r.Post("/pause_generation", ""), 200)
	testrouter.ExpectStatus(t, "update while paused", r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/2","weight_version":"step-2"}`), 200)
	for _, w := range ws {
		if w.Weights() != "/ckpt/2" {
			t.Fatalf("worker %s runs %q after the update; want /ckpt/2", w.URL(), w.Weights())
		}
		if st := r.Workers()[w.URL()]; st["state"] != "paused" || st["weight_version"] != "step-2" {
			t.Fatalf("worker %s after the update: %v; want paused on step-2", w.URL(), st)
		}
	}
	testrouter.ExpectStatus(t, "sleep while paused", r.Post("/release_memory_occupation", "{}"), 200)
	if st := r.Workers()[ws[0].URL()]["state"]; st != "sleeping" {
		t.Fatalf("a paused worker put to sleep shows %v", st)
	}
	testrouter.ExpectStatus(t, "wake while paused", r.Post("/resume_memory_occupation", "{}"), 200)
	for _, w := range ws {
		if st := r.Workers()[w.URL()]["state"]; st != "paused" {
			t.Fatalf("worker %s woken shows %v; want paused", w.URL(), st)
		}
	}
	testrouter.ExpectStatus(t, "continue", r.Post("/continue_generation", "{}"), 200)
	rp := r.Post("/v1/images/generations", testrouter.SmallImage)
	testrouter.ExpectStatus(t, "a job after continue", rp, 200)
	if v := rp.Header.Get(weightVersionHeader); v != "step-2" {
		t.Fatalf("a job after continue was served on %q; want step-2", v)
	}
}

// A pause runs to its end though its caller leaves, as an update does:
// /fleet_operation shows it running and then how it ended, and the
// fleet is busy meanwhile for a caller that does not wait.
func TestAPauseRunsToItsEndWithoutItsCaller(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	release := ws[0].Hold()
	job := testrouter.BusyWith(t, r, ws[0].URL(), longJob)

	ctx, leave := context.WithCancel(t.Context())
	req, _ := http.NewRequestWithContext(ctx, "POST", r.Base+"/pause_generation", nil)
	left := make(chan error, 1)
	go func() {
		resp, err := testrouter.Client.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		left <- err
	}()
	testrouter.WaitFor(t, func() bool { return r.Workers()[ws[0].URL()]["state"] == "paused" })
	leave()
	if err := <-left; err == nil {
		t.Fatal("the pause answered while a job ran")
	}
	if op := r.Get("/fleet_operation").JSON(t); op["operation"] != "pause_generation" || op["running"] != true {
		t.Fatalf("/fleet_operation once the caller left: %v; want the pause, running", op)
	}
	busy := r.Post("/continue_generation?wait=false", "")
	testrouter.ExpectStatus(t, "a continue that does not wait, while the pause runs", busy, 409)
	release()
	testrouter.ExpectStatus(t, "the job the pause waited for", <-job, 200)
	testrouter.WaitFor(t, func() bool { return r.Get("/fleet_operation").JSON(t)["running"] == false })
	if op := r.Get("/fleet_operation").JSON(t); op["error"] != nil || len(op["results"].([]any)) != 1 {
		t.Fatalf("/fleet_operation once the pause ended: %v", op)
	}
	if st := r.Workers()[ws[0].URL()]["state"]; st != "paused" {
		t.Fatalf("the worker after the pause its caller left: %v; want paused", st)
	}
}

// A spelling of the paths with a trailing or repeated slash or ;params is
// the path itself, answered by the router: it never reaches a worker,
// which would not know the path, nor redirects to its address.
func TestPauseAndContinueInOtherSpellings(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	for _, c := range []struct{ path, state string }{
		{"/pause_generation/", "paused"}, {"//continue_generation", "serving"},
		{"/pause_generation;x=1", "paused"}, {"/continue_generation//", "serving"},
	} {
		rp := doUnfollowed(t, "POST", r.Base+c.path, "")
		testrouter.ExpectStatus(t, "POST "+c.path, rp, 200)
		if body := rp.JSON(t); body["success"] != true || r.Workers()[ws[0].URL()]["state"] != c.state {
			t.Fatalf("POST %s: %s; the worker is %v; want it %s", c.path, rp.Body, r.Workers()[ws[0].URL()]["state"], c.state)
		}
	}
}
