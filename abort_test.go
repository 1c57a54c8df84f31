package diffusionrouter_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// A job of 20 cost units: 1 s on a fake worker of 50 ms a unit, which the
// router predicts as that with initial_speed 20.
const (
	longImage   = `{"response_format":"b64_json","prompt":"a fox","size":"1024x1024","num_inference_steps":20}`
	abortUnitMs = 50
	abortSpeed  = "initial_speed 20\n"
)

// clientGot is what one client got: a reply, or the error that ended it.
type clientGot struct {
	testrouter.Reply
	err  error
	took time.Duration
}

// postJob posts body to path on the router in the background, with
// X-Request-Id rid unless it is empty, until ctx ends.
func postJob(ctx context.Context, r *testrouter.Router, path, body, rid string) <-chan clientGot {
	out := make(chan clientGot, 1)
	go func() {
		start := time.Now()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.Base+path, strings.NewReader(body))
		if err != nil {
			out <- clientGot{err: err}
			return
		}
		if rid != "" {
			req.Header.Set(requestIDHeader, rid)
		}
		resp, err := testrouter.Client.Do(req)
		if err != nil {
			out <- clientGot{err: err, took: time.Since(start)}
			return
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		out <- clientGot{testrouter.Reply{Status: resp.StatusCode, Header: resp.Header, Body: b}, err, time.Since(start)}
	}()
	return out
}

// abortSite is a router of one pool with its metrics and the given
// options, in front of ws.
func abortSite(ws []*fakeworker.Worker, options string) string {
	return testrouter.MetricsSite("diffusion_router abort-pool {\n workers " + testrouter.URLs(ws) + "\n" + abortSpeed + options + "}")
}

func abortWorkers(t *testing.T, names ...string) []*fakeworker.Worker {
	cfgs := make([]fakeworker.Config, len(names))
	for i, n := range names {
		cfgs[i] = fakeworker.Config{Name: n, UnitMs: abortUnitMs}
	}
	return testrouter.StartWorkers(t, cfgs...)
}

// busyRouter starts a router with options in front of one fake worker
// and gives the worker a job of 1 s, with request id rid, to run: what
// that job's client gets arrives on the channel.
func busyRouter(t *testing.T, options, rid string) (*fakeworker.Worker, *testrouter.Router, <-chan clientGot) {
	t.Helper()
	ws := abortWorkers(t, "w")
	r := testrouter.Start(t, abortSite(ws, options))
	running := postJob(t.Context(), r, "/v1/images/generations", longImage, rid)
	waitRunning(t, r, ws[0])
	return ws[0], r, running
}

// waitQueued waits until n jobs wait in the router's queue.
func waitQueued(t *testing.T, r *testrouter.Router, n int) {
	t.Helper()
	testrouter.WaitFor(t, func() bool { return r.Get("/health").JSON(t)["queued_requests"] == float64(n) })
}

// waitRunning waits until every worker of ws holds a job.
func waitRunning(t *testing.T, r *testrouter.Router, ws ...*fakeworker.Worker) {
	t.Helper()
	testrouter.WaitFor(t, func() bool {
		workers := r.Workers()
		for _, w := range ws {
			if workers[w.URL()]["active_requests"] != 1.0 {
				return false
			}
		}
		return true
	})
}

// abort posts an abort with body and checks its answer's counts.
func abort(t *testing.T, r *testrouter.Router, body string, waiting, running int) {
	t.Helper()
	rp := r.Post("/abort_request", body)
	testrouter.ExpectStatus(t, "abort "+body, rp, 200)
	got := rp.JSON(t)
	counts, _ := got["aborted"].(map[string]any)
	if got["success"] != true || counts["waiting"] != float64(waiting) || counts["running"] != float64(running) {
		t.Fatalf("abort %s answered %s; want %d waiting, %d running", body, rp.Body, waiting, running)
	}
}

// expectAborted checks that a client got 409 with a JSON error naming
// the abort of its request id.
func expectAborted(t *testing.T, what string, a clientGot, rid, by string) {
	t.Helper()
	if a.err != nil {
		t.Fatalf("%s: %v", what, a.err)
	}
	testrouter.ExpectStatus(t, what, a.Reply, http.StatusConflict)
	if msg := a.ErrorText(t); !strings.Contains(msg, fmt.Sprintf("request %q was aborted by POST /abort_request %s", rid, by)) {
		t.Fatalf("%s: error %q does not name the abort", what, msg)
	}
}

func abortedTotal(t *testing.T, r *testrouter.Router, state string) float64 {
	t.Helper()
	return testrouter.Value(t, r, "caddy_diffusion_aborted_total", map[string]string{"pool": "abort-pool", "state": state})
}

// Waiting jobs aborted by id and by prefix end at once with 409 and never
// reach the worker; the running job and a job not named go on, in order.
func TestAbortWaitingJobsNeverReachAWorker(t *testing.T) {
	w, r, running := busyRouter(t, "", "step-1-a")
	ctx := t.Context()
	byID := postJob(ctx, r, "/v1/images/generations", testrouter.SmallImage, "step-1-b")
	waitQueued(t, r, 1)
	byPrefix := postJob(ctx, r, "/v1/images/generations", testrouter.SmallImage, "step-2-a")
	waitQueued(t, r, 2)
	unnamed := postJob(ctx, r, "/v1/images/generations", testrouter.SmallImage, "")
	waitQueued(t, r, 3)

	abort(t, r, `{"rid": "step-1-b"}`, 1, 0)
	expectAborted(t, "the job aborted by id", <-byID, "step-1-b", `{"rid": "step-1-b"}`)
	abort(t, r, `{"rid_prefix": "step-2-"}`, 1, 0)
	a := <-byPrefix
	expectAborted(t, "the job aborted by prefix", a, "step-2-a", `{"rid_prefix": "step-2-"}`)
	if a.took > 500*time.Millisecond {
		t.Fatalf("the aborted job was answered after %s, not at once", a.took)
	}
	waitQueued(t, r, 1)

	first, last := <-running, <-unnamed
	testrouter.ExpectStatus(t, "the running job", first.Reply, 200)
	testrouter.ExpectStatus(t, "the job no abort named", last.Reply, 200)
	if st := w.Stats(); st.Jobs != 2 {
		t.Fatalf("the worker ran %d jobs; want 2, none of the aborted ones", st.Jobs)
	}
	if got := abortedTotal(t, r, "waiting"); got != 2 {
		t.Fatalf("aborted_total{state=waiting} = %g; want 2", got)
	}
	for _, path := range []string{"/health", "/workers", "/dashboard/data"} {
		if got := r.Get(path).JSON(t)["aborted"].(map[string]any)["waiting"]; got != 2.0 {
			t.Errorf("%s aborted.waiting = %v; want 2", path, got)
		}
	}
}

// A running job aborted: its client gets 409 at once, and its worker,
// which goes on computing it, stays counted busy until the job's predicted
// end, so the next job goes to the other worker.
func TestAbortRunningJobKeepsItsWorkerBusy(t *testing.T) {
	ws := abortWorkers(t, "x", "y")
	r := testrouter.Start(t, abortSite(ws, ""))
	running := postJob(t.Context(), r, "/v1/images/generations", longImage, "step-3-a")
	busy, other := "", ""
	testrouter.WaitFor(t, func() bool {
		workers := r.Workers()
		switch {
		case workers[ws[0].URL()]["active_requests"] == 1.0:
			busy, other = "x", "y"
		case workers[ws[1].URL()]["active_requests"] == 1.0:
			busy, other = "y", "x"
		}
		return busy != ""
	})

	abort(t, r, `{"rid": "step-3-a"}`, 0, 1)
	a := <-running
	expectAborted(t, "the running job aborted", a, "step-3-a", `{"rid": "step-3-a"}`)
	if a.took > 900*time.Millisecond {
		t.Fatalf("the aborted job was answered after %s, as if it had run to its end", a.took)
	}
	for i := range 3 {
		rp := r.Post("/v1/images/generations", testrouter.SmallImage)
		testrouter.ExpectStatus(t, "a job after the abort", rp, 200)
		if got := rp.Header.Get("X-Fake-Worker"); got != other {
			t.Fatalf("job %d after the abort went to %s; want %s, %s still computes the aborted job", i, got, other, busy)
		}
	}
	testrouter.WaitFor(t, func() bool {
		return r.Workers()[ws[0].URL()]["active_requests"] == 0.0 && r.Workers()[ws[1].URL()]["active_requests"] == 0.0
	})
	if got := abortedTotal(t, r, "running"); got != 1 {
		t.Fatalf("aborted_total{state=running} = %g; want 1", got)
	}
}

// Resends of an aborted id, and later jobs of an aborted prefix, are
// refused at once without waiting, until abort_memory has passed.
func TestAbortedResendsAreRefusedAtOnce(t *testing.T) {
	w, r, running := busyRouter(t, "abort_memory 2s\n", "busy")
	abort(t, r, `{"rid": "step-4-a"}`, 0, 0) // between two of its client's tries
	abort(t, r, `{"rid_prefix": "step-5-"}`, 0, 0)
	forgotten := time.Now().Add(2*time.Second + 50*time.Millisecond) // abort_memory after the aborts

	for _, c := range []struct{ rid, by string }{{"step-4-a", `{"rid": "step-4-a"}`}, {"step-5-x", `{"rid_prefix": "step-5-"}`}} {
		start := time.Now()
		rp := r.Post("/v1/images/generations", testrouter.SmallImage, requestIDHeader, c.rid)
		expectAborted(t, "a resend of "+c.rid, clientGot{Reply: rp}, c.rid, c.by)
		if msg := rp.ErrorText(t); !strings.Contains(msg, "refused until") || time.Since(start) > 500*time.Millisecond {
			t.Fatalf("resend of %s: %q after %s; want a refusal at once that says until when", c.rid, msg, time.Since(start))
		}
	}
	if got := abortedTotal(t, r, "resent"); got != 2 {
		t.Fatalf("aborted_total{state=resent} = %g; want 2", got)
	}
	if got := abortedTotal(t, r, "waiting") + abortedTotal(t, r, "running"); got != 0 {
		t.Fatalf("refused resends counted as %g aborted jobs", got)
	}
	testrouter.ExpectStatus(t, "the job before", (<-running).Reply, 200)
	time.Sleep(time.Until(forgotten))
	testrouter.ExpectStatus(t, "a resend after abort_memory", r.Post("/v1/images/generations", testrouter.SmallImage, requestIDHeader, "step-4-a"), 200)
	if st := w.Stats(); st.Jobs != 2 {
		t.Fatalf("the worker ran %d jobs; want 2: the refused ones never reached it", st.Jobs)
	}
}

// abort_all ends every job of the pool, with or without an id, and its
// clients' resends by id are refused; new work is not.
func TestAbortAll(t *testing.T) {
	_, r, running := busyRouter(t, "", "a")
	ctx := t.Context()
	withID := postJob(ctx, r, "/rollout/generate", `{"prompt":"p","width":64,"height":64,"num_inference_steps":2,"seed":1}`, "b")
	noID := postJob(ctx, r, "/v1/images/generations", testrouter.SmallImage, "")
	waitQueued(t, r, 2)

	abort(t, r, `{"abort_all": true}`, 2, 1)
	expectAborted(t, "the running job", <-running, "a", `{"abort_all": true}`)
	expectAborted(t, "a waiting rollout", <-withID, "b", `{"abort_all": true}`)
	a := <-noID
	testrouter.ExpectStatus(t, "a waiting job without an id", a.Reply, http.StatusConflict)
	if a.Header.Get(requestIDHeader) == "" {
		t.Fatal("the aborted job's answer does not carry the id the router gave it")
	}
	testrouter.ExpectStatus(t, "a resend of b", r.Post("/v1/images/generations", testrouter.SmallImage, requestIDHeader, "b"), http.StatusConflict)
	testrouter.ExpectStatus(t, "new work", r.Post("/v1/images/generations", testrouter.SmallImage), 200)
}

// A streamed answer that began before the abort cannot become a 409: the
// client's connection is reset rather than ended as if whole.
func TestAbortResetsAStreamThatBegan(t *testing.T) {
	ws := abortWorkers(t, "w")
	r := testrouter.Start(t, abortSite(ws, ""))
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, r.Base+"/v1/images/generations/stream", strings.NewReader(longImage))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(requestIDHeader, "stream-1")
	resp, err := testrouter.Client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	rd := bufio.NewReader(resp.Body)
	for line := ""; !strings.Contains(line, `"accepted"`); {
		if line, err = rd.ReadString('\n'); err != nil {
			t.Fatalf("the stream ended before its accepted event: %v", err)
		}
	}
	abort(t, r, `{"rid": "stream-1"}`, 0, 1)
	rest, err := io.ReadAll(rd)
	if err == nil {
		t.Fatalf("the aborted stream ended cleanly after %q; want its connection reset", rest)
	}
	if strings.Contains(string(rest), "[DONE]") {
		t.Fatalf("the aborted stream ran to its end: %q", rest)
	}
}

// A client that leaves is the simplest abort: its job leaves the queue at
// once and never reaches a worker.
func TestClientThatLeavesLeavesTheQueue(t *testing.T) {
	w, r, running := busyRouter(t, "", "")
	ctx, leave := context.WithCancel(t.Context())
	left := postJob(ctx, r, "/v1/images/generations", testrouter.SmallImage, "")
	waitQueued(t, r, 1)
	leave()
	<-left
	waitQueued(t, r, 0)
	testrouter.ExpectStatus(t, "the running job", (<-running).Reply, 200)
	if st := w.Stats(); st.Jobs != 1 {
		t.Fatalf("the worker ran %d jobs; want 1: the job whose client left never reached it", st.Jobs)
	}
}

// Every malformed abort is refused with a 4xx and a JSON error that says
// what is wrong, and ends nothing; only a trusted client may abort.
func TestAbortRefusesBadBodies(t *testing.T) {
	_, r, running := busyRouter(t, "admin_allow 10.0.0.0/8\nadmin_token secret\n", "keep")
	auth := []string{"Authorization", "Bearer secret"}
	for body, want := range map[string]string{
		``:                                   "Name the jobs to abort",
		`not json`:                           "",
		`["keep"]`:                           "JSON object",
		`{"rid": "keep", "priority": 1}`:     `Unsupported field "priority"`,
		`{"rid": "keep", "abort_all": true}`: "only one of",
		`{"rid": "keep", "rid_prefix": "k"}`: "only one of",
		`{"rid": ""}`:                        "rid must not be empty",
		`{"rid_prefix": ""}`:                 "rid_prefix must not be empty",
		`{"rid": 7}`:                         "rid must be a string",
		`{"abort_all": null}`:                "abort_all must be a boolean",
		`{"abort_all": "yes"}`:               "abort_all must be a boolean",
		`{"abort_all": false}`:               "Name the jobs to abort",
		`{"rid": "keep", "RID": "keep"}`:     "only in case",
		`{"rid": "` + strings.Repeat("k", 129) + `"}`: "at most 128 printable ASCII",
		`{"rid": "k\u0007"}`:                          "at most 128 printable ASCII",
	} {
		rp := r.Post("/abort_request", body, auth...)
		testrouter.ExpectStatus(t, "abort "+body, rp, http.StatusBadRequest)
		if msg := rp.ErrorText(t); !strings.Contains(msg, want) {
			t.Errorf("abort %s: error %q; want it to say %q", body, msg, want)
		}
	}
	testrouter.ExpectStatus(t, "an abort without the token", r.Post("/abort_request", `{"abort_all": true}`), http.StatusForbidden)
	testrouter.ExpectStatus(t, "GET /abort_request", r.Get("/abort_request"), http.StatusMethodNotAllowed)
	testrouter.ExpectStatus(t, "the job no good abort named", (<-running).Reply, 200)
	rp := r.Post("/abort_request", `{"rid": "", "abort_all": true}`, auth...) // SGLang's AbortReq with its defaults
	testrouter.ExpectStatus(t, "abort_all with an empty rid", rp, 200)
}

// A job aborted while its worker's answer is coming, held back until
// whole, gets 409 and none of the answer; the answer lost is the abort's
// doing, not a failure of the worker.
func TestAbortWhileTheAnswerIsHeld(t *testing.T) {
	ws := abortWorkers(t, "w")
	target, err := url.Parse(ws[0].URL())
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(target)
	began := make(chan struct{}, 1)
	stand := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if !generations(r) {
			proxy.ServeHTTP(rw, r)
			return
		}
		rw.Header().Set("Content-Type", "application/json")
		rw.WriteHeader(http.StatusOK)
		rw.Write([]byte(`{"created": 1, "data": [{"b64_json": "iVBO`))
		http.NewResponseController(rw).Flush()
		began <- struct{}{}
		<-r.Context().Done() // the rest never comes
	}))
	t.Cleanup(stand.Close)
	r := testrouter.Start(t, testrouter.MetricsSite("diffusion_router abort-pool {\n workers "+stand.URL+"\n"+abortSpeed+"}"))

	job := postJob(t.Context(), r, "/v1/images/generations", testrouter.SmallImage, "held-1")
	<-began
	abort(t, r, `{"rid": "held-1"}`, 0, 1)
	a := <-job
	expectAborted(t, "a job whose answer was held", a, "held-1", `{"rid": "held-1"}`)
	if strings.Contains(string(a.Body), "iVBO") {
		t.Fatalf("the client got part of the answer: %s", a.Body)
	}
	if w := r.Workers()[stand.URL]; w["failures"] != 0.0 || w["consecutive_failures"] != 0.0 {
		t.Fatalf("the abort counted against the worker: %v failures", w["failures"])
	}
	if got := testrouter.Value(t, r, "caddy_diffusion_broken_answers_total", map[string]string{"pool": "abort-pool"}); got != 0 {
		t.Fatalf("the answer the abort cut off counted as %g broken answers", got)
	}
}

// A job waiting to run again, after its first worker answered 503, gets
// the abort's 409, not that worker's answer.
func TestAbortJobWaitingToRunAgain(t *testing.T) {
	w, r, running := busyRouter(t, "", "long")
	bad := abortWorkers(t, "bad")
	failing, failed := fronted(t, bad[0], http.StatusServiceUnavailable, generations)
	testrouter.ExpectStatus(t, "register the failing worker", r.Post("/workers", `{"url": "`+failing+`"}`), 200)
	testrouter.WaitFor(t, func() bool { return r.Workers()[failing]["state"] == "serving" })

	job := postJob(t.Context(), r, "/v1/images/generations", testrouter.SmallImage, "again-1")
	waitQueued(t, r, 1) // behind the long job, for the worker that did not fail it
	if failed.Load() != 1 {
		t.Fatalf("the failing worker saw %d jobs; want the one now waiting", failed.Load())
	}
	abort(t, r, `{"rid": "again-1"}`, 1, 0)
	expectAborted(t, "a job waiting to run again", <-job, "again-1", `{"rid": "again-1"}`)
	testrouter.ExpectStatus(t, "the long job", (<-running).Reply, 200)
	if st := w.Stats(); st.Jobs != 1 {
		t.Fatalf("the good worker ran %d jobs; want only the long one", st.Jobs)
	}
}

// What an abort remembers is the pool's: a reload keeps it.
func TestAbortMemorySurvivesAReload(t *testing.T) {
	ws := abortWorkers(t, "w")
	site := abortSite(ws, "")
	r := testrouter.Start(t, site)
	abort(t, r, `{"rid_prefix": "step-9-"}`, 0, 0)
	r.Load(site + "\n# reloaded")
	rp := r.Post("/v1/images/generations", testrouter.SmallImage, requestIDHeader, "step-9-1")
	expectAborted(t, "a job of the aborted step after a reload", clientGot{Reply: rp}, "step-9-1", `{"rid_prefix": "step-9-"}`)
}
