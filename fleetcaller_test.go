package diffusionrouter_test

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// Fleet operations run to their end whether or not their caller waits:
// the router's record of each worker is what the worker did.

// giveUp sends a control call from a client that gives up after patience.
func giveUp(t *testing.T, r *testrouter.Router, path, body string, patience time.Duration) {
	t.Helper()
	impatient := &http.Client{Timeout: patience}
	rp, err := impatient.Post(r.Base+path, "application/json", strings.NewReader(body))
	if err == nil {
		rp.Body.Close()
		t.Fatalf("%s answered %d within %s; the test needs it to take longer", path, rp.StatusCode, patience)
	}
}

// lastOperation waits for the fleet operation to end and returns its report.
func lastOperation(t *testing.T, r *testrouter.Router) map[string]any {
	t.Helper()
	var op map[string]any
	testrouter.WaitFor(t, func() bool {
		rp := r.Get("/fleet_operation")
		op = rp.JSON(t)
		return rp.Status == 200 && op["running"] == false
	})
	return op
}

func TestUpdateOutlivesItsCaller(t *testing.T) {
	ws := namedWorkers(t, 3, fakeworker.Config{UnitMs: 100}) // an update takes 500 ms
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	testrouter.ExpectStatus(t, "no operation yet", r.Get("/fleet_operation"), 404)

	giveUp(t, r, "/update_weights_from_disk", `{"model_path":"/ckpt/G"}`, 200*time.Millisecond)
	op := lastOperation(t, r)
	if op["operation"] != "update_weights" || op["weight_version"] != "/ckpt/G" || op["error"] != nil || len(op["results"].([]any)) != 3 {
		t.Fatalf("the update the caller left: %v", op)
	}
	for _, w := range ws {
		if w.Weights() != "/ckpt/G" {
			t.Fatalf("worker %s runs %q", w.URL(), w.Weights())
		}
	}
	for u, st := range r.Workers() {
		if st["state"] != "serving" || st["weight_version"] != "/ckpt/G" {
			t.Fatalf("worker %s shows %v after the update its caller left", u, st)
		}
	}
	testrouter.ExpectStatus(t, "health after the update", r.Get("/health"), 200)
	rp := r.Post("/v1/images/generations", testrouter.SmallImage)
	testrouter.ExpectStatus(t, "generation after the update", rp, 200)
	if v := rp.Header.Get(weightVersionHeader); v != "/ckpt/G" {
		t.Fatalf("served on %q", v)
	}
}

func TestSleepOutlivesItsCaller(t *testing.T) {
	ws := namedWorkers(t, 2, fakeworker.Config{UnitMs: 500}) // a sleep takes 500 ms
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n queue_timeout 200ms\n}")
	giveUp(t, r, "/release_memory_occupation", "", 200*time.Millisecond)
	if op := lastOperation(t, r); op["operation"] != "sleep" || op["error"] != nil {
		t.Fatalf("the sleep the caller left: %v", op)
	}
	for _, w := range ws {
		if !w.Asleep() {
			t.Fatalf("worker %s is awake", w.URL())
		}
	}
	if h := r.Get("/health").JSON(t); h["sleeping_workers"] != 2.0 {
		t.Fatalf("health after the sleep its caller left: %v", h)
	}
	testrouter.ExpectStatus(t, "generation while asleep", r.Post("/v1/images/generations", testrouter.SmallImage), 503)
	testrouter.ExpectStatus(t, "wake", r.Post("/resume_memory_occupation", ""), 200)
	testrouter.ExpectStatus(t, "generation after wake", r.Post("/v1/images/generations", testrouter.SmallImage), 200)
}

// A worker put to sleep and registered again looks serving to the router,
// and sglang-diffusion answers an image job on it with a bare 500; a wake
// through the router reaches it all the same.
func TestWakeReachesAWorkerRegisteredAgainWhileAsleep(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n queue_timeout 200ms\n}")
	testrouter.ExpectStatus(t, "register", r.Post("/workers", `{"url":"`+ws[0].URL()+`"}`), 200)
	testrouter.ExpectStatus(t, "sleep", r.Post("/release_memory_occupation", ""), 200)
	testrouter.ExpectStatus(t, "remove", r.Post("/remove_worker", `{"url":"`+ws[0].URL()+`"}`), 200)
	testrouter.ExpectStatus(t, "register again", r.Post("/workers", `{"url":"`+ws[0].URL()+`"}`), 200)

	if rp := r.Post("/v1/images/generations", testrouter.SmallImage); rp.Status == 200 {
		t.Fatal("a sleeping worker served an image")
	}
	rp := r.Post("/resume_memory_occupation", "")
	testrouter.ExpectStatus(t, "wake", rp, 200)
	if res, _ := rp.JSON(t)["results"].([]any); len(res) != 1 {
		t.Fatalf("the wake reached no worker: %s", rp.Body)
	}
	if ws[0].Asleep() {
		t.Fatal("the worker sleeps on after the wake")
	}
	testrouter.ExpectStatus(t, "generation after wake", r.Post("/v1/images/generations", testrouter.SmallImage), 200)
}
