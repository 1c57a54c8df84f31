package main

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

// strategy is one way of spreading the jobs: a diffusion_router policy
// (with a queue order for least_work) or, for the baselines, a plain Caddy
// reverse_proxy with one of Caddy's lb_policy values.
type strategy struct {
	name   string // as written in --strategies
	caddy  string // Caddy's lb_policy; set for the baselines only
	policy string // diffusion_router policy
	order  string // diffusion_router queue_order; empty for the router's default
}

// defaultStrategies is what --strategies runs when not given.
const defaultStrategies = "least_work/fifo,least_work/largest_first,least_request,round_robin,random,caddy/least_conn,caddy/round_robin"

// parseStrategies reads --strategies: "caddy/<lb_policy>" is a plain
// reverse_proxy; "<policy>" or "<policy>/<queue_order>" is diffusion_router.
// Names the router does not know fail later, when their config is adapted.
func parseStrategies(list string) ([]strategy, error) {
	var out []strategy
	for name := range strings.SplitSeq(list, ",") {
		name = strings.TrimSpace(name)
		if name == "" {
			continue
		}
		first, second, _ := strings.Cut(name, "/")
		s := strategy{name: name, policy: first, order: second}
		if first == "caddy" {
			s = strategy{name: name, caddy: second}
		}
		if s.caddy == "" && s.policy == "" || first == "caddy" && second == "" {
			return nil, fmt.Errorf("strategy %q: want <policy>, <policy>/<queue_order> or caddy/<lb_policy>", name)
		}
		out = append(out, s)
	}
	if len(out) == 0 {
		return nil, errors.New("no strategies given")
	}
	return out, nil
}

// caddyfile is the whole config for s in front of the workers: the router
// on 127.0.0.1:port with its own pool, so that nothing learned by an earlier
// strategy carries over. maxInflight > 0 sets max_inflight for least_work.
func (s strategy) caddyfile(port int, pool string, workers []string, maxInflight int) string {
	var b strings.Builder
	b.WriteString(`{
	admin off
	auto_https off
	persist_config off
	default_bind 127.0.0.1
	log {
		level ERROR
	}
}
`)
	fmt.Fprintf(&b, ":%d {\n", port)
	if s.caddy != "" {
		dials := make([]string, len(workers))
		for i, w := range workers {
			dials[i] = strings.TrimPrefix(w, "http://")
		}
		fmt.Fprintf(&b, "\treverse_proxy %s {\n\t\tlb_policy %s\n\t\tflush_interval -1\n\t}\n}\n",
			strings.Join(dials, " "), s.caddy)
		return b.String()
	}
	fmt.Fprintf(&b, "\tdiffusion_router %s {\n\t\tworkers %s\n\t\tpolicy %s\n", pool, strings.Join(workers, " "), s.policy)
	if s.order != "" {
		fmt.Fprintf(&b, "\t\tqueue_order %s\n", s.order)
	}
	if maxInflight > 0 && s.policy == "least_work" {
		fmt.Fprintf(&b, "\t\tmax_inflight %d\n", maxInflight)
	}
	b.WriteString("\t}\n}\n")
	return b.String()
}

// member is one fake worker of the fleet.
type member struct {
	name  string
	speed float64
	*fakeworker.Worker
}

// fleet is the fake workers, in the order of --speeds, named w1, w2, ...
type fleet []member

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

// stats returns each worker's counters, in fleet order.
func (f fleet) stats() []fakeworker.Stats {
	out := make([]fakeworker.Stats, len(f))
	for i, w := range f {
		out[i] = w.Stats()
	}
	return out
}

func (f fleet) close() {
	for _, w := range f {
		w.Close()
	}
}

// isolateHome points HOME and the XDG directories at a fresh temporary
// directory, so Caddy writes nothing in the user's home. The returned
// function removes it.
func isolateHome() (func(), error) {
	tmp, err := os.MkdirTemp("", "diffusion-router-bench-")
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
	// initialised, before HOME changed.
	caddy.DefaultStorage.Path = caddy.AppDataDir()
	return func() { os.RemoveAll(tmp) }, nil
}

// errUnavailable marks a strategy whose config Caddy refused, typically a
// policy or option the router does not have (yet).
var errUnavailable = errors.New("strategy unavailable")

// startCaddy adapts the Caddyfile text, loads it in this process and waits
// until GET url/health answers 200. Stop it with caddy.Stop.
func startCaddy(ctx context.Context, text, url string) error {
	adapter := caddyconfig.GetAdapter("caddyfile")
	if adapter == nil {
		return errors.New("the caddyfile config adapter is not registered")
	}
	cfg, _, err := adapter.Adapt([]byte(text), map[string]any{"filename": "bench.Caddyfile"})
	if err != nil {
		return fmt.Errorf("%w: %v", errUnavailable, err)
	}
	if err := caddy.Load(cfg, true); err != nil {
		return fmt.Errorf("%w: loading the config: %v", errUnavailable, err)
	}
	if err := waitHealthy(ctx, url, 10*time.Second); err != nil {
		stopCaddy()
		return err
	}
	return nil
}

func stopCaddy() {
	if err := caddy.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, "bench: stopping caddy:", err)
	}
}

// waitHealthy polls GET url/health until it answers 200.
func waitHealthy(ctx context.Context, url string, limit time.Duration) error {
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

// freePort asks the kernel for a port that is free right now.
func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}
