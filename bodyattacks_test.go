package diffusionrouter_test

import (
	"net/url"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// These tests send bodies that would read one way to the router and another
// to a Python worker (a key twice, or twice in different case), and model
// paths that share a string prefix but not a path prefix with
// weights_path_prefix, through the router in this process: each gets a 400
// or 403 naming the key or the prefix, and nothing changes.

// refusal is a body the router must refuse, with a message that says why.
type refusal struct {
	body   string
	status int
	want   string // in the error message
}

func expectRefusals(t *testing.T, r *testrouter.Router, method, path string, cases []refusal) {
	t.Helper()
	for _, tc := range cases {
		rp := testrouter.Do(t, method, r.Base+path, strings.NewReader(tc.body))
		testrouter.ExpectStatus(t, path+" "+tc.body, rp, tc.status)
		if msg := rp.ErrorText(t); !strings.Contains(msg, tc.want) {
			t.Errorf("%s %s: error %q; want it to say %s", path, tc.body, msg, tc.want)
		}
	}
}

func TestWeightUpdateKeyAndPrefixTricksChangeNothing(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n weights_path_prefix /ckpt s3://bucket/\n}")
	version := func() any { return r.Get("/health").JSON(t)["weight_version"] }
	before := version()

	expectRefusals(t, r, "POST", "/update_weights_from_disk", []refusal{
		{`{"model_path":"../../../../root/.ssh","Model_Path":"/ckpt/ok"}`, 400, `JSON key "Model_Path" differs from "model_path" only in case`},
		{`{"Model_Path":"/ckpt/ok","model_path":"../../../../root/.ssh"}`, 400, `JSON key "model_path" differs from "Model_Path" only in case`},
		{`{"model_path":"/ckpt/ok","model_path":"../../../../root/.ssh"}`, 400, `JSON key "model_path" appears twice`},
		{`{"model_path":"/ckpt/ok","weight_version":"v1","weight_verſion":"v2"}`, 400, `JSON key "weight_verſion" differs from "weight_version"`},
		{`{"model_path":"/ckpt/ok","target_modules":{"unet":1,"UNet":2}}`, 400, `JSON key "target_modules.UNet"`},
		{`{"Model_Path":"/ckpt/ok"}`, 400, "model_path is required"}, // a worker would not read it either
		{`{"model_path":"/ckpt-evil/x"}`, 403, "outside weights_path_prefix"},
		{`{"model_path":"/ckptx"}`, 403, "outside weights_path_prefix"},
		{`{"model_path":"s3://bucket-evil/x"}`, 403, "outside weights_path_prefix"},
	})
	if v := version(); v != before {
		t.Fatalf("refused updates moved the pool's weight_version from %v to %v", before, v)
	}
	if v := ws[0].Weights(); v != oldVersion {
		t.Fatalf("a refused update reached the worker: it is on %q", v)
	}

	testrouter.ExpectStatus(t, "update under the prefix", r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/ok"}`), 200)
	if v := ws[0].Weights(); v != "/ckpt/ok" || version() != "/ckpt/ok" {
		t.Fatalf("after a good update the worker is on %q, the pool on %v", v, version())
	}
}

func TestGenerationKeyTricksReachNoWorker(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "w"})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	cases := []refusal{
		{`{"prompt":"x","size":"64x64","num_inference_steps":50,"Num_Inference_Steps":1}`, 400, `JSON key "Num_Inference_Steps" differs from "num_inference_steps"`},
		{`{"prompt":"x","size":"64x64","num_inference_steps":1,"num_inference_steps":50}`, 400, `JSON key "num_inference_steps" appears twice`},
		{`{"prompt":"x","size":"64x64","ſize":"4096x4096"}`, 400, `JSON key "ſize" differs from "size"`},
		{`{"prompt":"x","extra_body":{"num_inference_steps":1,"NUM_INFERENCE_STEPS":50}}`, 400, `JSON key "extra_body.NUM_INFERENCE_STEPS"`},
	}
	for _, path := range []string{"/v1/images/generations", "/v1/diffusion/generate", "/rollout/generate"} {
		expectRefusals(t, r, "POST", path, cases)
	}

	twice, ctype := testkit.MultipartForm([]byte("\x89PNG"), "prompt", "x", "num_inference_steps", "1", "num_inference_steps", "50")
	rp := r.Post("/v1/images/edits", twice, "Content-Type", ctype)
	testrouter.ExpectStatus(t, "form with a field twice", rp, 400)
	if msg := rp.ErrorText(t); !strings.Contains(msg, "num_inference_steps") {
		t.Fatalf("form with a field twice: %q names no field", msg)
	}
	// Go reads the name as num\_inference_steps, an RFC 7230 parser as
	// num_inference_steps: refused rather than guessed at.
	escaped := "--b\r\nContent-Disposition: form-data; name=\"num\\_inference_steps\"\r\n\r\n1\r\n--b--\r\n"
	rp = r.Post("/v1/images/edits", escaped, "Content-Type", "multipart/form-data; boundary=b")
	testrouter.ExpectStatus(t, "form with an escaped field name", rp, 400)
	if msg := rp.ErrorText(t); !strings.Contains(msg, "not named plainly") {
		t.Fatalf("form with an escaped name: %q", msg)
	}

	if s := ws[0].Stats(); s.Jobs+s.Failed != 0 {
		t.Fatalf("refused requests reached the worker: %+v", s)
	}
	if q := r.Get("/health").JSON(t)["queued_requests"]; q != 0.0 {
		t.Fatalf("%v requests left queued", q)
	}
	testrouter.ExpectStatus(t, "a plain request after the refused ones", r.Post("/v1/images/generations", testrouter.SmallImage), 200)
}

func TestControlKeyTricksChangeNothing(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a"}, fakeworker.Config{Name: "b"})
	r := testrouter.Start(t, "diffusion_router {\n workers "+ws[0].URL()+"\n}")
	a, b := ws[0].URL(), ws[1].URL()

	expectRefusals(t, r, "POST", "/workers", []refusal{
		{`{"url":"` + b + `","URL":"http://10.9.9.9:1"}`, 400, `JSON key "URL" differs from "url"`},
		{`{"worker_url":"` + b + `","worker_url":"http://10.9.9.9:1"}`, 400, `JSON key "worker_url" appears twice`},
		{`{"URL":"` + b + `"}`, 400, "worker_url is required"}, // read by exact key, as the Python router does
		{`{"url":5}`, 400, "url must be a string"},
	})
	if urls := r.Get("/list_workers").JSON(t)["urls"].([]any); len(urls) != 1 {
		t.Fatalf("refused registrations changed the pool: %v", urls)
	}

	expectRefusals(t, r, "PUT", "/workers/"+url.QueryEscape(a), []refusal{
		{`{"is_dead":false,"Is_Dead":true}`, 400, `JSON key "Is_Dead" differs from "is_dead"`},
		{`{"is_dead":true,"is_dead":false}`, 400, `JSON key "is_dead" appears twice`},
	})
	expectRefusals(t, r, "POST", "/release_memory_occupation", []refusal{
		{`{"tags":["weights"],"Tags":[]}`, 400, `JSON key "Tags" differs from "tags"`},
	})
	expectRefusals(t, r, "POST", "/resume_memory_occupation", []refusal{
		{`{"tags":["weights"],"tags":[]}`, 400, `JSON key "tags" appears twice`},
	})
	if st := r.Workers()[a]["state"]; st != "serving" {
		t.Fatalf("refused control calls left the worker %v", st)
	}
	testrouter.ExpectStatus(t, "a generation after the refused calls", r.Post("/v1/images/generations", testrouter.SmallImage), 200)
}
