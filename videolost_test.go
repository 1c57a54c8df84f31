package diffusionrouter_test

import (
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// A video worker that crashes with a video running and comes back at the
// same URL has lost the video: polls of it while the worker is down get a
// clean JSON error, and once the worker denies the job, its slot is free
// and the next video goes there.
func TestVideoWorkerThatLostItsVideoGetsNewOnes(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "v", TaskType: "T2V", UnitMs: 60_000})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n health_interval 1h\n}")
	id := createVideo(t, r, "v")

	cfg := ws[0].Config()
	cfg.Addr = strings.TrimPrefix(ws[0].URL(), "http://") // the same URL when it comes back
	ws[0].Crash()
	rp := r.Get("/v1/videos/" + id)
	if rp.Status != 502 || !strings.Contains(rp.ErrorText(t), id) {
		t.Fatalf("poll of a video on a crashed worker: %d %s; want 502 naming the video", rp.Status, rp.Body)
	}
	for _, internal := range []string{".go:", "reverseproxy.", "statusError", "goroutine "} {
		if strings.Contains(string(rp.Body), internal) {
			t.Fatalf("the error shows the router's internals (%q): %s", internal, rp.Body)
		}
	}

	back, err := fakeworker.Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(back.Close)
	testrouter.ExpectStatus(t, "poll of a video the restarted worker never made", r.Get("/v1/videos/"+id), 404)
	if got := r.Workers()[back.URL()]["active_requests"]; got != 0.0 {
		t.Fatalf("the lost video still holds its worker: active_requests %v", got)
	}
	createVideo(t, r, "v")
}
