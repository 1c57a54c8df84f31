package diffusionrouter

import (
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/examples/fakeworker"
)

func TestUnpolledVideoNeverBlocksVideoCreation(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "vid", TaskType: "T2V"})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n health_interval 50ms\n health_timeout 50ms\n}")
	createVideo(t, r, "vid") // never polled
	start := time.Now()
	for range 3 {
		createVideo(t, r, "vid")
	}
	if took := time.Since(start); took > 20*time.Second {
		t.Fatalf("three video creations behind unpolled ones took %v", took)
	}
	waitFor(t, func() bool { return workerStates(t, r)[ws[0].URL()]["active_requests"] == 0.0 })
	if st := workerStates(t, r)[ws[0].URL()]; st["state"] != "serving" {
		t.Fatalf("a worker holding unpolled videos is %v; want serving", st["state"])
	}
	// A poll of a pinned job reaches its worker whatever the worker's state.
	id := createVideo(t, r, "vid")
	expectStatus(t, "hold the worker back", do(t, "PUT", r.base+"/workers/"+url.QueryEscape(ws[0].URL()), strings.NewReader(`{"is_dead": true}`)), 200)
	expectStatus(t, "poll a held-back worker's job", r.get("/v1/videos/"+id), 200)
	expectStatus(t, "poll it by query", r.get("/v1/videos?video_id="+id), 200)
}
