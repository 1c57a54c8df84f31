package control

import (
	"net/http"
	"testing"

	"go.uber.org/zap"
)

// fakeRoster is a pool with a given number of serving workers; any other
// method it is asked panics (the embedded Pool is nil), which shows what
// an endpoint reads.
type fakeRoster struct {
	Pool
	serving int
}

func (f fakeRoster) ServingCount() int { return f.serving }

// The control API runs against any Pool: /readyz reads the serving
// workers alone, against min_ready.
func TestReadyzAgainstAFakePool(t *testing.T) {
	for _, c := range []struct {
		serving, minReady, status int
	}{{0, 1, http.StatusServiceUnavailable}, {1, 2, http.StatusServiceUnavailable}, {2, 2, http.StatusOK}} {
		a := &API{Pool: fakeRoster{serving: c.serving}, Logger: zap.NewNop(), MinReady: c.minReady}
		code, body := answer(t, a, "/readyz")
		if code != c.status || body["serving_workers"] != float64(c.serving) || body["ready"] != (c.status == http.StatusOK) {
			t.Errorf("%d serving, min_ready %d: /readyz %d %v; want %d", c.serving, c.minReady, code, body, c.status)
		}
	}
}
