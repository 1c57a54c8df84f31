package diffusionrouter

import (
	"context"
	"errors"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/miles-rollout/miles-diffusion-router/internal/attempt"
)

// reverseProxy is what the attempts of a job need to know of Caddy's
// reverse_proxy, the handler that sends each of them to its worker.
var reverseProxy = attempt.Proxy{NeverSent: neverSent, ClientLeft: clientLeft, Vars: vars, WithVars: withVars}

// neverSent reports whether err ended an attempt before its request
// reached the worker: no connection could be made.
func neverSent(err error) bool {
	_, dial := errors.AsType[reverseproxy.DialError](err)
	return dial
}

// clientLeft reports whether err is reverse_proxy's 499: the client went
// away.
func clientLeft(err error) bool {
	he, ok := errors.AsType[caddyhttp.HandlerError](err)
	return ok && he.StatusCode == 499
}

// vars are the request variables of ctx, which reverse_proxy writes to
// as it prepares a request.
func vars(ctx context.Context) map[string]any {
	v, _ := ctx.Value(caddyhttp.VarsCtxKey).(map[string]any)
	return v
}

// withVars gives ctx v as its request variables.
func withVars(ctx context.Context, v map[string]any) context.Context {
	return context.WithValue(ctx, caddyhttp.VarsCtxKey, v)
}
