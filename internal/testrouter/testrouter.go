// Package testrouter is the in-process test harness shared by the router's
// own tests and the examples: fake sglang-diffusion workers, a private HOME
// for Caddy, Caddyfile text adapted and loaded into Caddy in this process,
// and small clients for what the router answers.
//
// It is the one package under internal/ that imports Caddy: it must, to run
// the router, and it imports the root package so that importing it registers
// the router's modules along with Caddy's standard ones. Tests of the root
// package that use it are therefore external tests (package
// diffusionrouter_test).
package testrouter

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/miles-rollout/miles-diffusion-router"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
)

// Router is Caddy running in this process with one site on a port of
// 127.0.0.1 the test picked. Caddy runs one config per process, so a test
// runs one Router at a time.
type Router struct {
	t *testing.T
	// Port is the site's port on 127.0.0.1.
	Port int
	// Base is the site's URL, http://127.0.0.1:Port, without a slash.
	Base    string
	globals string
	started bool // by Start, so Load may replace its config
}

// Start runs site, the body of a Caddyfile site block, on a free port with
// the harness's global options (see AdaptSite) and a storage folder of the
// test's own. Caddy stops when the test ends.
func Start(t *testing.T, site string) *Router {
	t.Helper()
	return StartWith(t, "", site)
}

// StartWith is Start with more global options. Unless globals set storage,
// the router stores its fleet in a folder of the test's own, so that no pool
// reads back the fleet an earlier test left.
func StartWith(t *testing.T, globals, site string) *Router {
	t.Helper()
	if !strings.Contains(globals, "storage ") {
		globals += "\n" + OwnStorage(t)
	}
	port := Port(t)
	r := Attach(t, port)
	r.globals, r.started = globals, true
	t.Cleanup(func() { _ = caddy.Stop() }) // before Load, which may fail the test with Caddy running
	r.Load(site)
	return r
}

// Load adapts site as `caddy adapt` would and loads it in place of what the
// router runs, as `caddy reload` does, keeping the port and global options.
// It returns once only the new config's server listens.
func (r *Router) Load(site string) {
	r.t.Helper()
	if !r.started {
		r.t.Fatal("Load of a router the harness did not start")
	}
	cfg, err := AdaptSite(r.Port, r.globals, site)
	if err != nil {
		r.t.Fatal(err)
	}
	if err := caddy.Load(cfg, true); err != nil {
		r.t.Fatal(err)
	}
	Client.CloseIdleConnections() // the old config's server closes them
	// Each config listens on a socket of its own (SO_REUSEPORT), and the
	// kernel spreads new connections over both while the old one is open;
	// closing it resets those still waiting to be accepted, requests no
	// server has read. caddy.Load returns before the old server has closed
	// its socket, so wait for that before a test sends anything.
	addr := fmt.Sprintf("127.0.0.1:%d", r.Port)
	if !testkit.WaitUntil(30*time.Second, func() bool { return listeners(addr) <= 1 }) {
		r.t.Fatalf("%d sockets still listen on %s 30 s after a reload", listeners(addr), addr)
	}
}

// listeners counts the sockets listening on addr, an IPv4 host:port: from
// /proc/net/tcp where there is one, otherwise the configs using it.
func listeners(addr string) int {
	data, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		return caddy.ListenerUsage("tcp", addr)
	}
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		panic(err)
	}
	ip := ap.Addr().As4()
	// The address as the kernel writes it: the IPv4 address as a
	// native-endian 32-bit number, then the port, both in hex.
	local := fmt.Sprintf("%08X:%04X", binary.NativeEndian.Uint32(ip[:]), ap.Port())
	n := 0
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) > 3 && f[1] == local && f[3] == "0A" { // TCP_LISTEN
			n++
		}
	}
	return n
}

// OwnStorage is the storage global option of a folder of the test's own.
func OwnStorage(t testing.TB) string {
	return "storage file_system " + t.TempDir()
}

// AdaptSite adapts a Caddyfile of globals and one site on port of
// 127.0.0.1, with global options fit for a test: no admin API, no HTTPS, no
// config saved, errors only in the log.
func AdaptSite(port int, globals, site string) ([]byte, error) {
	cf := fmt.Sprintf(`{
	admin off
	auto_https off
	persist_config off
	grace_period 2s # long enough for a request caught by a reload to finish
	default_bind 127.0.0.1
	log {
		level ERROR
	}
%s
}
:%d {
%s
}
`, globals, port, site)
	cfg, _, err := Adapt([]byte(cf), "")
	return cfg, err
}

// Adapt turns Caddyfile text into Caddy's JSON config. filename names the
// text in error messages. It returns Caddy's warnings as text.
func Adapt(text []byte, filename string) (cfg []byte, warnings []string, err error) {
	adapter := caddyconfig.GetAdapter("caddyfile")
	if adapter == nil {
		return nil, nil, errors.New("the caddyfile config adapter is not registered")
	}
	opts := map[string]any{}
	if filename != "" {
		opts["filename"] = filename
	}
	cfg, ws, err := adapter.Adapt(text, opts)
	if err != nil {
		return nil, nil, err
	}
	for _, w := range ws {
		warnings = append(warnings, w.String())
	}
	return cfg, warnings, nil
}

// LoadExample adapts the example Caddyfile at path, filled in from the
// environment the test set, with Caddy's storage in a directory of the
// test's own so that nothing it writes outlives the test.
func LoadExample(t testing.TB, path string) map[string]any {
	t.Helper()
	text, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	raw, _, err := Adapt(text, path)
	if err != nil {
		t.Fatal(err)
	}
	var cfg map[string]any
	if err := json.Unmarshal(raw, &cfg); err != nil {
		t.Fatal(err)
	}
	cfg["storage"] = map[string]any{"module": "file_system", "root": t.TempDir()}
	return cfg
}

// RunExample starts Caddy on cfg, as LoadExample gave it and the test
// amended it, until the test ends; it returns once readyURL's /health
// answers.
func RunExample(t testing.TB, cfg map[string]any, readyURL string) {
	t.Helper()
	raw, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	if err := StartRouter(context.Background(), raw, readyURL); err != nil {
		t.Fatal(err)
	}
}

// FreePort asks the kernel for a port of 127.0.0.1 that is free right now.
func FreePort() (int, error) {
	return testkit.FreePort()
}

// Port is FreePort for a test: it fails t rather than return an error.
func Port(t testing.TB) int {
	t.Helper()
	port, err := FreePort()
	if err != nil {
		t.Fatal(err)
	}
	return port
}

// ErrLoad is wrapped by StartRouter's error when Caddy refuses the config.
var ErrLoad = errors.New("loading the config")

// healthLimit bounds how long StartRouter waits for the router's /health.
const healthLimit = 10 * time.Second

// StartRouter loads cfg, Caddy's JSON config, into Caddy in this process,
// replacing what it runs, and waits until GET url/health answers 200 for
// each of urls (the config's routers). If that does not happen in time it
// stops Caddy again. Stop the routers with StopRouter. It is for programs
// without a testing.T, as the examples are; tests use Start.
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

// Attach returns a Router for a router the test runs itself, as a Caddy
// process or a config it loaded, on 127.0.0.1:port. Its Load is refused:
// it is not this harness's config to replace.
func Attach(t *testing.T, port int) *Router {
	return &Router{t: t, Port: port, Base: fmt.Sprintf("http://127.0.0.1:%d", port)}
}
