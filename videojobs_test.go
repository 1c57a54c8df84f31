package diffusionrouter

import (
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/examples/fakeworker"
)

func TestVideoJobsRememberAndExpire(t *testing.T) {
	now := time.Unix(1000, 0)
	v := newVideoJobs(10, time.Hour)
	v.now = func() time.Time { return now }

	v.remember("vid-1", "http://a:1")
	if w, ok := v.worker("vid-1"); !ok || w != "http://a:1" {
		t.Fatalf("worker(vid-1) = %q, %v", w, ok)
	}
	if _, ok := v.worker("vid-unknown"); ok {
		t.Fatal("unknown id found")
	}
	now = now.Add(time.Hour)
	if _, ok := v.worker("vid-1"); ok {
		t.Fatal("expired job still mapped")
	}
}

func TestVideoJobsBounded(t *testing.T) {
	v := newVideoJobs(3, time.Hour)
	for i := range 5 {
		v.remember(fmt.Sprintf("vid-%d", i), "http://a:1")
	}
	for i, want := range []bool{false, false, true, true, true} {
		if _, ok := v.worker(fmt.Sprintf("vid-%d", i)); ok != want {
			t.Fatalf("vid-%d known=%v; want %v (the oldest go first)", i, ok, want)
		}
	}
	if v.order.Len() != 3 || len(v.byID) != 3 {
		t.Fatalf("holds %d/%d entries; limit is 3", v.order.Len(), len(v.byID))
	}
}

func TestVideoJobsForget(t *testing.T) {
	v := newVideoJobs(10, time.Hour)
	v.remember("vid-a", "http://a:1")
	v.remember("vid-b", "http://b:1")
	v.remember("vid-c", "http://a:1")
	v.forgetWorker("http://a:1")
	v.forget("vid-b")
	for _, id := range []string{"vid-a", "vid-b", "vid-c"} {
		if _, ok := v.worker(id); ok {
			t.Fatalf("%s still mapped", id)
		}
	}
}

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
