package diffusionrouter

import (
	"net/http"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

func init() {
	caddy.RegisterModule(UpstreamSource{})
}

// UpstreamSource is the reverse_proxy dynamic upstream source `diffusion`:
// it gives reverse_proxy the pool's serving workers on every request, so
// workers registered at run time are used at once and removed ones never.
type UpstreamSource struct {
	poolRef
}

// CaddyModule returns the Caddy module information.
func (UpstreamSource) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.reverse_proxy.upstreams.diffusion",
		New: func() caddy.Module { return new(UpstreamSource) },
	}
}

// GetUpstreams returns one upstream per serving worker. They are new values
// each time because reverse_proxy writes into the upstreams it is given.
func (s *UpstreamSource) GetUpstreams(*http.Request) ([]*reverseproxy.Upstream, error) {
	dials := s.pool.servingDials()
	ups := make([]*reverseproxy.Upstream, len(dials))
	for i, d := range dials {
		ups[i] = &reverseproxy.Upstream{Dial: d}
	}
	return ups, nil
}

// UnmarshalCaddyfile sets up the source from Caddyfile tokens. Syntax:
//
//	dynamic diffusion [<pool>]
func (s *UpstreamSource) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return s.unmarshalPoolArg(d, "dynamic diffusion")
}

// Interface guards
var (
	_ caddy.Provisioner           = (*UpstreamSource)(nil)
	_ caddy.CleanerUpper          = (*UpstreamSource)(nil)
	_ reverseproxy.UpstreamSource = (*UpstreamSource)(nil)
	_ caddyfile.Unmarshaler       = (*UpstreamSource)(nil)
)
