package diffusionrouter

import (
	"context"
	"net/url"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// provision provisions h, over workers that nothing dials, with no
// record in storage and its logger a Nop: for tests and benchmarks of the
// router's own work.
func provision(tb testing.TB, h *Handler) *Handler {
	tb.Helper()
	ctx, err := caddy.ProvisionContext(&caddy.Config{})
	if err != nil {
		tb.Fatal(err)
	}
	h.PersistOff = true
	if err := h.Provision(ctx); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = h.Cleanup() })
	h.pool.store.StartOnce() // as the health app's start does
	h.logger = zap.NewNop()
	for _, u := range h.Workers {
		h.pool.sched.SetCapabilities(u, []string{"T2I"}, "fake/diffusion-model")
	}
	return h
}

// An attempt that failed in a way its job may run again after keeps its
// worker for the re-run. When a copy answers between the attempt's end
// and the race's, which ends the job's context, no re-run comes, and the
// race's end must free that worker all the same: asked again then, the
// ended context says there is nothing to run again, and the worker would
// stay busy for good.
func TestAWorkerKeptForARerunIsFreedWhenACopyAnswersFirst(t *testing.T) {
	h := provision(t, &Handler{Pool: "kept-for-rerun", Workers: []string{"http://10.0.0.1:30000"}})
	tk := h.pool.NewTicket(&h.dispatch)
	tk.Job, tk.Route = true, request.Endpoints.Match("POST", &url.URL{Path: "/v1/images/generations"})
	ctx := tk.WithCancel(context.Background())
	if err := h.pool.Acquire(ctx, tk); err != nil {
		t.Fatal(err)
	}
	worker := tk.ServedBy()
	// The attempt's 502, set aside, as send leaves it.
	rec := &recorder{held: &heldAnswer{rerun: true, state: drop, status: 502}}
	rec.slot = slot{h: h, t: tk, kept: true, keptAs: scheduler.Failed}
	hd := &hedge{h: h, primary: tk, copies: 1, winner: h.pool.NewTicket(&h.dispatch), timer: time.NewTimer(time.Hour)}
	hd.copyOver.L = &hd.mu
	tk.Overtake() // the copy's answer won the race

	hd.finish(rec, tk)
	if info, _ := h.pool.sched.Worker(worker); info.Inflight != 0 {
		t.Fatalf("the worker kept for a re-run that never came has %d jobs in flight; want 0", info.Inflight)
	}
}
