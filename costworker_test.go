package diffusionrouter_test

import (
	"math"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// The router's cost of a job is the work its worker runs: a rollout that
// hides its steps in extra_sampling_params is costed at the steps the
// worker runs, n at the count the worker clamps it to, a size the worker
// ignores at the size it makes instead. caddy_diffusion_worker_cost_total
// (what the router counted) grows as the fake worker's own count of the
// work it ran, which follows sglang-diffusion's reading.
func TestRouterCostsWhatTheWorkerRuns(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "w", UnitMs: 1})
	r := testrouter.Start(t, testrouter.MetricsSite("diffusion_router cost-pool {\n workers "+testrouter.URLs(ws)+"\n}"))
	worker := map[string]string{"pool": "cost-pool", "worker": ws[0].URL()}
	const image = `"prompt":"p","response_format":"b64_json",`
	for _, tc := range []struct {
		path, body string
		cost       float64 // of the job the worker runs
	}{
		{"/rollout/generate", `{"prompt":"p","seed":1,"width":512,"height":512,"num_inference_steps":1,"extra_sampling_params":{"num_inference_steps":8}}`, 2},
		{"/rollout/generate", `{"prompt":"p","seed":1,"width":512,"height":512,"num_inference_steps":1,"extra_sampling_params":{"num_inference_steps":null}}`, 5},
		{"/v1/images/generations", `{` + image + `"size":"256x256","num_inference_steps":4,"n":1000}`, 2.5},
		{"/v1/images/generations", `{` + image + `"size":"256x256","num_inference_steps":4,"n":0}`, 0.25},
		{"/v1/images/generations", `{` + image + `"size":"abc","num_inference_steps":1}`, 1},
		{"/v1/images/generations", `{` + image + `"size":"1536*1536","num_inference_steps":1}`, 1},
	} {
		routerBefore, workerBefore := testrouter.Value(t, r, "caddy_diffusion_worker_cost_total", worker), ws[0].Stats().Cost
		testrouter.ExpectStatus(t, tc.body, r.Post(tc.path, tc.body), 200)
		var counted, ran float64
		testrouter.WaitFor(t, func() bool {
			counted = testrouter.Value(t, r, "caddy_diffusion_worker_cost_total", worker) - routerBefore
			ran = ws[0].Stats().Cost - workerBefore
			return counted > 0 && ran > 0
		})
		if math.Abs(counted-tc.cost) > 1e-9 || math.Abs(ran-tc.cost) > 1e-9 {
			t.Errorf("%s %s: the router counted %v cost units, the worker ran %v; want %v", tc.path, tc.body, counted, ran, tc.cost)
		}
	}
}

// A value the worker refuses gets 400 and a JSON error naming the field,
// from the router, before any worker is asked; one the worker clamps or
// ignores goes through. The fake worker answers each as sglang-diffusion
// does (4xx or 500 for the first, 200 for the second).
func TestRouterRefusesWhatTheWorkerRefuses(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "w", UnitMs: 1})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	const image = `"prompt":"p","response_format":"b64_json","size":"64x64",`
	for _, tc := range []struct{ path, body, field string }{
		{"/v1/images/generations", `{` + image + `"num_inference_steps":0}`, "num_inference_steps"},
		{"/v1/images/generations", `{"prompt":"p","size":"0x512"}`, "size"},
		{"/v1/images/generations", `{` + image + `"n":2.5}`, "n"},
		{"/rollout/generate", `{"prompt":"p","seed":1,"extra_sampling_params":{"num_inference_steps":"150"}}`, "extra_sampling_params.num_inference_steps"},
		{"/rollout/generate", `{"prompt":"p","seed":1,"extra_sampling_params":{"num_inference_steps":150.0}}`, "extra_sampling_params.num_inference_steps"},
	} {
		rp := r.Post(tc.path, tc.body)
		testrouter.ExpectStatus(t, tc.body, rp, 400)
		if msg := rp.ErrorText(t); !strings.HasPrefix(msg, tc.field+":") {
			t.Errorf("%s: error %q; want one naming %s", tc.body, msg, tc.field)
		}
		if direct := testrouter.Do(t, "POST", ws[0].URL()+tc.path, strings.NewReader(tc.body)); direct.Status < 400 {
			t.Errorf("%s: the worker itself answers %d; the router refused what it runs", tc.body, direct.Status)
		}
	}
	if jobs := ws[0].Stats().Jobs; jobs != 0 {
		t.Fatalf("%d refused jobs reached the worker", jobs)
	}
	for _, body := range []string{`{` + image + `"n":-3}`, `{"prompt":"p","response_format":"b64_json","size":"64 by 64","num_inference_steps":1}`} {
		testrouter.ExpectStatus(t, body, r.Post("/v1/images/generations", body), 200)
	}
}
