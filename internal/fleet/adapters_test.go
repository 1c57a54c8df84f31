package fleet

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// A switch says how its call failed: a worker's answer by its status, a
// worker that gave none within adapter_switch_timeout by that (504, not
// the 502 of a call that could not be made), and one that could not be
// called by why.
func TestASwitchSaysHowItsCallFailed(t *testing.T) {
	hung := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		<-r.Context().Done() // never answers
	}))
	defer hung.Close()
	fails := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = w.Write([]byte(`{"detail":"Failed to set LoRA adapter: no adapter_config.json"}`))
	}))
	defer fails.Close()
	closed := httptest.NewServer(http.NotFoundHandler())
	closed.Close()

	s := NewSwitcher(New(&retriedUpdate{}, zap.NewNop()))
	a := &scheduler.Adapter{Name: "a", Path: "/ckpt/a"}
	// The switch's adapter_switch_timeout: short for the worker that
	// never answers, generous for those that answer at once.
	const short, long = 100 * time.Millisecond, time.Minute
	for _, c := range []struct {
		worker  string
		timeout time.Duration
		unmerge bool
		status  int
		err     string
	}{
		{hung.URL, short, false, http.StatusGatewayTimeout, "/v1/set_lora did not answer within adapter_switch_timeout"},
		{hung.URL, short, true, http.StatusGatewayTimeout, "/v1/unmerge_lora_weights did not answer within adapter_switch_timeout"},
		{fails.URL, long, false, http.StatusInternalServerError, "/v1/set_lora answered 500: Failed to set LoRA adapter: no adapter_config.json"},
		{closed.URL, long, false, http.StatusBadGateway, "/v1/set_lora could not be called: Post \"" + closed.URL + "/v1/set_lora\": dial tcp " + closed.Listener.Addr().String() + ": connect: connection refused"},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
		status, msg, err := s.Switch(ctx, c.worker, a, c.unmerge)
		cancel()
		if status != c.status || err == nil || err.Error() != c.err {
			t.Errorf("switch of %s (unmerge %v): %d, %v; want %d, %s", c.worker, c.unmerge, status, err, c.status, c.err)
		}
		if msg == "" {
			t.Errorf("switch of %s: no message", c.worker)
		}
	}
}
