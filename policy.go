package diffusionrouter

import (
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

func init() {
	caddy.RegisterModule(Selector{})
}

// strategy chooses one of the candidate workers for a job. It runs under
// the pool's lock, so it may read and update pool and worker state.
type strategy interface {
	pick(p *Pool, cands []*Worker) int
}

// strategies maps each `policy` value to its strategy.
var strategies = map[string]strategy{
	"least_request": leastRequest{},
	"round_robin":   roundRobin{},
	"random":        randomPick{},
}

// defaultStrategy is the policy when a config names none.
const defaultStrategy = "least_request"

// strategyNames lists the valid `policy` values, for error messages.
func strategyNames() string {
	names := make([]string, 0, len(strategies))
	for n := range strategies {
		names = append(names, n)
	}
	slices.Sort(names)
	return strings.Join(names, ", ")
}

// leastRequest picks the worker with the fewest jobs in flight, breaking
// ties at random so idle workers share the load evenly.
type leastRequest struct{}

func (leastRequest) pick(_ *Pool, cands []*Worker) int {
	best, ties := 0, 1
	for i := 1; i < len(cands); i++ {
		switch d := cands[i].inflight - cands[best].inflight; {
		case d < 0:
			best, ties = i, 1
		case d == 0:
			ties++
			if rand.IntN(ties) == 0 {
				best = i
			}
		}
	}
	return best
}

// roundRobin cycles through the candidates in pool order.
type roundRobin struct{}

func (roundRobin) pick(p *Pool, cands []*Worker) int {
	p.next++
	return p.next % len(cands)
}

// randomPick picks a candidate uniformly at random.
type randomPick struct{}

func (randomPick) pick(_ *Pool, cands []*Worker) int { return rand.IntN(len(cands)) }

// Selector is the reverse_proxy selection policy `diffusion`: it hands each
// request to the pool worker that diffusion_router's strategy chooses and
// claims that worker for the request. Workers the router holds back (dead,
// sleeping, not video-capable for a video job, or not the worker that made
// a video job being polled) are never chosen.
type Selector struct {
	poolRef
}

// CaddyModule returns the Caddy module information.
func (Selector) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.reverse_proxy.selection_policies.diffusion",
		New: func() caddy.Module { return new(Selector) },
	}
}

// Select chooses a worker for r. A request that did not pass through
// diffusion_router has no ticket; it gets a worker by the default strategy
// without being counted.
func (s *Selector) Select(upstreams reverseproxy.UpstreamPool, r *http.Request, _ http.ResponseWriter) *reverseproxy.Upstream {
	t := ticketFrom(r.Context())
	if t == nil {
		t = &ticket{pool: s.pool, strategy: strategies[defaultStrategy]}
	}
	return t.pool.acquire(t, upstreams)
}

// UnmarshalCaddyfile sets up the policy from Caddyfile tokens. Syntax:
//
//	lb_policy diffusion [<pool>]
func (s *Selector) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return s.unmarshalPoolArg(d, "lb_policy diffusion")
}

// Interface guards
var (
	_ caddy.Provisioner     = (*Selector)(nil)
	_ caddy.CleanerUpper    = (*Selector)(nil)
	_ reverseproxy.Selector = (*Selector)(nil)
	_ caddyfile.Unmarshaler = (*Selector)(nil)
)
