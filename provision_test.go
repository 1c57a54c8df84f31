package diffusionrouter

import (
	"testing"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
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
	h.attempts.Logger = h.logger
	for _, u := range h.Workers {
		h.pool.sched.SetCapabilities(u, []string{"T2I"}, "fake/diffusion-model")
	}
	return h
}
