package diffusionrouter

import (
	"cmp"
	"encoding/json"
	"maps"
	"math"
	"regexp"
	"slices"
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
		wireProxy(rp, handler)
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
// upstreams, the diffusion selection policy, retries on failed connections
// (and on the answers retry_on lists), and responses streamed as they
// arrive.
func wireProxy(rp *reverseproxy.Handler, h *Handler) {
	pool := h.Pool
	rp.DynamicUpstreamsRaw = caddyconfig.JSONModuleObject(DiffusionUpstreams{poolRef{Pool: pool}}, "source", "diffusion", nil)
	if rp.LoadBalancing == nil {
		rp.LoadBalancing = new(reverseproxy.LoadBalancing)
	}
	rp.LoadBalancing.SelectionPolicyRaw = caddyconfig.JSONModuleObject(DiffusionSelection{poolRef{Pool: pool}}, "policy", "diffusion", nil)
	if rp.LoadBalancing.Retries == 0 {
		rp.LoadBalancing.Retries = proxyRetries
	}
	if rp.FlushInterval == 0 {
		rp.FlushInterval = -1
	}
	if len(h.retryOn) > 0 {
		codes := make([]string, len(h.retryOn))
		for i, c := range h.retryOn {
			codes[i] = strconv.Itoa(c)
		}
		expr := "{http.reverse_proxy.status_code} in [" + strings.Join(codes, ", ") + "]"
		rp.LoadBalancing.RetryMatchRaw = append(rp.LoadBalancing.RetryMatchRaw, caddy.ModuleMap{"expression": caddyconfig.JSON(expr, nil)})
		// A retried request is sent again, so reverse_proxy must keep its body.
		rp.RequestBuffers = cmp.Or(h.MaxBody, defaultMaxBody)
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
//	    health_uri       <path>
//	    health_interval  <duration>
//	    health_timeout   <duration>
//	    health_fails     <n>
//	    health_passes    <n>
//	    health_status    <code>
//	    health_body      <regexp>
//	    stall_factor     <factor>
//	    max_fails        <n>
//	    fail_window      <duration>
//	    eject_time       <duration>
//	    max_eject_time   <duration>
//	    min_ready        <n>
//	    retry_on         <status...>
//	    dashboard        on|off
//	}
//
// workers, admin_allow, weights_path_prefix and retry_on may repeat; each
// adds to the list. retry_on configures the reverse_proxy that the
// directive generates, so the handler's JSON has no field for it. Sizes read like Caddy's
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
	if f, ok := listOptions[opt]; ok {
		return f(h, d, args)
	}
	if len(args) != 1 {
		return d.Errf("%s takes exactly one value, got %d", opt, len(args))
	}
	v := args[0]
	if field, ok := intOptions[opt]; ok {
		n, err := positiveInt(d, opt, v)
		*field(h) = n
		return err
	}
	if field, ok := durationOptions[opt]; ok {
		dur, err := positiveDuration(d, opt, v)
		*field(h) = dur
		return err
	}
	if f, ok := oneValueOptions[opt]; ok {
		return f(h, d, v)
	}
	return d.Errf("unknown diffusion_router option %q (options: %s)", opt, strings.Join(optionNames(), ", "))
}

// Options that take one positive whole number.
var intOptions = map[string]func(*Handler) *int{
	"max_queue":      func(h *Handler) *int { return &h.MaxQueue },
	"default_steps":  func(h *Handler) *int { return &h.DefaultSteps },
	"default_frames": func(h *Handler) *int { return &h.DefaultFrames },
	"rolling_batch":  func(h *Handler) *int { return &h.RollingBatch },
	"health_fails":   func(h *Handler) *int { return &h.HealthFails },
	"health_passes":  func(h *Handler) *int { return &h.HealthPasses },
	"max_fails":      func(h *Handler) *int { return &h.MaxFails },
	"min_ready":      func(h *Handler) *int { return &h.MinReady },
}

// Options that take one positive duration.
var durationOptions = map[string]func(*Handler) *caddy.Duration{
	"queue_timeout":    func(h *Handler) *caddy.Duration { return &h.QueueTimeout },
	"upstream_timeout": func(h *Handler) *caddy.Duration { return &h.UpstreamTimeout },
	"drain_timeout":    func(h *Handler) *caddy.Duration { return &h.DrainTimeout },
	"weights_timeout":  func(h *Handler) *caddy.Duration { return &h.WeightsTimeout },
	"health_interval":  func(h *Handler) *caddy.Duration { return &h.HealthInterval },
	"health_timeout":   func(h *Handler) *caddy.Duration { return &h.HealthTimeout },
	"fail_window":      func(h *Handler) *caddy.Duration { return &h.FailWindow },
	"eject_time":       func(h *Handler) *caddy.Duration { return &h.EjectTime },
	"max_eject_time":   func(h *Handler) *caddy.Duration { return &h.MaxEjectTime },
}

// Options that take one value of their own kind.
var oneValueOptions = map[string]func(*Handler, *caddyfile.Dispenser, string) error{
	"policy": func(h *Handler, d *caddyfile.Dispenser, v string) error {
		if _, ok := strategies[v]; !ok {
			return d.Errf("unknown policy %q (want one of %s)", v, strategyNames())
		}
		h.Policy = v
		return nil
	},
	"max_inflight": func(h *Handler, d *caddyfile.Dispenser, v string) error {
		if v == "unlimited" {
			h.MaxInflight = -1
			return nil
		}
		n, err := positiveInt(d, "max_inflight", v)
		h.MaxInflight = n
		return err
	},
	"queue_order": func(h *Handler, d *caddyfile.Dispenser, v string) error {
		if _, ok := queueOrders[v]; !ok {
			return d.Errf("unknown queue_order %q (want fifo, largest_first or smallest_first)", v)
		}
		h.QueueOrder = v
		return nil
	},
	"default_size": func(h *Handler, d *caddyfile.Dispenser, v string) error {
		if _, _, err := parseSize(v); err != nil {
			return d.Errf("default_size: %q is not WIDTHxHEIGHT like 1024x1024", v)
		}
		h.DefaultSize = v
		return nil
	},
	"cfg_factor": func(h *Handler, d *caddyfile.Dispenser, v string) error {
		f, err := atLeastOne(d, "cfg_factor", v)
		h.CFGFactor = f
		return err
	},
	"stall_factor": func(h *Handler, d *caddyfile.Dispenser, v string) error {
		f, err := atLeastOne(d, "stall_factor", v)
		h.StallFactor = f
		return err
	},
	"max_body": func(h *Handler, d *caddyfile.Dispenser, v string) error {
		size, err := humanize.ParseBytes(v)
		if err != nil || size == 0 || size > math.MaxInt64 {
			return d.Errf("max_body: %q is not a positive size like 64MiB", v)
		}
		h.MaxBody = int64(size)
		return nil
	},
	"dashboard": func(h *Handler, d *caddyfile.Dispenser, v string) error {
		if v != "on" && v != "off" {
			return d.Errf("dashboard: %q is neither on nor off", v)
		}
		h.DashboardOff = v == "off"
		return nil
	},
	"admin_token": func(h *Handler, _ *caddyfile.Dispenser, v string) error {
		h.AdminToken = v
		return nil
	},
	"weights_mode": func(h *Handler, d *caddyfile.Dispenser, v string) error {
		if v != modeDrain && v != modeRolling {
			return d.Errf("unknown weights_mode %q (want drain or rolling)", v)
		}
		h.WeightsMode = v
		return nil
	},
	"health_uri": func(h *Handler, d *caddyfile.Dispenser, v string) error {
		if !strings.HasPrefix(v, "/") {
			return d.Errf("health_uri: %q is not a path", v)
		}
		h.HealthURI = v
		return nil
	},
	"health_status": func(h *Handler, d *caddyfile.Dispenser, v string) error {
		n, err := strconv.Atoi(v)
		if err != nil || n < 100 || n > 599 {
			return d.Errf("health_status: %q is not an HTTP status code", v)
		}
		h.HealthStatus = n
		return nil
	},
	"health_body": func(h *Handler, d *caddyfile.Dispenser, v string) error {
		if _, err := regexp.Compile(v); err != nil {
			return d.Errf("health_body: %v", err)
		}
		h.HealthBody = v
		return nil
	},
}

// Options that take a list of values; they may repeat and add up.
var listOptions = map[string]func(*Handler, *caddyfile.Dispenser, []string) error{
	"workers": func(h *Handler, d *caddyfile.Dispenser, args []string) error {
		for _, a := range args {
			if _, err := normalizeWorkerURL(a); err != nil {
				return d.Errf("workers: %q: %v", a, err)
			}
		}
		h.Workers = append(h.Workers, args...)
		return nil
	},
	"admin_allow": func(h *Handler, d *caddyfile.Dispenser, args []string) error {
		if _, err := parsePrefixes(args); err != nil {
			return d.Err(err.Error())
		}
		h.AdminAllow = append(h.AdminAllow, args...)
		return nil
	},
	"weights_path_prefix": func(h *Handler, d *caddyfile.Dispenser, args []string) error {
		for _, a := range args {
			if !strings.HasPrefix(a, "/") && !strings.Contains(a, "://") {
				return d.Errf("weights_path_prefix: %q is neither an absolute path nor a URL prefix", a)
			}
		}
		h.WeightsPathPrefix = append(h.WeightsPathPrefix, args...)
		return nil
	},
	"retry_on": func(h *Handler, d *caddyfile.Dispenser, args []string) error {
		for _, a := range args {
			n, err := strconv.Atoi(a)
			if err != nil || n < 400 || n > 599 {
				return d.Errf("retry_on: %q is not an error status code (400-599)", a)
			}
			h.retryOn = append(h.retryOn, n)
		}
		return nil
	},
}

// optionNames lists the handler's Caddyfile options for error messages.
func optionNames() []string {
	names := []string{"reverse_proxy"}
	names = append(names, slices.Collect(maps.Keys(intOptions))...)
	names = append(names, slices.Collect(maps.Keys(durationOptions))...)
	names = append(names, slices.Collect(maps.Keys(oneValueOptions))...)
	names = append(names, slices.Collect(maps.Keys(listOptions))...)
	slices.Sort(names)
	return names
}

// atLeastOne reads option opt's value v as a number of at least 1.
func atLeastOne(d *caddyfile.Dispenser, opt, v string) (float64, error) {
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || f < 1 || math.IsInf(f, 0) {
		return 0, d.Errf("%s: %q is not a number of at least 1", opt, v)
	}
	return f, nil
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
