package diffusionrouter_test

import (
	"net/http"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// A trainer that moves the weights into the engines itself declares what
// they hold (docs/operations.md, "Using with miles").

// The tensors a trainer sends at step 2, and others, as a transfer gone
// wrong would leave on a worker.
var (
	step2Tensors = []fakeworker.Tensor{{Name: "blocks.0.weight", Data: []byte{1, 2, 3, 4}}, {Name: "blocks.1.weight", Data: []byte{5, 6}}}
	otherTensors = []fakeworker.Tensor{{Name: "blocks.0.weight", Data: []byte{9, 9, 9, 9}}}
)

// transfer sends tensors to w's transformer directly, as miles_diffusion's
// trainer does, not through the router.
func transfer(t *testing.T, w *fakeworker.Worker, tensors []fakeworker.Tensor) {
	t.Helper()
	body := `{"serialized_named_tensors":["` + fakeworker.TensorPayload(tensors...) + `"],"load_format":"flattened_bucket","target_modules":["transformer"],"weight_version":"step-2"}`
	testrouter.ExpectStatus(t, "a direct transfer to "+w.URL(), testrouter.Do(t, http.MethodPost, w.URL()+"/update_weights_from_tensor", strings.NewReader(body)), 200)
}

// step2Checksums is a declaration's checksums of step 2's tensors.
func step2Checksums() string {
	return `{"transformer":"` + fakeworker.Checksum(step2Tensors...) + `"}`
}

// expectSource fails t unless r shows the worker at u in state, on
// version, learned from source.
func expectSource(t *testing.T, r *testrouter.Router, u, state, version, source string) {
	t.Helper()
	w := r.Workers()[u]
	if w["state"] != state || w["weight_version"] != version || w["weight_version_source"] != source {
		t.Fatalf("%s: %v on %v (%v); want %s on %s (%s)", u, w["state"], w["weight_version"], w["weight_version_source"], state, version, source)
	}
}

// reported waits, sending jobs, until r has read every worker's model
// from its /v1/models, which it does on the first jobs: their version is
// then reported.
func reported(t *testing.T, r *testrouter.Router, ws []*fakeworker.Worker) {
	t.Helper()
	testrouter.WaitFor(t, func() bool {
		testrouter.ExpectStatus(t, "a first job", r.Post("/v1/images/generations", testrouter.SmallImage), 200)
		workers := r.Workers()
		for _, w := range ws {
			if workers[w.URL()]["weight_version_source"] != "reported" {
				return false
			}
		}
		return true
	})
}

// resultOf is the result of the worker at u in a fleet operation's answer.
func resultOf(t *testing.T, answer map[string]any, u string) map[string]any {
	t.Helper()
	results, _ := answer["results"].([]any)
	for _, r := range results {
		if r := r.(map[string]any); r["worker_url"] == u {
			return r
		}
	}
	t.Fatalf("no result of %s in %v", u, answer)
	return nil
}

// jobsAllOn sends n small jobs one after the other and fails t unless
// worker (a fake's name) serves each, on version.
func jobsAllOn(t *testing.T, r *testrouter.Router, n int, worker, version string) {
	t.Helper()
	for i := range n {
		rp := r.Post("/v1/images/generations", testrouter.SmallImage)
		testrouter.ExpectStatus(t, "a job", rp, 200)
		if by, v := rp.Header.Get("X-Fake-Worker"), rp.Header.Get("X-Weight-Version"); by != worker || v != version {
			t.Fatalf("job %d: served by %s on %q; want %s on %q", i, by, v, worker, version)
		}
	}
}

// A declaration without checksums is taken at its word: every worker
// shows the version, declared, answers carry it, and anyone may read it.
func TestDeclareWithoutChecksums(t *testing.T) {
	ws := namedWorkers(t, 2, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	reported(t, r, ws)
	before := r.Workers()[ws[0].URL()]["weight_version"].(string)

	rp := r.Post("/update_weight_version", `{"new_version":"step-2","abort_all_requests":true}`)
	testrouter.ExpectStatus(t, "the declaration", rp, 200)
	answer := rp.JSON(t)
	if answer["success"] != true || answer["weight_version"] != "step-2" {
		t.Fatalf("the declaration answered %s", rp.Body)
	}
	for _, w := range ws {
		if body := resultOf(t, answer, w.URL())["body"].(map[string]any); body["weight_version"] != "step-2" || body["source"] != "declared" {
			t.Fatalf("%s's result: %v", w.URL(), body)
		}
		expectSource(t, r, w.URL(), "serving", "step-2", "declared")
	}
	rp = r.Post("/v1/images/generations", testrouter.SmallImage)
	if testrouter.ExpectStatus(t, "a job after the declaration", rp, 200); rp.Header.Get("X-Weight-Version") != "step-2" {
		t.Fatalf("a job after the declaration is stamped %q", rp.Header.Get("X-Weight-Version"))
	}
	if v := r.Get("/get_weight_version").JSON(t); v["weight_version"] != "step-2" {
		t.Fatalf("get_weight_version: %v", v)
	}
	if op := r.Get("/fleet_operation").JSON(t); op["operation"] != "update_weight_version" || op["weight_version"] != "step-2" || op["running"] != false {
		t.Fatalf("/fleet_operation after the declaration: %v", op)
	}

	// A declaration naming a worker leaves the other on its version.
	rp = r.Post("/update_weight_version?wait=false", `{"new_version":"step-3","workers":["`+ws[0].URL()+`"]}`)
	testrouter.ExpectStatus(t, "a declaration naming a", rp, 200)
	expectSource(t, r, ws[0].URL(), "serving", "step-3", "declared")
	expectSource(t, r, ws[1].URL(), "serving", "step-2", "declared")
	if before == "step-2" || r.Get("/get_weight_version").JSON(t)["weight_version"] != "step-3" {
		t.Fatalf("the fleet's version after declaring step-3 on a: %v (reported %q)", r.Get("/get_weight_version").JSON(t), before)
	}
}

// With checksums the router asks each worker: the one whose transfer
// went as the trainer meant is verified, the one sent other tensors is
// named in a 502 with the module that differs and gets no job, stale,
// until a declaration it matches.
func TestDeclareWithChecksumsHoldsOutTheWorkerThatDiffers(t *testing.T) {
	ws := namedWorkers(t, 2, fakeworker.Config{})
	a, b := ws[0], ws[1]
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	reported(t, r, ws)
	old := r.Workers()[b.URL()]["weight_version"].(string)
	transfer(t, a, step2Tensors)
	transfer(t, b, otherTensors)

	rp := r.Post("/update_weight_version", `{"new_version":"step-2","checksums":`+step2Checksums()+`}`)
	testrouter.ExpectStatus(t, "a declaration one worker does not match", rp, 502)
	answer := rp.JSON(t)
	if answer["success"] != false || answer["weight_version"] != "step-2" {
		t.Fatalf("the declaration answered %s", rp.Body)
	}
	if res := resultOf(t, answer, a.URL()); res["status_code"] != 200.0 || res["body"].(map[string]any)["source"] != "verified" {
		t.Fatalf("a's result: %v", res)
	}
	res := resultOf(t, answer, b.URL())
	if msg, _ := res["body"].(map[string]any)["error"].(string); res["status_code"] != 409.0 || !strings.Contains(msg, "module transformer differs") || !strings.Contains(msg, fakeworker.Checksum(otherTensors...)) {
		t.Fatalf("b's result: %v", res)
	}
	expectSource(t, r, a.URL(), "serving", "step-2", "verified")
	expectSource(t, r, b.URL(), "stale", old, "unknown")
	jobsAllOn(t, r, 6, "a", "step-2")

	// A declaration naming b that it does not match either keeps it out;
	// one it matches brings it back.
	testrouter.ExpectStatus(t, "b declared again, unchanged", r.Post("/update_weight_version", `{"new_version":"step-2","workers":["`+b.URL()+`"],"checksums":`+step2Checksums()+`}`), 502)
	expectSource(t, r, b.URL(), "stale", old, "unknown")
	transfer(t, b, step2Tensors)
	testrouter.ExpectStatus(t, "b declared once it holds step 2", r.Post("/update_weight_version", `{"new_version":"step-2","workers":["`+b.URL()+`"],"checksums":`+step2Checksums()+`}`), 200)
	expectSource(t, r, b.URL(), "serving", "step-2", "verified")
	testrouter.ExpectStatus(t, "a paused", r.Post("/pause_generation", pauseOf(a)), 200)
	jobOn(t, r, "b", "a job while a is paused, b verified")
}

// Pause, direct transfer, continue with the version and checksums: the
// trainer's whole step is two calls. The worker sent other tensors stays
// out, named in the 502; the other serves the new weights at once.
func TestPauseTransferContinueWithVersion(t *testing.T) {
	ws := namedWorkers(t, 2, fakeworker.Config{})
	a, b := ws[0], ws[1]
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	testrouter.ExpectStatus(t, "the pause", r.Post("/pause_generation", ``), 200)
	transfer(t, a, step2Tensors)
	transfer(t, b, otherTensors)

	rp := r.Post("/continue_generation", `{"new_version":"step-2","checksums":`+step2Checksums()+`}`)
	testrouter.ExpectStatus(t, "the continue with a version b does not match", rp, 502)
	if msg, _ := resultOf(t, rp.JSON(t), b.URL())["body"].(map[string]any)["error"].(string); !strings.Contains(msg, "module transformer differs") {
		t.Fatalf("the continue answered %s; want b named with the module that differs", rp.Body)
	}
	for _, w := range ws {
		if !pausedSince(t, r, w.URL()).IsZero() {
			t.Fatalf("%s is still paused after the continue", w.URL())
		}
	}
	expectSource(t, r, a.URL(), "serving", "step-2", "verified")
	if st := r.Workers()[b.URL()]["state"]; st != "stale" {
		t.Fatalf("b after the continue: %v; want stale", st)
	}
	jobsAllOn(t, r, 6, "a", "step-2")
	if op := r.Get("/fleet_operation").JSON(t); op["operation"] != "continue_generation" || op["weight_version"] != "step-2" {
		t.Fatalf("/fleet_operation after the continue: %v", op)
	}
}

// Bad declarations get a clear 4xx JSON error and change nothing: the
// version, every worker's version and source, and the pause stay.
func TestBadDeclarationsThroughTheRouter(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	reported(t, r, ws)
	testrouter.ExpectStatus(t, "the pause", r.Post("/pause_generation", ``), 200)
	before := r.Workers()[ws[0].URL()]
	for _, c := range []struct {
		path, body string
		status     int
		says       string
	}{
		{"/update_weight_version", `{"new_version":""}`, 400, "non-empty string"},
		{"/update_weight_version", `{"new_version":"` + strings.Repeat("v", 513) + `"}`, 400, "at most 512"},
		{"/update_weight_version", `{"new_version":"step\t2"}`, 400, "printable ASCII"},
		{"/update_weight_version", `{"new_version":"v2","checksums":{"transformer":"abc"}}`, 400, "64 hex digits"},
		{"/update_weight_version", `{"new_version":"v2","workers":["http://127.0.0.1:9"]}`, 404, "not a worker of the pool"},
		{"/update_weight_version", `{"new_version":"v2","flush_cache":true}`, 400, `unknown field "flush_cache"`},
		{"/continue_generation", `{"new_version":"v2","checksums":{"transformer":"` + strings.Repeat("g", 64) + `"}}`, 400, "64 hex digits"},
		{"/continue_generation", `{"new_version":"v2","abort_all_requests":true}`, 400, `unknown field "abort_all_requests"`},
	} {
		rp := r.Post(c.path, c.body)
		testrouter.ExpectStatus(t, c.path+" "+c.body, rp, c.status)
		if msg := rp.ErrorText(t); !strings.Contains(msg, c.says) {
			t.Errorf("%s %s: %q; want it to say %q", c.path, c.body, msg, c.says)
		}
	}
	after := r.Workers()[ws[0].URL()]
	for _, f := range []string{"weight_version", "weight_version_source", "paused_since", "state"} {
		if after[f] != before[f] {
			t.Errorf("refused declarations changed the worker's %s from %v to %v", f, before[f], after[f])
		}
	}
	if v := r.Get("/get_weight_version").JSON(t)["weight_version"]; v != before["weight_version"] {
		t.Errorf("refused declarations changed the fleet's version to %v", v)
	}
}

// After a declaration with checksums, a worker that restarts behind the
// router's back is asked for its checksums before its first job: back on
// its checkpoint, it serves nothing, shows unknown in /workers and in the
// metrics, and is never replayed an earlier update, until a declaration
// names it. A worker that joins holding the declared weights serves them
// once checked, verified.
func TestAWorkerChangedBehindADeclarationServesNothingUntilVouchedFor(t *testing.T) {
	ws := namedWorkers(t, 3, fakeworker.Config{})
	a, c := ws[0], ws[2]
	r := testrouter.Start(t, testrouter.MetricsSite("diffusion_router {\n workers "+testrouter.URLs(ws[:2])+"\n health_interval 50ms\n health_fails 1\n}"))
	testrouter.ExpectStatus(t, "an update from disk", r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/1","weight_version":"step-1"}`), 200)
	for _, w := range ws {
		transfer(t, w, step2Tensors)
	}
	testrouter.ExpectStatus(t, "the declaration", r.Post("/update_weight_version", `{"new_version":"step-2","checksums":`+step2Checksums()+`}`), 200)

	// b restarts, as an engine does, slower than a probe comes.
	ws[1].Crash()
	testrouter.WaitFor(t, func() bool { return r.Workers()[ws[1].URL()]["weight_version_source"] == "unknown" })
	b, err := testrouter.Member{Name: "b", Worker: ws[1]}.Restart()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	testrouter.WaitFor(t, func() bool {
		w := r.Workers()[b.URL()]
		return w["weight_version_source"] == "unknown" && w["state"] == "stale" && b.Stats().ChecksumCalls > 0
	})
	jobsAllOn(t, r, 6, "a", "step-2")
	if got := b.Weights(); got != b.Config().ModelPath {
		t.Fatalf("the restarted worker holds %q: an update was replayed onto it", got)
	}
	if n := testrouter.Value(t, r, "caddy_diffusion_workers_by_version_source", map[string]string{"source": "unknown"}); n != 1 {
		t.Errorf("workers by version source unknown: %v; want 1", n)
	}

	testrouter.ExpectStatus(t, "c joins holding step 2", r.Post("/add_worker?url="+c.URL(), ""), 200)
	testrouter.WaitFor(t, func() bool {
		w := r.Workers()[c.URL()]
		return w["weight_version_source"] == "verified" && w["state"] == "serving"
	})
	expectSource(t, r, c.URL(), "serving", "step-2", "verified")

	transfer(t, b.Worker, step2Tensors)
	testrouter.ExpectStatus(t, "b declared", r.Post("/update_weight_version", `{"new_version":"step-2","workers":["`+b.URL()+`"],"checksums":`+step2Checksums()+`}`), 200)
	testrouter.WaitFor(t, func() bool { return r.Workers()[b.URL()]["state"] == "serving" }) // its probes passing again
	expectSource(t, r, b.URL(), "serving", "step-2", "verified")
	expectSource(t, r, a.URL(), "serving", "step-2", "verified")
}
