package diffusionrouter_test

import (
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

func TestInitialSpeedIsAssumedUntilOneIsLearned(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a", UnitMs: 10})
	r := testrouter.Start(t, "diffusion_router initial_speed {\n workers "+ws[0].URL()+"\n initial_speed 4\n}")
	if got := r.Workers()[ws[0].URL()]["speed"]; got != 4.0 {
		t.Fatalf("speed before any job: %v; want initial_speed 4", got)
	}
	testrouter.ExpectStatus(t, "a job", r.Post("/v1/images/generations", testrouter.HeavyImage), 200)
	if got := r.Workers()[ws[0].URL()]["speed"]; got == 4.0 {
		t.Fatal("speed after a job of 200 ms is still the initial 4 units/s")
	}
}
