package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/miles-rollout/miles-diffusion-router"
	"github.com/miles-rollout/miles-diffusion-router/examples/fakeworker"
)

// member is one fake worker of the fleet.
type member struct {
	name  string
	speed float64
	*fakeworker.Worker
}

// fleet is the fake workers, in the order of speeds.
type fleet []member

// startFleet starts one worker per speed, named w1, w2, ...
func startFleet(speeds []float64, unitMs float64) (fleet, error) {
	var f fleet
	for i, s := range speeds {
		name := fmt.Sprintf("w%d", i+1)
		w, err := fakeworker.Start(fakeworker.Config{Name: name, Speed: s, UnitMs: unitMs})
		if err != nil {
			f.close()
			return nil, err
		}
		f = append(f, member{name, s, w})
	}
	return f, nil
}

func (f fleet) urls() []string {
	urls := make([]string, len(f))
	for i, w := range f {
		urls[i] = w.URL()
	}
	return urls
}

func (f fleet) close() {
	for _, w := range f {
		w.Close()
	}
}

// findCaddyfile returns path if given, else examples/Caddyfile of the
// module that holds the working directory (go run ./examples/demo runs
// from the repository root, but any directory inside it will do).
func findCaddyfile(path string) (string, error) {
	if path != "" {
		if _, err := os.Stat(path); err != nil {
			return "", fmt.Errorf("caddyfile: %w", err)
		}
		return path, nil
	}
	wd, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for dir := wd; ; dir = filepath.Dir(dir) {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			p := filepath.Join(dir, "examples", "Caddyfile")
			if _, err := os.Stat(p); err != nil {
				return "", fmt.Errorf("no examples/Caddyfile in module root %s: %w", dir, err)
			}
			return p, nil
		}
		if filepath.Dir(dir) == dir {
			return "", fmt.Errorf("cannot find examples/Caddyfile: %s is not inside the repository; run from its root (go run ./examples/demo) or pass -caddyfile", wd)
		}
	}
}

// isolateHome points HOME and the XDG directories at a fresh temporary
// directory, so Caddy writes nothing in the user's home. The returned
// function removes it.
func isolateHome() (func(), error) {
	tmp, err := os.MkdirTemp("", "diffusion-router-demo-")
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

// router is the Caddy instance running the router.
type router struct {
	url string
}

// startRouter fills in the environment variables the Caddyfile uses, adapts
// and loads it, and waits until the router's /health answers 200.
func startRouter(ctx context.Context, caddyfile string, workers []string) (*router, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	for name, val := range map[string]string{
		"ROUTER_PORT":  strconv.Itoa(port),
		"ROUTER_BIND":  "127.0.0.1",
		"WORKERS":      strings.Join(workers, " "), // Caddy splits it into arguments
		"ROUTER_ADMIN": "off",                      // no admin API: nothing to reload, nothing to clash with
		"LOG_LEVEL":    "ERROR",                    // failed requests fail the demo anyway
	} {
		os.Setenv(name, val)
	}

	cfg, err := adapt(caddyfile)
	if err != nil {
		return nil, err
	}
	if err := caddy.Load(cfg, true); err != nil {
		return nil, fmt.Errorf("starting the router: %w", err)
	}
	r := &router{url: fmt.Sprintf("http://127.0.0.1:%d", port)}
	if err := r.waitHealthy(ctx, 10*time.Second); err != nil {
		r.stop()
		return nil, err
	}
	return r, nil
}

// adapt turns the Caddyfile into Caddy's JSON config.
func adapt(path string) ([]byte, error) {
	body, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	adapter := caddyconfig.GetAdapter("caddyfile")
	if adapter == nil {
		return nil, errors.New("the caddyfile config adapter is not registered")
	}
	cfg, warnings, err := adapter.Adapt(body, map[string]any{"filename": path})
	if err != nil {
		return nil, fmt.Errorf("adapting %s: %w", path, err)
	}
	for _, w := range warnings {
		fmt.Fprintf(os.Stderr, "caddyfile warning: %s\n", w.String())
	}
	return cfg, nil
}

// waitHealthy polls GET /health until it answers 200.
func (r *router) waitHealthy(ctx context.Context, limit time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	var last string
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, r.url+"/health", nil)
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
			return fmt.Errorf("router %s not healthy after %s (last answer: %s)", r.url, limit, last)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (r *router) stop() {
	if err := caddy.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, "demo: stopping the router:", err)
	}
}

// freePort asks the kernel for a port that is free right now.
func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}
