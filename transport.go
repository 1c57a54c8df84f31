package diffusionrouter

import (
	"bytes"
	"io"
	"net/http"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

func init() {
	caddy.RegisterModule(DiffusionTransport{})
}

// DiffusionTransport is the reverse_proxy transport `diffusion`: Caddy's
// http transport, with the address of every connection it makes checked
// once the worker's name is resolved, so that no request goes to a cloud
// metadata service, a link-local address or Caddy's own admin API, however
// a worker's name resolves. Its options are the http transport's; the
// reverse_proxy that diffusion_router generates uses it.
type DiffusionTransport struct {
	reverseproxy.HTTPTransport
}

// CaddyModule returns the Caddy module information.
func (DiffusionTransport) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.reverse_proxy.transport.diffusion",
		New: func() caddy.Module { return new(DiffusionTransport) },
	}
}

// Provision sets up Caddy's http transport and puts the guard on its dials.
func (t *DiffusionTransport) Provision(ctx caddy.Context) error {
	if err := t.HTTPTransport.Provision(ctx); err != nil {
		return err
	}
	g := newDialGuard(ctx)
	t.Transport.DialContext = g.WrapDial(t.Transport.DialContext)
	if t.Transport.DialTLSContext != nil {
		t.Transport.DialTLSContext = g.WrapDial(t.Transport.DialTLSContext)
	}
	return nil
}

// RoundTrip sends req through Caddy's http transport. A job's body, which
// the router holds whole, goes as the in-memory reader it is rather than
// behind reverse_proxy's wrappers of the client's body: Go's transport then
// writes the request's header and a small body in one write, where it
// would flush the header on its own first, a system call more per job. A
// body of declared length sends no trailers, so the wrapper that copies
// the client's has nothing to copy. The body sent is the one the router
// read: a handler between diffusion_router and reverse_proxy that replaced
// it would be noticed only by its length, and the route the directive
// generates has none.
func (t *DiffusionTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if job := scheduler.TicketFrom(req.Context()); job != nil && len(job.Body) > 0 &&
		req.ContentLength == int64(len(job.Body)) && len(req.TransferEncoding) == 0 {
		held := *req // a RoundTripper leaves the request it is given as it is
		held.Body = io.NopCloser(bytes.NewReader(job.Body))
		req = &held
	}
	return t.HTTPTransport.RoundTrip(req)
}

// Interface guards
var (
	_ http.RoundTripper         = (*DiffusionTransport)(nil)
	_ caddy.Provisioner         = (*DiffusionTransport)(nil)
	_ caddy.CleanerUpper        = (*DiffusionTransport)(nil)
	_ reverseproxy.TLSTransport = (*DiffusionTransport)(nil)
	_ reverseproxy.H2CTransport = (*DiffusionTransport)(nil)
)
