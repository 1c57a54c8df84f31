package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// strategy is one way of spreading the jobs: a diffusion_router policy
// (with a queue order for least_work) or, for the baselines, a plain Caddy
// reverse_proxy with one of Caddy's lb_policy values; run by one router or
// by several replicas, as behind one Kubernetes Service.
type strategy struct {
	name    string   // as written in --strategies
	caddy   string   // Caddy's lb_policy; set for the baselines only
	policy  string   // diffusion_router policy
	order   string   // diffusion_router queue_order; empty for the router's default
	routers int      // replicas, each with a pool of its own; the client sends to each in turn
	split   bool     // each replica owns a share of the workers rather than all of them
	options []string // more diffusion_router options, one a line, such as adapters
}

// defaultStrategies is what --strategies runs when not given.
const defaultStrategies = "least_work/fifo,least_work/largest_first,least_request,round_robin,random,caddy/least_conn,caddy/round_robin"

// scheduleStrategies is what --strategies runs in the schedule mode when
// not given: the router's default queue order and the two it may be.
const scheduleStrategies = "least_work/fifo,least_work/largest_first,least_work"

// parseStrategies reads --strategies: "caddy/<lb_policy>" is a plain
// reverse_proxy; "<policy>" or "<policy>/<queue_order>" is diffusion_router.
// A suffix "@N" runs N replicas in front of all the workers, "@Nsplit" N
// replicas that each own every Nth worker. Names the router does not know
// fail later, when their config is adapted.
func parseStrategies(list string) ([]strategy, error) {
	var out []strategy
	for name := range strings.SplitSeq(list, ",") {
		name = strings.TrimSpace(name)
		if name == "" {
			continue
		}
		spec, replicas, _ := strings.Cut(name, "@")
		first, second, _ := strings.Cut(spec, "/")
		s := strategy{name: name, policy: first, order: second, routers: 1}
		if first == "caddy" {
			s = strategy{name: name, caddy: second, routers: 1}
		}
		if s.caddy == "" && s.policy == "" || first == "caddy" && second == "" {
			return nil, fmt.Errorf("strategy %q: want <policy>, <policy>/<queue_order> or caddy/<lb_policy>, each optionally followed by @<routers> or @<routers>split", name)
		}
		if replicas != "" {
			digits, split := strings.CutSuffix(replicas, "split")
			n, err := strconv.Atoi(digits)
			if err != nil || n < 1 {
				return nil, fmt.Errorf("strategy %q: want @<routers> or @<routers>split after the strategy, routers a positive number", name)
			}
			s.routers, s.split = n, split
		}
		out = append(out, s)
	}
	if len(out) == 0 {
		return nil, errors.New("no strategies given")
	}
	return out, nil
}

// caddyfile is the whole config for s in front of the workers: a router
// on 127.0.0.1:port for each of ports, each with a pool of its own, so that
// nothing learned by an earlier strategy or another replica carries over.
// maxInflight > 0 sets max_inflight for least_work.
func (s strategy) caddyfile(ports []int, pool string, workers []string, maxInflight int) string {
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
	for i, port := range ports {
		owned := workers
		if s.split {
			owned = nil
			for j := i; j < len(workers); j += len(ports) {
				owned = append(owned, workers[j])
			}
		}
		s.writeSite(&b, port, fmt.Sprintf("%s-%d", pool, i+1), owned, maxInflight)
	}
	return b.String()
}

// writeSite writes one router's site.
func (s strategy) writeSite(b *strings.Builder, port int, pool string, workers []string, maxInflight int) {
	fmt.Fprintf(b, ":%d {\n", port)
	if s.caddy != "" {
		dials := make([]string, len(workers))
		for i, w := range workers {
			dials[i] = strings.TrimPrefix(w, "http://")
		}
		fmt.Fprintf(b, "\treverse_proxy %s {\n\t\tlb_policy %s\n\t}\n}\n",
			strings.Join(dials, " "), s.caddy)
		return
	}
	fmt.Fprintf(b, "\tdiffusion_router %s {\n\t\tworkers %s\n\t\tpolicy %s\n", pool, strings.Join(workers, " "), s.policy)
	if s.order != "" {
		fmt.Fprintf(b, "\t\tqueue_order %s\n", s.order)
	}
	if maxInflight > 0 && s.policy == "least_work" {
		fmt.Fprintf(b, "\t\tmax_inflight %d\n", maxInflight)
	}
	for _, line := range s.options {
		fmt.Fprintf(b, "\t\t%s\n", line)
	}
	b.WriteString("\t}\n}\n")
}

// errUnavailable marks a strategy whose config Caddy refused, typically a
// policy or option the router does not have (yet).
var errUnavailable = errors.New("strategy unavailable")

// startCaddy adapts the Caddyfile text, loads it in this process and waits
// until GET url/health answers 200 for each of urls. Stop it with stopCaddy.
func startCaddy(ctx context.Context, text string, urls []string) error {
	cfg, _, err := testrouter.Adapt([]byte(text), "bench.Caddyfile")
	if err != nil {
		return fmt.Errorf("%w: %v", errUnavailable, err)
	}
	err = testrouter.StartRouter(ctx, cfg, urls...)
	if errors.Is(err, testrouter.ErrLoad) {
		return fmt.Errorf("%w: %v", errUnavailable, err)
	}
	return err
}

func stopCaddy() {
	if err := testrouter.StopRouter(); err != nil {
		fmt.Fprintln(os.Stderr, "bench: stopping caddy:", err)
	}
}
