package diffusionrouter

import (
	"encoding/json"
	"math"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/dustin/go-humanize"
)

func init() {
	httpcaddyfile.RegisterDirective("diffusion_router", parseDirective)
	httpcaddyfile.RegisterDirectiveOrder("diffusion_router", httpcaddyfile.Before, "reverse_proxy")
}

// proxyRetries lets reverse_proxy try other workers when one cannot be
// connected to; Caddy retries a POST only when nothing was sent, so a
// generation never runs twice.
const proxyRetries = 2

// parseDirective expands diffusion_router, as php_fastcgi does, into the
// handler followed by Caddy's reverse_proxy wired to the pool:
//
//	diffusion_router [<matcher>] [<pool>] {
//	    <handler options, see Handler.UnmarshalCaddyfile>
//	    reverse_proxy {
//	        <reverse_proxy options: transport, timeouts, headers, ...>
//	    }
//	    reverse_proxy external
//	}
//
// `reverse_proxy external` leaves the proxy out: the site's own
// reverse_proxy, with `dynamic diffusion` and `lb_policy diffusion`, follows.
func parseDirective(h httpcaddyfile.Helper) ([]httpcaddyfile.ConfigValue, error) {
	h.Next() // the directive name, so that a matcher token comes next
	matcher, err := h.ExtractMatcherSet()
	if err != nil {
		return nil, err
	}
	d := h.Dispenser // holds just this directive's tokens, matcher removed
	handler := new(Handler)
	rp := new(reverseproxy.Handler)
	external := false
	if err := handler.unmarshal(d, func(d *caddyfile.Dispenser) error {
		sub := d.NewFromNextSegment()
		sub.Next()
		switch args := sub.RemainingArgs(); {
		case len(args) == 1 && args[0] == "external" && !sub.NextBlock(0):
			external = true
			return nil
		case len(args) > 0:
			return sub.Errf("reverse_proxy in diffusion_router takes a block of proxy options or the word external, not %q", args)
		}
		sub.Reset()
		return unmarshalProxy(h, sub, rp)
	}); err != nil {
		return nil, err
	}

	handlers := []json.RawMessage{caddyconfig.JSONModuleObject(handler, "handler", "diffusion_router", nil)}
	if !external {
		wireProxy(rp, handler.Pool)
		handlers = append(handlers, caddyconfig.JSONModuleObject(rp, "handler", "reverse_proxy", nil))
	}
	route := caddyhttp.Route{HandlersRaw: handlers}
	if matcher != nil {
		route.MatcherSetsRaw = []caddy.ModuleMap{matcher}
	}
	return []httpcaddyfile.ConfigValue{{Class: "route", Value: route}}, nil
}

// unmarshalProxy reads the reverse_proxy sub-block. Upstreams and the
// selection policy belong to the router, so the block may not set them.
func unmarshalProxy(h httpcaddyfile.Helper, d *caddyfile.Dispenser, rp *reverseproxy.Handler) error {
	if err := rp.UnmarshalCaddyfile(d); err != nil {
		return err
	}
	if err := rp.FinalizeUnmarshalCaddyfile(h); err != nil {
		return err
	}
	d.Reset()
	d.Next()
	if len(rp.Upstreams) > 0 || rp.DynamicUpstreamsRaw != nil ||
		(rp.LoadBalancing != nil && rp.LoadBalancing.SelectionPolicyRaw != nil) {
		return d.Errf("the reverse_proxy block of diffusion_router must not set upstreams, dynamic or lb_policy: the router chooses workers")
	}
	return nil
}

// wireProxy points reverse_proxy at the pool: its workers as dynamic
// upstreams, the diffusion selection policy, retries on failed connections,
// and responses streamed as they arrive.
func wireProxy(rp *reverseproxy.Handler, pool string) {
	rp.DynamicUpstreamsRaw = caddyconfig.JSONModuleObject(UpstreamSource{poolRef{Pool: pool}}, "source", "diffusion", nil)
	if rp.LoadBalancing == nil {
		rp.LoadBalancing = new(reverseproxy.LoadBalancing)
	}
	rp.LoadBalancing.SelectionPolicyRaw = caddyconfig.JSONModuleObject(Selector{poolRef{Pool: pool}}, "policy", "diffusion", nil)
	if rp.LoadBalancing.Retries == 0 {
		rp.LoadBalancing.Retries = proxyRetries
	}
	if rp.FlushInterval == 0 {
		rp.FlushInterval = -1
	}
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	diffusion_router [<pool>] {
//	    workers          <url...>
//	    policy           least_work|least_request|round_robin|random
//	    max_inflight     <n>|unlimited
//	    queue_order      fifo|largest_first|smallest_first
//	    queue_timeout    <duration>
//	    max_queue        <n>
//	    default_steps    <n>
//	    default_size     <width>x<height>
//	    default_frames   <n>
//	    cfg_factor       <factor>
//	    max_body         <size>
//	    admin_allow      <cidr...>
//	    admin_token      <token>
//	    upstream_timeout <duration>
//	    weights_mode     drain|rolling
//	    rolling_batch    <n>
//	    drain_timeout    <duration>
//	    weights_timeout  <duration>
//	    weights_path_prefix <prefix...>
//	}
//
// workers may repeat; each adds to the list. Sizes read like Caddy's
// request_body max_size (64MiB, 10MB, 1048576).
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return h.unmarshal(d, func(d *caddyfile.Dispenser) error {
		return d.Errf("a reverse_proxy block is only read by the diffusion_router directive")
	})
}

// unmarshal reads the handler's options; proxyBlock reads a reverse_proxy
// sub-block, which only the directive knows what to do with.
func (h *Handler) unmarshal(d *caddyfile.Dispenser, proxyBlock func(*caddyfile.Dispenser) error) error {
	d.Next() // directive name
	if d.NextArg() {
		h.Pool = d.Val()
	}
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		if d.Val() == "reverse_proxy" {
			if err := proxyBlock(d); err != nil {
				return err
			}
			continue
		}
		if err := h.unmarshalOption(d); err != nil {
			return err
		}
	}
	return nil
}

// unmarshalOption reads one handler option and checks its value, so a bad
// one fails `caddy adapt` with the file and line.
func (h *Handler) unmarshalOption(d *caddyfile.Dispenser) error {
	opt := d.Val()
	args := d.RemainingArgs()
	if len(args) == 0 {
		return d.Errf("%s needs a value", opt)
	}
	one := func() (string, error) {
		if len(args) != 1 {
			return "", d.Errf("%s takes exactly one value, got %d", opt, len(args))
		}
		return args[0], nil
	}
	switch opt {
	case "workers":
		for _, a := range args {
			if _, err := normalizeWorkerURL(a); err != nil {
				return d.Errf("workers: %q: %v", a, err)
			}
		}
		h.Workers = append(h.Workers, args...)
	case "policy":
		v, err := one()
		if err != nil {
			return err
		}
		if _, ok := strategies[v]; !ok {
			return d.Errf("unknown policy %q (want one of %s)", v, strategyNames())
		}
		h.Policy = v
	case "max_inflight":
		v, err := one()
		if err != nil {
			return err
		}
		if v == "unlimited" {
			h.MaxInflight = -1
		} else if h.MaxInflight, err = positiveInt(d, opt, v); err != nil {
			return err
		}
	case "queue_order":
		v, err := one()
		if err != nil {
			return err
		}
		if _, ok := queueOrders[v]; !ok {
			return d.Errf("unknown queue_order %q (want fifo, largest_first or smallest_first)", v)
		}
		h.QueueOrder = v
	case "queue_timeout":
		v, err := one()
		if err != nil {
			return err
		}
		dur, err := positiveDuration(d, opt, v)
		h.QueueTimeout = dur
		return err
	case "max_queue":
		v, err := one()
		if err != nil {
			return err
		}
		h.MaxQueue, err = positiveInt(d, opt, v)
		return err
	case "default_steps":
		v, err := one()
		if err != nil {
			return err
		}
		h.DefaultSteps, err = positiveInt(d, opt, v)
		return err
	case "default_frames":
		v, err := one()
		if err != nil {
			return err
		}
		h.DefaultFrames, err = positiveInt(d, opt, v)
		return err
	case "default_size":
		v, err := one()
		if err != nil {
			return err
		}
		if _, _, err := parseSize(v); err != nil {
			return d.Errf("default_size: %q is not WIDTHxHEIGHT like 1024x1024", v)
		}
		h.DefaultSize = v
	case "cfg_factor":
		v, err := one()
		if err != nil {
			return err
		}
		f, err := strconv.ParseFloat(v, 64)
		if err != nil || f < 1 || math.IsInf(f, 0) {
			return d.Errf("cfg_factor: %q is not a number of at least 1", v)
		}
		h.CFGFactor = f
	case "weights_mode":
		v, err := one()
		if err != nil {
			return err
		}
		if v != modeDrain && v != modeRolling {
			return d.Errf("unknown weights_mode %q (want drain or rolling)", v)
		}
		h.WeightsMode = v
	case "rolling_batch":
		v, err := one()
		if err != nil {
			return err
		}
		h.RollingBatch, err = positiveInt(d, opt, v)
		return err
	case "drain_timeout":
		v, err := one()
		if err != nil {
			return err
		}
		h.DrainTimeout, err = positiveDuration(d, opt, v)
		return err
	case "weights_timeout":
		v, err := one()
		if err != nil {
			return err
		}
		h.WeightsTimeout, err = positiveDuration(d, opt, v)
		return err
	case "weights_path_prefix":
		for _, a := range args {
			if !strings.HasPrefix(a, "/") && !strings.Contains(a, "://") {
				return d.Errf("weights_path_prefix: %q is neither an absolute path nor a URL prefix", a)
			}
		}
		h.WeightsPathPrefix = append(h.WeightsPathPrefix, args...)
	case "max_body":
		v, err := one()
		if err != nil {
			return err
		}
		size, err := humanize.ParseBytes(v)
		if err != nil || size == 0 {
			return d.Errf("max_body: %q is not a positive size like 64MiB", v)
		}
		h.MaxBody = int64(size)
	case "admin_allow":
		if _, err := parsePrefixes(args); err != nil {
			return d.Err(err.Error())
		}
		h.AdminAllow = append(h.AdminAllow, args...)
	case "admin_token":
		v, err := one()
		if err != nil {
			return err
		}
		h.AdminToken = v
	case "upstream_timeout":
		v, err := one()
		if err != nil {
			return err
		}
		dur, err := positiveDuration(d, opt, v)
		h.UpstreamTimeout = dur
		return err
	default:
		return d.Errf("unknown diffusion_router option %q (options: %s)", opt, strings.Join(optionNames, ", "))
	}
	return nil
}

// optionNames lists the handler's Caddyfile options for error messages.
var optionNames = []string{
	"workers", "policy", "max_inflight", "queue_order", "queue_timeout", "max_queue",
	"default_steps", "default_size", "default_frames", "cfg_factor",
	"max_body", "admin_allow", "admin_token", "upstream_timeout",
	"weights_mode", "rolling_batch", "drain_timeout", "weights_timeout", "weights_path_prefix",
	"reverse_proxy",
}

// positiveInt reads option opt's value v as a positive integer.
func positiveInt(d *caddyfile.Dispenser, opt, v string) (int, error) {
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		return 0, d.Errf("%s: %q is not a positive whole number", opt, v)
	}
	return n, nil
}

// positiveDuration reads option opt's value v as a positive duration.
func positiveDuration(d *caddyfile.Dispenser, opt, v string) (caddy.Duration, error) {
	dur, err := caddy.ParseDuration(v)
	if err != nil || dur <= 0 {
		return 0, d.Errf("%s: %q is not a positive duration like 10m", opt, v)
	}
	return caddy.Duration(dur), nil
}

// Interface guards
var _ caddyfile.Unmarshaler = (*Handler)(nil)
