package control

import (
	"context"
	"io/fs"
	"net/http"
	"strings"
	"testing"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/fleet"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// fakeRoster is a pool with a given number of serving workers; any other
// method it is asked panics (the embedded Pool is nil), which shows what
// an endpoint reads.
type fakeRoster struct {
	Pool
	serving, paused int
}

func (f fakeRoster) ServingCount() int { return f.serving }
func (f fakeRoster) PausedCount() int  { return f.paused }

// The control API runs against any Pool: /readyz reads the serving
// workers alone, against min_ready.
func TestReadyzAgainstAFakePool(t *testing.T) {
	for _, c := range []struct {
		serving, minReady, status int
	}{{0, 1, http.StatusServiceUnavailable}, {1, 2, http.StatusServiceUnavailable}, {2, 2, http.StatusOK}} {
		a := &API{Pool: fakeRoster{serving: c.serving}, Logger: zap.NewNop(), MinReady: c.minReady}
		code, body := getJSON(t, a, "/readyz")
		if code != c.status || body["serving_workers"] != float64(c.serving) || body["ready"] != (c.status == http.StatusOK) {
			t.Errorf("%d serving, min_ready %d: /readyz %d %v; want %d", c.serving, c.minReady, code, body, c.status)
		}
	}
}

// notWriter is the group's record on a router that does not lead it.
type notWriter struct{}

func (notWriter) Load(context.Context, string) ([]byte, error) { return nil, fs.ErrNotExist }
func (notWriter) Store(context.Context, string, []byte) error  { return fleet.ErrNotWriter }

// A change made on a router that does not lead its group (deposed while
// a control call ran) says so, rather than that a later write will hold
// it: the active router's record stands.
func TestAChangeOnARouterThatDoesNotLeadSaysSo(t *testing.T) {
	p := scheduler.New(t.Name(), zap.NewNop())
	t.Cleanup(func() { _ = p.Close() })
	store := fleet.NewStore(p, fleet.New(p, zap.NewNop()), zap.NewNop())
	store.Use(nil, notWriter{}, fleet.Rules{})
	store.StartOnce()
	a := &API{Pool: p, Store: store, Logger: zap.NewNop()}
	answer := a.durable(context.Background(), map[string]any{"success": true})
	if warning, _ := answer["warning"].(string); answer["persisted"] != false || !strings.Contains(warning, "does not lead its pool's group") {
		t.Fatalf("answer %v; want persisted false and a warning that this router does not lead", answer)
	}
}
