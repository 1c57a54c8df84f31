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
	caddy.RegisterModule(DiffusionSelection{})
}

// strategy chooses one of the candidate workers for t at time now (Unix
// nanoseconds). It runs under the pool's lock, so it may read and update
// pool and worker state.
type strategy interface {
	pick(p *pool, t *ticket, cands []*worker, now int64) int
}

// strategies maps each `policy` value to its strategy.
var strategies = map[string]strategy{
	"least_work":    leastWork{},
	"least_request": leastRequest{},
	"round_robin":   roundRobin{},
	"random":        randomPick{},
}

// defaultStrategy is the policy when a config names none.
const defaultStrategy = "least_work"

// leastWork gives the job to the worker that will finish it soonest: the
// least (predicted work left + the job's cost) / learned speed. Exact ties,
// as among idle workers of one speed, are broken at random.
type leastWork struct{}

func (leastWork) pick(p *pool, t *ticket, cands []*worker, now int64) int {
	return argmin(cands, func(w *worker) float64 { return p.finishTime(w, t.cost, now) })
}

// argmin returns the index of the candidate with the least score. The scan
// starts at a random place, so that among equal scores (idle workers of one
// speed) each gets its share.
func argmin(cands []*worker, score func(*worker) float64) int {
	start := rand.IntN(len(cands))
	best, bestScore := start, score(cands[start])
	for i := start + 1; i < start+len(cands); i++ {
		j := i
		if j >= len(cands) {
			j -= len(cands)
		}
		if s := score(cands[j]); s < bestScore {
			best, bestScore = j, s
		}
	}
	return best
}

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

func (leastRequest) pick(_ *pool, _ *ticket, cands []*worker, _ int64) int {
	return argmin(cands, func(w *worker) float64 { return float64(w.load.inflight) })
}

// roundRobin cycles through the candidates in pool order.
type roundRobin struct{}

func (roundRobin) pick(p *pool, _ *ticket, cands []*worker, _ int64) int {
	p.next++
	return p.next % len(cands)
}

// randomPick picks a candidate uniformly at random.
type randomPick struct{}

func (randomPick) pick(_ *pool, _ *ticket, cands []*worker, _ int64) int {
	return rand.IntN(len(cands))
}

// DiffusionSelection is the reverse_proxy selection policy `diffusion`: it sends each
// request to the worker the pool gave its ticket. diffusion_router acquires
// that worker by the pool's strategy before proxying, waiting in the pool's
// queue when every fitting worker is full; a retry after a failed
// connection gets another one from the upstream source.
type DiffusionSelection struct {
	poolRef
}

// CaddyModule returns the Caddy module information.
func (DiffusionSelection) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.reverse_proxy.selection_policies.diffusion",
		New: func() caddy.Module { return new(DiffusionSelection) },
	}
}

// Select returns the upstream of the worker given to r's ticket. A request
// that did not pass through diffusion_router has no ticket; it gets a
// serving worker at random, uncounted.
func (s *DiffusionSelection) Select(upstreams reverseproxy.UpstreamPool, r *http.Request, _ http.ResponseWriter) *reverseproxy.Upstream {
	t := ticketFrom(r.Context())
	if t == nil {
		return s.pool.pickUntracked(upstreams)
	}
	for _, u := range upstreams {
		if t.worker != nil && u.Dial == t.worker.dial && u.Available() {
			return u
		}
	}
	return nil
}

// pickUntracked picks at random among the upstreams that are serving
// workers of the pool.
func (p *pool) pickUntracked(upstreams []*reverseproxy.Upstream) *reverseproxy.Upstream {
	p.mu.Lock()
	defer p.mu.Unlock()
	var ok []*reverseproxy.Upstream
	now := p.now().UnixNano()
	for _, u := range upstreams {
		if w := p.byDial[u.Dial]; w != nil && w.serving(now) && u.Available() {
			ok = append(ok, u)
		}
	}
	if len(ok) == 0 {
		return nil
	}
	return ok[rand.IntN(len(ok))]
}

// UnmarshalCaddyfile sets up the policy from Caddyfile tokens. Syntax:
//
//	lb_policy diffusion [<pool>]
func (s *DiffusionSelection) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return s.unmarshalPoolArg(d, "lb_policy diffusion")
}

// Interface guards
var (
	_ caddy.Provisioner     = (*DiffusionSelection)(nil)
	_ caddy.CleanerUpper    = (*DiffusionSelection)(nil)
	_ reverseproxy.Selector = (*DiffusionSelection)(nil)
	_ caddyfile.Unmarshaler = (*DiffusionSelection)(nil)
)
