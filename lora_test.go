package diffusionrouter_test

import (
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

func TestLoraReachesEveryWorkerAsABarrier(t *testing.T) {
	ws := namedWorkers(t, 2, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n weights_path_prefix /ckpt\n}")
	testrouter.ExpectStatus(t, "a job before", r.Post("/v1/images/generations", testrouter.SmallImage), 200)

	rp := r.Post("/v1/set_lora", `{"lora_nickname":"step1","lora_path":"/ckpt/lora-1"}`)
	testrouter.ExpectStatus(t, "set_lora", rp, 200)
	body := rp.JSON(t)
	if results := body["results"].([]any); len(results) != 2 || body["weight_version"] != oldVersion+"+lora:step1" {
		t.Fatalf("set_lora answered %s; want both workers and the adapter in the version", rp.Body)
	}
	for range 4 {
		if v := r.Post("/v1/images/generations", testrouter.SmallImage).Header.Get(weightVersionHeader); v != oldVersion+"+lora:step1" {
			t.Fatalf("a job after set_lora was served by %q", v)
		}
	}
	if v := r.Get("/health").JSON(t)["weight_version"]; v != oldVersion+"+lora:step1" {
		t.Fatalf("/health says %v", v)
	}
	testrouter.ExpectStatus(t, "merge", r.Post("/v1/merge_lora_weights", ``), 200)
	if v := r.Get("/health").JSON(t)["weight_version"]; v != oldVersion+"+lora:step1" {
		t.Fatalf("after merging /health says %v; merging keeps what is served", v)
	}
	testrouter.ExpectStatus(t, "unmerge", r.Post("/v1/unmerge_lora_weights", `{"target":"all"}`), 200)
	if v := r.Get("/health").JSON(t)["weight_version"]; v != oldVersion {
		t.Fatalf("after unmerging /health says %v; want the base weights", v)
	}

	// A worker that joins now catches up with the adapter before its first job.
	testrouter.ExpectStatus(t, "set_lora again", r.Post("/v1/set_lora", `{"lora_nickname":"step2","lora_path":"/ckpt/lora-2"}`), 200)
	late := testrouter.StartWorkers(t, fakeworker.Config{Name: "late"})
	testrouter.ExpectStatus(t, "register", r.Post("/add_worker?url="+late[0].URL(), ""), 200)
	for range 6 {
		if v := r.Post("/v1/images/generations", testrouter.SmallImage).Header.Get(weightVersionHeader); v != oldVersion+"+lora:step2" {
			t.Fatalf("a job after a worker joined was served by %q", v)
		}
	}

	rp = r.Post("/get_weights_checksum", `{}`)
	testrouter.ExpectStatus(t, "checksums", rp, 200)
	if c := rp.JSON(t); len(c["results"].([]any)) != 3 || c["consistent"] == nil {
		t.Fatalf("checksums answered %s", rp.Body)
	}
}

func TestBadLoraCallsChangeNothing(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n weights_path_prefix /ckpt\n}")
	testrouter.ExpectStatus(t, "a job", r.Post("/v1/images/generations", testrouter.SmallImage), 200)
	for _, tc := range []struct {
		path, body string
		want       int
		says       string
	}{
		{"/v1/set_lora", `{}`, 400, "lora_nickname is required"},
		{"/v1/set_lora", `{"lora_nickname":7}`, 400, "lora_nickname is required"},
		{"/v1/set_lora", `{"lora_nickname":"a","lora_path":"/ckpt/../etc"}`, 400, "'..'"},
		{"/v1/set_lora", `{"lora_nickname":"a","lora_path":"/elsewhere/a"}`, 403, "weights_path_prefix"},
		{"/v1/set_lora", `{"lora_nickname":"a","Lora_Nickname":"b"}`, 400, "only in case"},
		{"/v1/set_lora", `{"lora_nickname":"a","target":"everything"}`, 400, "target must be one of"},
		{"/v1/set_lora", `{"lora_nickname":"` + strings.Repeat("n", 1000) + `","lora_path":"/ckpt/lora-1"}`, 400, "at most 512"},
		{"/v1/set_lora", `{"lora_nickname":"a\nb","lora_path":"/ckpt/lora-1"}`, 400, "printable ASCII"},
		{"/v1/merge_lora_weights", `[1]`, 400, "JSON object"},
	} {
		rp := r.Post(tc.path, tc.body)
		testrouter.ExpectStatus(t, tc.path+" "+tc.body, rp, tc.want)
		if !strings.Contains(rp.ErrorText(t), tc.says) {
			t.Errorf("%s %s: %q does not say %q", tc.path, tc.body, rp.ErrorText(t), tc.says)
		}
	}
	if v := r.Get("/health").JSON(t)["weight_version"]; v != oldVersion {
		t.Fatalf("refused LoRA calls moved the pool to %v", v)
	}
}
