// Package harness holds what the examples share for running fake workers
// and an in-process router: a fleet of fake sglang-diffusion workers, a
// private HOME for Caddy, and a Caddyfile adapted, loaded into Caddy in this
// process and waited on until it is healthy.
//
// Importing it registers Caddy's standard modules and diffusion_router.
package harness

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/miles-rollout/miles-diffusion-router"
	"github.com/miles-rollout/miles-diffusion-router/examples/fakeworker"
)

// Member is one fake worker of a fleet.
type Member struct {
	Name  string
	Speed float64
	*fakeworker.Worker
}

// Fleet is fake workers, in the order of their speeds.
type Fleet []Member

// StartFleet starts one fake worker per speed on a free port of 127.0.0.1,
// named w1, w2, ... A job of cost c keeps a worker busy for
// c × unitMs / speed milliseconds.
func StartFleet(speeds []float64, unitMs float64) (Fleet, error) {
	var f Fleet
	for i, s := range speeds {
		name := fmt.Sprintf("w%d", i+1)
		w, err := fakeworker.Start(fakeworker.Config{Name: name, Speed: s, UnitMs: unitMs})
		if err != nil {
			f.Close()
			return nil, err
		}
		f = append(f, Member{name, s, w})
	}
	return f, nil
}

// URLs returns the workers' base URLs, in fleet order.
func (f Fleet) URLs() []string {
	urls := make([]string, len(f))
	for i, w := range f {
		urls[i] = w.URL()
	}
	return urls
}

// Stats returns each worker's counters, in fleet order.
func (f Fleet) Stats() []fakeworker.Stats {
	out := make([]fakeworker.Stats, len(f))
	for i, w := range f {
		out[i] = w.Stats()
	}
	return out
}

// Restart starts a fresh worker with m's config on m's address, as a
// supervisor starts a dead worker process again: the same URL, none of the
// old worker's state. It closes m's worker first, if that is still open.
func (m Member) Restart() (Member, error) {
	m.Close()
	cfg := m.Config()
	cfg.Addr = strings.TrimPrefix(m.URL(), "http://")
	w, err := fakeworker.Start(cfg)
	if err != nil {
		return m, err
	}
	m.Worker = w
	return m, nil
}

// Close stops every worker.
func (f Fleet) Close() {
	for _, w := range f {
		w.Close()
	}
}

// IsolateHome points HOME and the XDG directories at a fresh temporary
// directory, named after pattern as by os.MkdirTemp, so Caddy writes nothing
// in the user's home. The returned function removes the directory.
func IsolateHome(pattern string) (func(), error) {
	tmp, err := os.MkdirTemp("", pattern)
	if err != nil {
		return nil, err
	}
	for _, v := range []struct{ name, dir string }{
		{"HOME", tmp},
		{"XDG_CONFIG_HOME", filepath.Join(tmp, "config")},
		{"XDG_DATA_HOME", filepath.Join(tmp, "data")},
		{"XDG_CACHE_HOME", filepath.Join(tmp, "cache")},
	} {
		os.Setenv(v.name, v.dir)
	}
	// Caddy fixed its default storage path when the package was
	// initialised, before HOME changed; its TLS app leaves a storage-clean
	// stamp there even with auto_https off.
	caddy.DefaultStorage.Path = caddy.AppDataDir()
	return func() { os.RemoveAll(tmp) }, nil
}

// FreePort asks the kernel for a port of 127.0.0.1 that is free right now.
func FreePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// Adapt turns Caddyfile text into Caddy's JSON config. filename names the
// text in error messages. It returns Caddy's warnings as text.
func Adapt(text []byte, filename string) (cfg []byte, warnings []string, err error) {
	adapter := caddyconfig.GetAdapter("caddyfile")
	if adapter == nil {
		return nil, nil, errors.New("the caddyfile config adapter is not registered")
	}
	cfg, ws, err := adapter.Adapt(text, map[string]any{"filename": filename})
	if err != nil {
		return nil, nil, err
	}
	for _, w := range ws {
		warnings = append(warnings, w.String())
	}
	return cfg, warnings, nil
}

// ErrLoad is wrapped by StartRouter's error when Caddy refuses the config.
var ErrLoad = errors.New("loading the config")

// healthLimit bounds how long StartRouter waits for the router's /health.
const healthLimit = 10 * time.Second

// StartRouter loads cfg, Caddy's JSON config, into Caddy in this process,
// replacing what it runs, and waits until GET url/health answers 200 for
// each of urls (the config's routers). If that does not happen in time it
// stops Caddy again. Stop the routers with StopRouter.
func StartRouter(ctx context.Context, cfg []byte, urls ...string) error {
	if err := caddy.Load(cfg, true); err != nil {
		return fmt.Errorf("%w: %w", ErrLoad, err)
	}
	for _, url := range urls {
		if err := WaitHealthy(ctx, url, healthLimit); err != nil {
			if stopErr := StopRouter(); stopErr != nil {
				err = errors.Join(err, fmt.Errorf("stopping it: %w", stopErr))
			}
			return err
		}
	}
	return nil
}

// StopRouter stops the router StartRouter loaded.
func StopRouter() error {
	return caddy.Stop()
}

// WaitHealthy polls GET url/health until it answers 200, for at most limit.
func WaitHealthy(ctx context.Context, url string, limit time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	var last string
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url+"/health", nil)
		if err != nil {
			return err
		}
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = resp.Status
		} else {
			last = err.Error()
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s not healthy after %s (last answer: %s)", url, limit, last)
		case <-time.After(20 * time.Millisecond):
		}
	}
}
