package diffusionrouter

import (
	"net/http"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/miles-rollout/miles-diffusion-router/internal/attempt"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

func init() {
	caddy.RegisterModule(DiffusionUpstreams{})
}

// DiffusionUpstreams is the reverse_proxy dynamic upstream source `diffusion`:
// it gives reverse_proxy the worker the pool assigned to the request, so
// workers registered at run time are used at once and removed ones never.
// When reverse_proxy asks again, its connection to that worker failed: the
// request moves to another worker.
type DiffusionUpstreams struct {
	poolRef
}

// CaddyModule returns the Caddy module information.
func (DiffusionUpstreams) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.reverse_proxy.upstreams.diffusion",
		New: func() caddy.Module { return new(DiffusionUpstreams) },
	}
}

// GetUpstreams returns the upstream of the request's worker; a request
// without a ticket gets every serving worker. Upstreams are new values each
// time because reverse_proxy writes into the upstreams it is given.
func (s *DiffusionUpstreams) GetUpstreams(r *http.Request) ([]*reverseproxy.Upstream, error) {
	t := scheduler.TicketFrom(r.Context())
	if t == nil {
		return upstreamsOf(s.pool.ServingDials()), nil
	}
	if !attempt.Lookup(r.Context(), s.pool, t) {
		return nil, nil // reverse_proxy answers with the failed attempt's error
	}
	return upstreamsOf([]string{t.Dial()}), nil
}

func upstreamsOf(dials []string) []*reverseproxy.Upstream {
	ups := make([]*reverseproxy.Upstream, len(dials))
	for i, d := range dials {
		ups[i] = &reverseproxy.Upstream{Dial: d}
	}
	return ups
}

// UnmarshalCaddyfile sets up the source from Caddyfile tokens. Syntax:
//
//	dynamic diffusion [<pool>]
func (s *DiffusionUpstreams) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return s.unmarshalPoolArg(d, "dynamic diffusion")
}

// Interface guards
var (
	_ caddy.Provisioner           = (*DiffusionUpstreams)(nil)
	_ caddy.CleanerUpper          = (*DiffusionUpstreams)(nil)
	_ reverseproxy.UpstreamSource = (*DiffusionUpstreams)(nil)
	_ caddyfile.Unmarshaler       = (*DiffusionUpstreams)(nil)
)
