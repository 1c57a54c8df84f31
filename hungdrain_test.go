package diffusionrouter_test

import (
	"encoding/json"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/examples/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// A weight update never waits on one sick worker: a job hung on a worker
// whose /health still answers holds the drain only until it is taken for
// stalled (stall_factor times its prediction, at least health_timeout);
// that worker is left out, stale, and the batch beside the update loses
// nothing, the hung job running again as a hedge.
func TestDrainLeavesOutAWorkerWithAHungJob(t *testing.T) {
	const hangBound = time.Second // health_timeout; the jobs take tens of milliseconds
	ws := namedWorkers(t, 3, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n health_timeout 1s\n max_inflight 1\n}")
	for range 9 { // every worker learns its speed
		testrouter.ExpectStatus(t, "warm-up", r.Post("/v1/images/generations", smallImage), 200)
	}
	start := time.Now()
	testrouter.ExpectStatus(t, "an update on a healthy fleet", r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/1"}`), 200)
	normal := time.Since(start)

	ws[0].Hang()
	var wg sync.WaitGroup
	replies := make([]testrouter.Reply, 12)
	for i := range replies {
		wg.Go(func() { replies[i] = r.Post("/v1/images/generations", smallImage) })
	}
	testrouter.WaitFor(t, func() bool { return r.Workers()[ws[0].URL()]["active_requests"].(float64) >= 1 })

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
	wg.Wait()
	for i, rp := range replies {
		testrouter.ExpectStatus(t, "a job of the batch beside the update", rp, 200)
		if rp.Header.Get("X-Fake-Worker") == "a" {
			t.Fatalf("job %d was answered by the hung worker", i)
		}
	}
}
