package diffusionrouter_test

import (
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

func TestUnpolledVideoNeverBlocksVideoCreation(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "vid", TaskType: "T2V"})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n health_interval 50ms\n health_timeout 50ms\n}")
	createVideo(t, r, "vid") // never polled
	start := time.Now()
	for range 3 {
		createVideo(t, r, "vid")
	}
	if took := time.Since(start); took > 20*time.Second {
		t.Fatalf("three video creations behind unpolled ones took %v", took)
	}
	testrouter.WaitFor(t, func() bool { return r.Workers()[ws[0].URL()]["active_requests"] == 0.0 })
	if st := r.Workers()[ws[0].URL()]; st["state"] != "serving" {
		t.Fatalf("a worker holding unpolled videos is %v; want serving", st["state"])
	}
	// A poll of a pinned job reaches its worker whatever the worker's state.
	id := createVideo(t, r, "vid")
	testrouter.ExpectStatus(t, "hold the worker back", testrouter.Do(t, "PUT", r.Base+"/workers/"+url.QueryEscape(ws[0].URL()), strings.NewReader(`{"is_dead": true}`)), 200)
	testrouter.ExpectStatus(t, "poll a held-back worker's job", r.Get("/v1/videos/"+id), 200)
	testrouter.ExpectStatus(t, "poll it by query", r.Get("/v1/videos?video_id="+id), 200)
}
