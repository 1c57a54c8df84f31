package diffusionrouter_test

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/msgpack"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// TestMilesExampleAdapts keeps examples/miles/Caddyfile a config Caddy
// takes: it adapts and provisions.
func TestMilesExampleAdapts(t *testing.T) {
	cf, err := os.ReadFile("examples/miles/Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	raw, _, err := caddyconfig.GetAdapter("caddyfile").Adapt(cf, map[string]any{"filename": "examples/miles/Caddyfile"})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"trusted_proxies":{"ranges":["192.168.0.0/16"`, `"trusted_proxies_strict":1`, `"admin":{"allow":["private_ranges"]}`, `"forward_paths":["sglang"]`, `"body_timeout":300000000000`, `"max_body_total":1073741824`} {
		if !strings.Contains(string(raw), want) {
			t.Errorf("adapted example lacks %s:\n%s", want, raw)
		}
	}
	if err := caddy.Validate(mustConfig(t, raw)); err != nil {
		t.Fatalf("the example does not provision: %v", err)
	}
}

func TestTensorUpdateIsRefused(t *testing.T) {
	r := testrouter.Start(t, "diffusion_router\n")
	rp := r.Post("/update_weights_from_tensor", `{"serialized_named_tensors":["x"]}`)
	testrouter.ExpectStatus(t, "update_weights_from_tensor through the router", rp, 400)
	if !strings.Contains(rp.ErrorText(t), "each engine") {
		t.Fatalf("error %q does not say where to send it", rp.ErrorText(t))
	}
}

// milesRollout is the body miles_diffusion's generate_microgroup posts to
// {router}/rollout/generate: build_rollout_sampling_params with miles'
// defaults (no guidance or true CFG scale: null; no --diffusion-width or
// --diffusion-height when side is 0, else both side), then the seed, the
// step strategy's indices, the prompt and the microgroup size, as httpx
// writes it.
func milesRollout(prompt string, seed, outputs, side int) string {
	size := "null"
	if side > 0 {
		size = fmt.Sprint(side)
	}
	return fmt.Sprintf(`{"generator_device":"cuda","negative_prompt":" ","width":%s,"height":%s,`+
		`"num_inference_steps":1,"guidance_scale":null,"true_cfg_scale":null,"rollout":true,"rollout_sde_type":"sde",`+
		`"rollout_noise_level":0.7,"rollout_log_prob_no_const":false,"rollout_debug_mode":false,`+
		`"rollout_return_denoising_env":true,"rollout_return_dit_trajectory":true,"seed":%d,`+
		`"rollout_sde_step_indices":[0],"rollout_return_step_indices":[0],"prompt":%q,"num_outputs_per_prompt":%d}`,
		size, size, seed, prompt, outputs)
}

// rolloutStep sends n rollouts of a microgroup of outputs each at once, as
// miles' rollout semaphore lets them go, and checks each answer as miles
// reads it: a msgpack list (by its Content-Type) with one sample per
// output, its seed and prompt. The images are 256x256, as a run with
// --diffusion-width 256 --diffusion-height 256 asks: at the model's
// default of 1024x1024 each sample carries 2 MB of trajectory latents,
// which under the race detector keeps the fake busy most of a second per
// rollout, and twelve of them at once outgrow the client's timeout.
// It returns the weight versions the answers name.
func rolloutStep(t *testing.T, r *testrouter.Router, step, n, outputs int) []string {
	t.Helper()
	versions := make([]string, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			prompt, seed := fmt.Sprintf("step %d prompt %d", step, i), 1000*step+outputs*i
			rp := r.Post("/rollout/generate", milesRollout(prompt, seed, outputs, 256), "Content-Type", "application/json")
			decoded, err := msgpack.Unmarshal(rp.Body)
			samples, _ := decoded.([]any)
			if rp.Status != 200 || rp.Header.Get("Content-Type") != "application/msgpack" || err != nil || len(samples) != outputs {
				t.Errorf("rollout %d of step %d: %d %.300q (%v)", i, step, rp.Status, rp.Body, err)
				return
			}
			for _, sample := range samples {
				s, _ := sample.(map[string]any)
				out, _ := s["generated_output"].(map[string]any)
				if s["seed"] != int64(seed) || s["prompt"] != prompt || out["__tensor__"] != true || s["rollout_log_probs"] == nil {
					t.Errorf("rollout %d of step %d: sample %.300v", i, step, s)
				}
			}
			versions[i] = rp.Header.Get(weightVersionHeader)
		})
	}
	wg.Wait()
	return versions
}

// jobsOn counts the jobs the engines completed on the given weights.
func jobsOn(engines []*fakeworker.Worker, weights string) int {
	n := 0
	for _, e := range engines {
		n += e.Stats().JobsOn[weights]
	}
	return n
}

// TestMilesDiffusionRun replays what a miles_diffusion run sends the
// router, in order, from the cluster's nodes: the engines register
// themselves (sglang_diffusion_engine.py: POST /add_worker?url=http://host:port,
// the URL not escaped, no token, no body), rollouts as
// sglang_diffusion_rollout.py builds them, a LoRA update through the router,
// a sleep during which an engine joins and the weights are updated, the
// wake, and the engines leaving (POST /remove_worker?url=...). The router
// sits behind a proxy on the cluster network: Caddy's trusted_proxies
// private_ranges gives admin_allow private_ranges the engine's own address
// from X-Forwarded-For.
func TestMilesDiffusionRun(t *testing.T) {
	engines := namedWorkers(t, 3, fakeworker.Config{UnitMs: 2})
	r := testrouter.StartWith(t, "servers {\n trusted_proxies static private_ranges\n trusted_proxies_strict\n}",
		"diffusion_router {\n admin_allow private_ranges\n forward_paths sglang\n weights_path_prefix /ckpt\n}")
	fromCluster := []string{"X-Forwarded-For", "10.0.3.7"}
	fromPublic := []string{"X-Forwarded-For", "10.0.3.7, 203.0.113.9"} // a cluster address forged before its own
	listed := func() []any { return r.Get("/list_workers").JSON(t)["urls"].([]any) }

	// Start-up: two engines register from their nodes; any non-2xx would
	// be fatal to the run.
	for _, e := range engines[:2] {
		testrouter.ExpectStatus(t, "an engine registers from the cluster", r.Post("/add_worker?url="+e.URL(), "", fromCluster...), 200)
	}
	for _, path := range []string{"/add_worker?url=" + engines[2].URL(), "/remove_worker?url=" + engines[0].URL()} {
		rp := r.Post(path, "", fromPublic...)
		testrouter.ExpectStatus(t, path+" from a public address", rp, 403)
		if !strings.Contains(rp.ErrorText(t), "admin_allow") {
			t.Fatalf("403 answer %s", rp.Body)
		}
	}
	if urls := listed(); len(urls) != 2 || urls[0] != engines[0].URL() || urls[1] != engines[1].URL() {
		t.Fatalf("after registration the router lists %v", urls)
	}

	// A rollout step on the base weights, answered by both engines.
	for _, v := range rolloutStep(t, r, 1, 4, 2) {
		if v != oldVersion {
			t.Fatalf("step 1 served by %q; want %q", v, oldVersion)
		}
	}
	if engines[0].Stats().Jobs == 0 || engines[1].Stats().Jobs == 0 {
		t.Fatalf("one engine did all of step 1: %d and %d jobs", engines[0].Stats().Jobs, engines[1].Stats().Jobs)
	}

	// The LoRA of step 1 reaches every engine before any later rollout.
	rp := r.Post("/v1/set_lora", `{"lora_nickname":"step-1","lora_path":"/ckpt/lora-1"}`, fromCluster...)
	testrouter.ExpectStatus(t, "set_lora", rp, 200)
	reached := map[string]bool{}
	for _, res := range rp.JSON(t)["results"].([]any) {
		res := res.(map[string]any)
		reached[res["worker_url"].(string)] = res["status_code"] == 200.0 && res["body"].(map[string]any)["status"] == "ok"
	}
	if len(reached) != 2 || !reached[engines[0].URL()] || !reached[engines[1].URL()] {
		t.Fatalf("set_lora reached %v: %s", reached, rp.Body)
	}
	for _, v := range rolloutStep(t, r, 2, 4, 1) {
		if v != oldVersion+"+lora:step-1" {
			t.Fatalf("step 2 served by %q", v)
		}
	}

	// Training: the fleet sleeps; an engine joins meanwhile; the weights
	// are updated; the fleet wakes. No rollout may come from the old weights.
	testrouter.ExpectStatus(t, "sleep", r.Post("/release_memory_occupation", `{}`, fromCluster...), 200)
	jobs := jobsOn(engines, oldVersion)
	rp = r.Post("/rollout/generate", milesRollout("while asleep", 1, 1, 0))
	testrouter.ExpectStatus(t, "a rollout while the fleet sleeps", rp, 503)
	if rp.Header.Get("Retry-After") == "" || jobsOn(engines, oldVersion) != jobs {
		t.Fatalf("a rollout while the fleet sleeps: Retry-After %q, %d jobs ran", rp.Header.Get("Retry-After"), jobsOn(engines, oldVersion)-jobs)
	}
	testrouter.ExpectStatus(t, "the third engine registers", r.Post("/add_worker?url="+engines[2].URL(), "", fromCluster...), 200)
	testrouter.ExpectStatus(t, "update", r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/step-2","weight_version":"step-2"}`, fromCluster...), 200)
	testrouter.ExpectStatus(t, "wake", r.Post("/resume_memory_occupation", `{}`, fromCluster...), 200)
	before := jobsOn(engines, oldVersion)
	versions := rolloutStep(t, r, 3, 12, 1)
	if old := jobsOn(engines, oldVersion) - before; old != 0 {
		t.Fatalf("after the update and the wake, %d of 12 rollouts ran on the old weights", old)
	}
	// A hedge may run a slow rollout twice, so the engines may count more.
	if n := jobsOn(engines, "/ckpt/step-2"); n < 12 {
		t.Fatalf("%d of 12 rollouts ran on the new weights", n)
	}
	for _, v := range versions {
		if !strings.HasPrefix(v, "step-2") {
			t.Fatalf("a rollout after the update names %q", v)
		}
	}

	// Shutdown: each engine deregisters itself.
	for _, e := range engines {
		testrouter.ExpectStatus(t, "an engine leaves", r.Post("/remove_worker?url="+e.URL(), "", fromCluster...), 200)
	}
	if urls := listed(); len(urls) != 0 {
		t.Fatalf("after every engine left the router lists %v", urls)
	}
}

// TestMilesCallsRefuseBadInput sends the calls of a miles run with bad
// input: each gets a clear 4xx with a JSON error and changes nothing: the
// fleet, its weights and the engines' work stay as they were.
func TestMilesCallsRefuseBadInput(t *testing.T) {
	engines := namedWorkers(t, 1, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(engines)+"\n admin_allow private_ranges\n weights_path_prefix /ckpt\n}")
	testrouter.ExpectStatus(t, "a rollout", r.Post("/rollout/generate", milesRollout("p", 1, 1, 0)), 200)
	fleet := func() string {
		h := r.Get("/health").JSON(t)
		return fmt.Sprint(r.Get("/list_workers").JSON(t)["urls"], h["weight_version"], h["healthy_workers"], engines[0].Stats().Jobs+engines[0].Stats().Failed)
	}
	before := fleet()
	for _, tc := range []struct {
		method, path, body string
		status             int
		says               string // in the error
	}{
		{"POST", "/add_worker", "", 400, "worker_url is required"},
		{"POST", "/add_worker?url=", "", 400, "worker_url is required"},
		{"POST", "/add_worker?url=http://10.0.0.1:30000&url=http://10.0.0.2:30000", "", 400, "url is given 2 times"},
		{"POST", "/add_worker?url=http://10.0.0.1:30000/generate", "", 400, "path"},
		{"POST", "/add_worker?url=10.0.0.1:30000", "", 400, "http://"},
		{"POST", "/add_worker?url=http://169.254.169.254", "", 400, "blocked"},
		{"POST", "/add_worker", `{"url":5}`, 400, "url must be a string"},
		{"POST", "/add_worker", `{"url":`, 400, "Invalid JSON"},
		{"GET", "/add_worker?url=http://10.0.0.1:30000", "", 405, "not allowed"},
		{"POST", "/remove_worker", "", 400, "worker_url is required"},
		{"POST", "/remove_worker?url=" + engines[0].URL() + "&url=http://10.0.0.2:30000", "", 400, "url is given 2 times"},
		{"POST", "/remove_worker?url=http://10.9.9.9:30000", "", 404, "Worker not found"},
		{"POST", "/rollout/generate", `{"prompt":"p"}`, 400, "seed: is required"},
		{"POST", "/rollout/generate", `{"prompt":"p","seed":null}`, 400, "seed: is required"},
		{"POST", "/rollout/generate", `{"prompt":"p","seed":1.5}`, 400, "seed: must be a whole number"},
		{"POST", "/rollout/generate", `{"prompt":"p","seed":"one"}`, 400, "seed"},
		{"POST", "/rollout/generate", `{"prompt":"p","seed":1,"width":0}`, 400, "width: must be positive"},
		{"POST", "/rollout/generate", `{"prompt":"p","seed":1,"num_outputs_per_prompt":-1}`, 400, "num_outputs_per_prompt"},
		{"POST", "/rollout/generate", `{"prompt":"p","seed":1,"guidance_scale":"high"}`, 400, "guidance_scale"},
		{"POST", "/rollout/generate", `{"prompt":"p","seed":1,"Seed":2}`, 400, "only in case"},
		{"POST", "/rollout/generate", `[{"prompt":"p","seed":1}]`, 400, "JSON object"},
		{"POST", "/rollout/generate", `{"prompt":"p",`, 400, "Invalid JSON"},
	} {
		rp := testrouter.Do(t, tc.method, r.Base+tc.path, strings.NewReader(tc.body))
		testrouter.ExpectStatus(t, tc.method+" "+tc.path+" "+tc.body, rp, tc.status)
		if msg := rp.ErrorText(t); !strings.Contains(msg, tc.says) {
			t.Errorf("%s %s %s: %q does not say %q", tc.method, tc.path, tc.body, msg, tc.says)
		}
	}
	if after := fleet(); after != before {
		t.Fatalf("refused calls changed the fleet: %s, then %s", before, after)
	}
}
