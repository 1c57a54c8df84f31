package diffusionrouter_test

import (
	"cmp"
	"encoding/json"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// warmRouter starts n workers and a router that takes a job for hung
// after health_timeout 1s, one job per worker at a time, and sends jobs
// until every worker has learned its speed. It returns the workers
// fastest first, as the router learned them: the first job of a batch
// on the idle fleet goes to the first. The order is the router's, not
// the test's: on a loaded machine one slow warm-up job can teach it that
// a worker is slower than the rest, and then a batch of small jobs all
// finish sooner elsewhere, never reaching that worker.
func warmRouter(t *testing.T, n int) ([]*fakeworker.Worker, *testrouter.Router) {
	t.Helper()
	ws := namedWorkers(t, n, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n health_timeout 1s\n max_inflight 1\n}")
	for range 3 * n {
		testrouter.ExpectStatus(t, "warm-up", r.Post("/v1/images/generations", testrouter.SmallImage), 200)
	}
	states := r.Workers()
	speed := func(w *fakeworker.Worker) float64 { return states[w.URL()]["speed"].(float64) }
	slices.SortStableFunc(ws, func(x, y *fakeworker.Worker) int { return cmp.Compare(speed(y), speed(x)) })
	return ws, r
}

// A weight update never waits on one sick worker: a job hung on a worker
// whose /health still answers holds the drain only until it is taken for
// stalled (stall_factor times its prediction, at least health_timeout);
// that worker is left out, stale, and the batch beside the update loses
// nothing, the hung job running again as a hedge.
func TestDrainLeavesOutAWorkerWithAHungJob(t *testing.T) {
	const hangBound = time.Second // health_timeout; the jobs take tens of milliseconds
	ws, r := warmRouter(t, 3)
	start := time.Now()
	testrouter.ExpectStatus(t, "an update on a healthy fleet", r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/1"}`), 200)
	normal := time.Since(start)

	batchDone := batchBesideAHungWorker(t, r, ws[0], 12)

	start = time.Now()
	rp := r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/2"}`)
	took := time.Since(start)
	testrouter.ExpectStatus(t, "the update beside a hung job", rp, 502) // one worker is stale
	if limit := hangBound + 2*time.Second + normal; took > limit {
		t.Fatalf("the update took %s; at most %s (the hang bound plus 2 s of the normal %s)", took, limit, normal)
	}
	for _, res := range rp.JSON(t)["results"].([]any) {
		res := res.(map[string]any)
		body, _ := json.Marshal(res["body"])
		leftOut := strings.Contains(string(body), "left out")
		if (res["worker_url"] == ws[0].URL()) != leftOut {
			t.Fatalf("result %v: only the hung worker is left out", res)
		}
	}
	states := r.Workers()
	if st := states[ws[0].URL()]; st["state"] != "stale" {
		t.Fatalf("the hung worker shows %v", st)
	}
	for _, w := range ws[1:] {
		if st := states[w.URL()]; st["state"] != "serving" || st["weight_version"] != "/ckpt/2" {
			t.Fatalf("worker %s shows %v", w.URL(), st)
		}
	}
	batchDone("the update")
}

// batchBesideAHungWorker makes hung hang every job from now on,
// sends n small image jobs at once and returns when hung holds one of
// them. The function returned waits for the batch and fails t unless
// every job was answered 200, none by hung: beside what, a job that hung
// runs again elsewhere.
func batchBesideAHungWorker(t *testing.T, r *testrouter.Router, hung *fakeworker.Worker, n int) (done func(what string)) {
	t.Helper()
	hung.Hang()
	var wg sync.WaitGroup
	replies := make([]testrouter.Reply, n)
	for i := range replies {
		wg.Go(func() { replies[i] = r.Post("/v1/images/generations", testrouter.SmallImage) })
	}
	testrouter.WaitFor(t, func() bool { return r.Workers()[hung.URL()]["active_requests"].(float64) >= 1 })
	return func(what string) {
		t.Helper()
		wg.Wait()
		for i, rp := range replies {
			testrouter.ExpectStatus(t, "a job of the batch beside "+what, rp, 200)
			if rp.Header.Get("X-Fake-Worker") == hung.Name() {
				t.Fatalf("job %d beside %s was answered by the hung worker", i, what)
			}
		}
	}
}

// An aborted job is not a hung one. sglang-diffusion computes a job to its
// end whatever its client does, so the worker of a job aborted while it
// ran counts as busy until the job's predicted end, at the speed the pool
// has learned by then; an update waits for that and answers 200 with both
// workers on the new weights. It answered 502, leaving that worker out as
// hung and showing it updating afterwards: the job's end was priced at
// initial_speed (50 s for 50 steps), the stall check at the speed learned
// from the other worker's first answer.
func TestUpdateWaitsForAnAbortedJob(t *testing.T) {
	const fiftySteps = `{"response_format":"b64_json","prompt":"a fox","size":"1024x1024","num_inference_steps":50}`
	const fourSteps = `{"response_format":"b64_json","prompt":"a fox","size":"1024x1024","num_inference_steps":4}`
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "x", UnitMs: 10}, fakeworker.Config{Name: "y", UnitMs: 10}) // 0.5 s for 50 steps
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n health_timeout 1s\n max_inflight 1\n}")
	aborted := postJob(t.Context(), r, "/v1/images/generations", fiftySteps, "step-1-a")
	testrouter.WaitFor(t, func() bool {
		workers := r.Workers()
		return workers[ws[0].URL()]["active_requests"] == 1.0 || workers[ws[1].URL()]["active_requests"] == 1.0
	})
	abort(t, r, `{"rid": "step-1-a"}`, 0, 1)
	expectAborted(t, "the running job aborted", <-aborted, "step-1-a", `{"rid": "step-1-a"}`)
	testrouter.ExpectStatus(t, "a job on the other worker", r.Post("/v1/images/generations", fourSteps), 200) // the pool learns a speed

	start := time.Now()
	rp := r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/2","weight_version":"step-2"}`)
	testrouter.ExpectStatus(t, "an update beside an aborted job", rp, 200)
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("the update took %s, as if the aborted job ran at initial_speed", took)
	}
	for _, w := range ws {
		if st := r.Workers()[w.URL()]; st["state"] != "serving" || st["weight_version"] != "step-2" {
			t.Fatalf("worker %s after the update: %v", w.URL(), st)
		}
	}
}
