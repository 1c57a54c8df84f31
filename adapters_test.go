package diffusionrouter_test

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/memstore"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// policySite is a router over workers that serves LoRA policies a, b, c
// and d, each loaded from /ckpt/lora/<name>.
func policySite(workers []*fakeworker.Worker, extra string) string {
	return "diffusion_router {\n workers " + testrouter.URLs(workers) + `
 weights_path_prefix /ckpt
 adapter a /ckpt/lora/a
 adapter b /ckpt/lora/b
 adapter c /ckpt/lora/c
 adapter d /ckpt/lora/d
 adapter_switch_prior 20ms
 ` + extra + "\n}"
}

// policyImage is a small image job for the policy named.
func policyImage(model string) string {
	return fmt.Sprintf(`{"model":%q,"response_format":"b64_json","prompt":"a cat","size":"64x64","num_inference_steps":1}`, model)
}

func TestEveryAnswerComesFromItsOwnPolicy(t *testing.T) {
	ws := namedWorkers(t, 4, fakeworker.Config{LoraSwitch: 20 * time.Millisecond})
	r := testrouter.Start(t, policySite(ws, ""))
	policies := []string{"a", "b", "c", "d"}
	var wg sync.WaitGroup
	var mu sync.Mutex
	wrong := map[string]int{}
	for i := range 160 {
		wg.Go(func() {
			want := policies[i%4]
			rp := r.Post("/v1/images/generations", policyImage(want))
			got := rp.Header.Get(fakeworker.AdapterHeader)
			version := rp.Header.Get(weightVersionHeader)
			if rp.Status != 200 || got != want || version != oldVersion+"+lora:"+want+"@0" {
				mu.Lock()
				wrong[fmt.Sprintf("%s: %d from %q as %q", want, rp.Status, got, version)]++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if len(wrong) > 0 {
		t.Fatalf("answers not from their own policy: %v", wrong)
	}
	switches := 0
	for _, w := range ws {
		switches += w.Stats().LoraSwitches
	}
	// Each worker switches from the base weights to one policy, and few
	// more as the interleaved load shifts: never one per request.
	t.Logf("%d switches", switches)
	if switches < 4 || switches > 40 {
		t.Fatalf("%d switches for 160 requests of 4 policies on 4 workers", switches)
	}
	testrouter.WaitFor(t, func() bool { // a switch decided as the last jobs ran ends
		for _, w := range r.Workers() {
			if w["adapter_state"] != "ready" {
				return false
			}
		}
		return true
	})
	for _, w := range r.Workers() {
		if name := w["adapter"].(string); !slices.Contains(policies, name) {
			t.Errorf("worker %v holds %q after serving only policies", w["url"], name)
		}
	}
}

func TestRequestsNameTheirPolicyOrTheBase(t *testing.T) {
	ws := namedWorkers(t, 2, fakeworker.Config{})
	r := testrouter.Start(t, policySite(ws, ""))
	for _, model := range []string{"", oldVersion} {
		rp := r.Post("/v1/images/generations", policyImage(model))
		testrouter.ExpectStatus(t, "a base job", rp, 200)
		if got := rp.Header.Get(fakeworker.AdapterHeader); got != "" || rp.Header.Get(weightVersionHeader) != oldVersion {
			t.Fatalf("model %q ran on adapter %q as %q; want the base weights", model, got, rp.Header.Get(weightVersionHeader))
		}
	}
	rp := r.Post("/v1/images/generations", policyImage("z"))
	testrouter.ExpectStatus(t, "an undeclared policy", rp, 400)
	if msg := rp.ErrorText(t); msg != `adapter "z" is not served here; declared adapters: a, b, c, d` {
		t.Fatalf("error %q", msg)
	}
	testrouter.ExpectStatus(t, "a job after", r.Post("/v1/images/generations", policyImage("b")), 200)
}

func TestASiteCanNameItsPolicyForAnUnmodifiedTrainer(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{})
	r := testrouter.Start(t, policySite(ws, "adapter_from c"))
	rp := r.Post("/v1/images/generations", testrouter.SmallImage) // no model field at all
	testrouter.ExpectStatus(t, "a job", rp, 200)
	if got := rp.Header.Get(fakeworker.AdapterHeader); got != "c" {
		t.Fatalf("ran on adapter %q; want the site's, c", got)
	}
}

func TestAPublishReloadsOnlyThatPolicysWorkers(t *testing.T) {
	ws := namedWorkers(t, 2, fakeworker.Config{LoraSwitch: 20 * time.Millisecond})
	r := testrouter.Start(t, policySite(ws, ""))
	testrouter.ExpectStatus(t, "a job of a", r.Post("/v1/images/generations", policyImage("a")), 200)
	testrouter.ExpectStatus(t, "a job of b", r.Post("/v1/images/generations", policyImage("b")), 200)
	switches := ws[0].Stats().LoraSwitches + ws[1].Stats().LoraSwitches

	rp := r.Post("/v1/set_lora", `{"lora_nickname":"a","lora_path":"/ckpt/lora/a-step2"}`)
	testrouter.ExpectStatus(t, "the publish", rp, 200)
	body := rp.JSON(t)
	if body["weight_version"] != oldVersion+"+lora:a@1" || len(body["results"].([]any)) != 1 {
		t.Fatalf("publish answered %s; want a's one holder and a@1", rp.Body)
	}
	if got := ws[0].Stats().LoraSwitches + ws[1].Stats().LoraSwitches; got != switches+1 {
		t.Fatalf("%d switches for a publish of a; want one, on a's holder alone", got-switches)
	}
	rp = r.Post("/v1/images/generations", policyImage("a"))
	if v := rp.Header.Get(weightVersionHeader); v != oldVersion+"+lora:a@1" {
		t.Fatalf("a job after the publish was served as %q", v)
	}
	loras := testrouter.Do(t, "GET", workerURL(ws, rp.Header.Get("X-Fake-Worker"))+"/v1/list_loras", nil).JSON(t)
	if active := loras["active"].(map[string]any)["transformer"].([]any)[0].(map[string]any); active["path"] != "/ckpt/lora/a-step2" {
		t.Fatalf("the worker that served a after the publish has %v active", active)
	}
	for _, tc := range []struct{ path, body, want string }{
		{"/v1/set_lora", `{"lora_nickname":"a","lora_path":"/ckpt/lora/a-step2"}`, "is loaded from /ckpt/lora/a-step2 already"},
		{"/v1/set_lora", `{"lora_nickname":"z","lora_path":"/ckpt/lora/z"}`, "lora_nickname must name one declared adapter: a, b, c, d"},
		{"/v1/set_lora", `{"lora_nickname":"a"}`, "lora_path is required"},
		{"/v1/set_lora", `{"lora_nickname":"a","lora_path":"/ckpt/lora/a-3","strength":"high"}`, "strength must be a positive number"},
		{"/v1/set_lora", `{"lora_nickname":"a","lora_path":"/ckpt/lora/a-3","strength":-1}`, "strength must be a positive number"},
		{"/v1/merge_lora_weights", `{}`, "the router merges and unmerges them as it places them"},
		{"/v1/unmerge_lora_weights", `{}`, "the router merges and unmerges them as it places them"},
	} {
		rp := r.Post(tc.path, tc.body)
		testrouter.ExpectStatus(t, tc.path+" "+tc.body, rp, 400)
		if msg := rp.ErrorText(t); !strings.Contains(msg, tc.want) {
			t.Fatalf("%s %s: error %q; want it to say %q", tc.path, tc.body, msg, tc.want)
		}
	}
	rp = r.Post("/v1/set_lora", `{"lora_nickname":"a","lora_path":"/tmp/elsewhere"}`)
	testrouter.ExpectStatus(t, "a path outside weights_path_prefix", rp, 403)
	testrouter.ExpectStatus(t, "b after it all", r.Post("/v1/images/generations", policyImage("b")), 200)
	if v := r.Post("/v1/images/generations", policyImage("a")).Header.Get(weightVersionHeader); v != oldVersion+"+lora:a@1" {
		t.Fatalf("after the refused calls a is served as %q; want them to have changed nothing", v)
	}
}

// workerURL is the URL of the worker namedWorkers named name.
func workerURL(ws []*fakeworker.Worker, name string) string {
	return ws[name[0]-'a'].URL()
}

func TestABaseUpdateMergesEachAdapterAgain(t *testing.T) {
	ws := namedWorkers(t, 2, fakeworker.Config{})
	r := testrouter.Start(t, policySite(ws, ""))
	testrouter.ExpectStatus(t, "a job of a", r.Post("/v1/images/generations", policyImage("a")), 200)
	switches := func() (n int) {
		for _, w := range ws {
			n += w.Stats().LoraSwitches
		}
		return n
	}
	before := switches()
	testrouter.ExpectStatus(t, "the update", r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/base-2"}`), 200)
	rp := r.Post("/v1/images/generations", policyImage("a"))
	testrouter.ExpectStatus(t, "a job of a after the update", rp, 200)
	if got, v := rp.Header.Get(fakeworker.AdapterHeader), rp.Header.Get(weightVersionHeader); got != "a" || v != "/ckpt/base-2+lora:a@0" {
		t.Fatalf("after the base update a job of a ran on %q as %q", got, v)
	}
	if switches() < before+2 { // its holder unmerged a and merged it again, over the new weights
		t.Fatalf("%d LoRA calls changed weights after the update; want a taken off and merged again", switches()-before)
	}
	rp = r.Post("/v1/images/generations", policyImage(""))
	if got, v := rp.Header.Get(fakeworker.AdapterHeader), rp.Header.Get(weightVersionHeader); got != "" || v != "/ckpt/base-2" {
		t.Fatalf("after the base update a base job ran on %q as %q", got, v)
	}
}

func TestAPublishOutlivesARestart(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{})
	store := memstore.New()
	store.Put(fleetKey, []byte(`{"workers":[],"adapters":[{"name":"a","path":"/ckpt/lora/a-step7","publish":7},{"name":"z","path":"/ckpt/z","publish":1},{"name":"b","path":"/elsewhere/b","publish":2}]}`))
	r := testrouter.StartWith(t, testrouter.UseStorage(store), policySite(ws, ""))
	rp := r.Post("/v1/images/generations", policyImage("a"))
	testrouter.ExpectStatus(t, "a job of a", rp, 200)
	if v := rp.Header.Get(weightVersionHeader); v != oldVersion+"+lora:a@7" {
		t.Fatalf("a job of a after a restart was served as %q; want the publish read back", v)
	}
	active := testrouter.Do(t, "GET", ws[0].URL()+"/v1/list_loras", nil).JSON(t)["active"].(map[string]any)["transformer"].([]any)[0].(map[string]any)
	if active["path"] != "/ckpt/lora/a-step7" {
		t.Fatalf("the worker loaded %v; want the path published before the restart", active)
	}
	rp = r.Post("/v1/images/generations", policyImage("b"))
	if v := rp.Header.Get(weightVersionHeader); v != oldVersion+"+lora:b@0" {
		t.Fatalf("b, whose record names a path outside weights_path_prefix, was served as %q; want the config's path", v)
	}
}

func TestAdapterMetricsCountSwitchesAndWaitingWork(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{LoraSwitch: 20 * time.Millisecond})
	r := testrouter.Start(t, testrouter.MetricsSite(policySite(ws, "")))
	testrouter.ExpectStatus(t, "a job of a", r.Post("/v1/images/generations", policyImage("a")), 200)
	testrouter.ExpectStatus(t, "a job of b", r.Post("/v1/images/generations", policyImage("b")), 200)
	for _, name := range []string{"a", "b"} {
		labels := map[string]string{"pool": "default", "adapter": name}
		if n := testrouter.Value(t, r, "caddy_diffusion_adapter_switches_total", labels); n != 1 {
			t.Errorf("switches to %s: %v; want 1", name, n)
		}
		if s := testrouter.Value(t, r, "caddy_diffusion_adapter_switch_seconds_total", labels); s < 0.02 {
			t.Errorf("time switching to %s: %vs; want at least the fake's 20ms", name, s)
		}
		if c := testrouter.Value(t, r, "caddy_diffusion_adapter_waiting_cost", labels); c != 0 {
			t.Errorf("cost waiting for %s: %v; want 0 with nothing waiting", name, c)
		}
	}
	if n := testrouter.Value(t, r, "caddy_diffusion_adapter_workers", map[string]string{"adapter": "b"}); n != 1 {
		t.Errorf("workers holding b: %v; want the one that served it last", n)
	}
}
