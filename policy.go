package diffusionrouter

import (
	"math/rand/v2"
	"net/http"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/workerurl"
)

func init() {
	caddy.RegisterModule(DiffusionSelection{})
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
//
// r goes out with the worker's own host:port as its Host, as a client of
// the worker would send it, rather than the client's: nothing a client
// writes decides what a worker, or whatever else listens there, takes the
// request to be for. Setting it here, where the worker is known, costs
// nothing; a `header_up Host` would make reverse_proxy copy every request's
// headers to apply it. A block that has header_up operations starts again
// from the client's Host before them (see workerHost). A traced job's
// attempt goes with its span as W3C trace context (see tracing.go).
func (s *DiffusionSelection) Select(upstreams reverseproxy.UpstreamPool, r *http.Request, _ http.ResponseWriter) *reverseproxy.Upstream {
	u := s.pick(upstreams, r)
	if u != nil {
		r.Host = u.Dial
		injectTraceContext(r)
	}
	return u
}

func (s *DiffusionSelection) pick(upstreams reverseproxy.UpstreamPool, r *http.Request) *reverseproxy.Upstream {
	t := scheduler.TicketFrom(r.Context())
	if t == nil {
		return s.pool.pickUntracked(upstreams)
	}
	dial := t.Dial()
	for _, u := range upstreams {
		if dial != "" && u.Dial == dial && u.Available() {
			return u
		}
	}
	return nil
}

// pickUntracked picks at random among the upstreams that are serving
// workers of the pool.
func (p *pool) pickUntracked(upstreams []*reverseproxy.Upstream) *reverseproxy.Upstream {
	serving := make(map[string]bool)
	for _, d := range p.ServingDials() {
		serving[workerurl.AddressKey(d)] = true
	}
	var ok []*reverseproxy.Upstream
	for _, u := range upstreams {
		if serving[workerurl.AddressKey(u.Dial)] && u.Available() {
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
