package diffusionrouter

import (
	"encoding/json"
	"maps"
	"math"
	"net/http"
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
// upstreams and the diffusion selection policy. Jobs run again on another
// worker by the handler's own rules (max_attempts), not reverse_proxy's
// retries, which would queue them behind newer jobs and buffer their
// bodies a second time.
//
// Responses keep Caddy's flush_interval: they stream through without being
// held whole, and Caddy flushes at once the ones that are streams (unknown
// length, server-sent events). Forcing -1 flushed the headers and each body
// write of every answer separately: two or three writes to the client where
// one does, the largest cost of proxying a small answer.
func wireProxy(rp *reverseproxy.Handler, h *Handler) {
	pool := h.Pool
	rp.DynamicUpstreamsRaw = caddyconfig.JSONModuleObject(DiffusionUpstreams{poolRef{Pool: pool}}, "source", "diffusion", nil)
	if rp.LoadBalancing == nil {
		rp.LoadBalancing = new(reverseproxy.LoadBalancing)
	}
	rp.LoadBalancing.SelectionPolicyRaw = caddyconfig.JSONModuleObject(DiffusionSelection{poolRef{Pool: pool}}, "policy", "diffusion", nil)
	guardTransport(rp)
	workerHost(rp)
}

// guardTransport makes the proxy dial through the diffusion transport,
// which refuses addresses that are never workers. Options given for
// Caddy's http transport carry over unchanged: the diffusion transport is
// the http transport with a guard.
func guardTransport(rp *reverseproxy.Handler) {
	if rp.TransportRaw == nil {
		rp.TransportRaw = caddyconfig.JSONModuleObject(struct{}{}, "protocol", "diffusion", nil)
		return
	}
	var t map[string]json.RawMessage
	if json.Unmarshal(rp.TransportRaw, &t) == nil && string(t["protocol"]) == `"http"` {
		t["protocol"] = json.RawMessage(`"diffusion"`)
		rp.TransportRaw = caddyconfig.JSON(t, nil)
	}
}

// workerHost keeps each request's Host the worker's own host:port, which
// the diffusion policy sets (see DiffusionSelection.Select), when the
// block has header_up operations: reverse_proxy applies them to the
// client's headers and Host, so they must set it again, unless they set a
// Host of their own. Without them, the block needs none.
func workerHost(rp *reverseproxy.Handler) {
	if rp.Headers == nil || rp.Headers.Request == nil {
		return
	}
	if rp.Headers.Request.Set == nil {
		rp.Headers.Request.Set = http.Header{}
	}
	if rp.Headers.Request.Set.Get("Host") == "" {
		rp.Headers.Request.Set.Set("Host", "{http.reverse_proxy.upstream.hostport}")
	}
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. The
// options are flat in the Caddyfile and grouped in the JSON config (shown
// in brackets). Syntax:
//
//	diffusion_router [<pool>] {
//	    workers          <url...>
//
//	    # finding workers through DNS or the Kubernetes API (discovery)
//	    workers_dns      <name> <port>
//	    workers_srv      <name>
//	    dns_refresh      <duration>
//	    dns_resolvers    <host:port...>
//	    workers_kubernetes {
//	        namespace    <namespace>
//	        service      <name>
//	        selector     <label selector>
//	        port         <number>|<port name>
//	        address_type IPv4|IPv6
//	        kubeconfig   <file>
//	    }
//
//	    # choosing a worker (load_balancing) and waiting for one (queue)
//	    policy           least_work|least_request|round_robin|random
//	    max_inflight     <n>|unlimited
//	    max_attempts     <n>
//	    retry_on         <status...>
//	    hedge_after      <factor>|off
//	    initial_speed    <units per second>
//	    queue_order      adaptive|fifo|largest_first|smallest_first
//	    queue_timeout    <duration>
//	    max_queue        <n>
//	    priority         <placeholder>
//	    max_priority     <n>
//	    priority_max_wait <duration>|off
//	    abort_memory     <duration>|off
//	    tenant           <placeholder>
//	    tenants          <name...>
//	    tenant_weight    <name> <weight>
//	    tenant_max_queue <n>
//	    max_tenants      <n>
//
//	    # LoRA policies and their placement (adapters, placement)
//	    adapter          <name> <lora_path> [<strength>]
//	    adapter_from     <placeholder>
//	    adapter_switch_prior <duration>
//	    adapter_max_switches <n>
//	    adapter_turn     <duration>
//	    adapter_switch_timeout <duration>
//	    adapter_retry    <duration>
//
//	    # the cost of a job (cost)
//	    default_steps    <n>
//	    default_size     <width>x<height>
//	    default_frames   <n>
//	    cfg_factor       <factor>
//	    max_pixels       <n>
//
//	    # active health checks (health_checks.active)
//	    health_uri       <path>
//	    health_interval  <duration>
//	    health_timeout   <duration>
//	    health_fails     <n>
//	    health_passes    <n>
//	    health_status    <code>
//	    health_body      <regexp>
//
//	    # passive health checks (health_checks.passive)
//	    max_fails        <n>
//	    fail_window      <duration>
//	    eject_time       <duration>
//	    max_eject_time   <duration>
//	    max_ejection_percent <percent>
//	    stall_factor     <factor>
//	    min_ready        <n>
//
//	    # weight updates, sleep and wake (weights)
//	    weights_mode     drain|rolling
//	    rolling_batch    <n>
//	    drain_timeout    <duration>
//	    weights_timeout  <duration>
//	    weights_path_prefix <prefix...>
//	    version_policy   latest|max_staleness <k>
//
//	    # who may change the fleet (admin)
//	    admin_allow      <cidr|ip...>
//	    admin_token      <token>
//
//	    # answers held back until they are whole (answers)
//	    max_held_answer  <size>|off
//	    max_held_total   <size>
//	    answer_stall_timeout <duration>
//
//	    # one active router among several that share the pool (ha.etcd)
//	    ha etcd <endpoint...> {
//	        key_prefix <prefix>
//	        lease_ttl  <duration>
//	        advertise  <url>
//	        tls {
//	            ca          <pem file>
//	            client_cert <cert file> <key file>
//	            server_name <name>
//	        }
//	    }
//
//	    # requests
//	    forward_paths    <path|prefix*|sglang...>
//	    max_workers      <n>
//	    max_body         <size>
//	    max_body_total   <size>
//	    body_timeout     <duration>
//	    upstream_timeout <duration>
//	    dashboard        on|off
//	    persist          on|off
//	}
//
// workers, workers_dns, workers_srv, workers_kubernetes, dns_resolvers, admin_allow,
// weights_path_prefix, forward_paths, retry_on, tenants, tenant_weight and
// adapter may repeat; each adds to the list. Sizes read like Caddy's
// request_body max_size (64MiB, 10MB, 1048576). Factors, weights and
// strengths are plain decimals (2, 0.8): not NaN, Inf, hex or digits split
// by underscores.
//
// Parsing checks the syntax only: the option is known, its value is a
// number, duration or size where one is needed, and not zero (which the
// JSON config reads as "the default"). Everything else, such as a known
// policy name or a valid worker URL, is checked when the config is
// provisioned.
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

// unmarshalOption reads one handler option.
func (h *Handler) unmarshalOption(d *caddyfile.Dispenser) error {
	name := d.Val()
	opt, ok := handlerOptions[name]
	if !ok {
		return d.Errf("unknown diffusion_router option %q (options: %s)", name, strings.Join(optionNames(), ", "))
	}
	args := d.RemainingArgs()
	switch {
	case opt.block && len(args) > 0:
		return d.Errf("%s takes a block, not %q", name, args[0])
	case len(args) == 0 && !opt.block:
		return d.Errf("%s needs a value", name)
	case !opt.list && len(args) > 1:
		return d.Errf("%s takes exactly one value, got %d", name, len(args))
	}
	return opt.read(h, d, name, args)
}

// option reads one Caddyfile option into the handler.
type option struct {
	list  bool // takes several values and may repeat; they add up
	block bool // takes a block and no value; may repeat, each block one more
	read  func(h *Handler, d *caddyfile.Dispenser, name string, args []string) error
}

// handlerOptions are the handler's Caddyfile options, grouped as the JSON
// config groups them.
var handlerOptions = map[string]option{
	"workers": several(func(h *Handler) *[]string { return &h.Workers }),

	"workers_dns":        {list: true, read: readWorkersDNS},
	"workers_srv":        {list: true, read: readWorkersSRV},
	"workers_kubernetes": {block: true, read: readWorkersKubernetes},
	"dns_refresh":        one(func(h *Handler) *caddy.Duration { return &h.Discovery.Refresh }, parseDuration),
	"dns_resolvers":      several(func(h *Handler) *[]string { return &h.Discovery.Resolvers }),

	"policy":            one(func(h *Handler) *string { return &h.LoadBalancing.Policy }, parseText),
	"max_inflight":      one(func(h *Handler) *int { return &h.LoadBalancing.MaxInflight }, orWord("unlimited", -1, parseWhole)),
	"queue_order":       one(func(h *Handler) *string { return &h.Queue.Order }, parseText),
	"queue_timeout":     one(func(h *Handler) *caddy.Duration { return &h.Queue.Timeout }, parseDuration),
	"max_queue":         one(func(h *Handler) *int { return &h.Queue.MaxJobs }, parseWhole),
	"priority":          one(func(h *Handler) *string { return &h.Queue.Priority }, parseText),
	"max_priority":      one(func(h *Handler) *int { return &h.Queue.MaxPriority }, parseWhole),
	"priority_max_wait": one(func(h *Handler) *caddy.Duration { return &h.Queue.PriorityMaxWait }, orWord("off", caddy.Duration(-1), parseDuration)),
	"abort_memory":      one(func(h *Handler) *caddy.Duration { return &h.Queue.AbortMemory }, orWord("off", caddy.Duration(-1), parseDuration)),
	"tenant":            one(func(h *Handler) *string { return &h.Queue.Tenant }, parseText),
	"tenants":           several(func(h *Handler) *[]string { return &h.Queue.Tenants }),
	"tenant_weight":     {list: true, read: readTenantWeight},
	"tenant_max_queue":  one(func(h *Handler) *int { return &h.Queue.TenantMaxQueue }, parseWhole),
	"max_tenants":       one(func(h *Handler) *int { return &h.Queue.MaxTenants }, parseWhole),

	"default_steps":  one(func(h *Handler) *int { return &h.Cost.DefaultSteps }, parseWhole),
	"default_size":   one(func(h *Handler) *string { return &h.Cost.DefaultSize }, parseText),
	"default_frames": one(func(h *Handler) *int { return &h.Cost.DefaultFrames }, parseWhole),
	"cfg_factor":     one(func(h *Handler) *float64 { return &h.Cost.CFGFactor }, parseNumber),
	"max_pixels":     one(func(h *Handler) *int { return &h.Cost.MaxPixels }, parseWhole),

	"health_uri":      one(func(h *Handler) *string { return &h.HealthChecks.Active.URI }, parseText),
	"health_interval": one(func(h *Handler) *caddy.Duration { return &h.HealthChecks.Active.Interval }, parseDuration),
	"health_timeout":  one(func(h *Handler) *caddy.Duration { return &h.HealthChecks.Active.Timeout }, parseDuration),
	"health_fails":    one(func(h *Handler) *int { return &h.HealthChecks.Active.Fails }, parseWhole),
	"health_passes":   one(func(h *Handler) *int { return &h.HealthChecks.Active.Passes }, parseWhole),
	"health_status":   one(func(h *Handler) *int { return &h.HealthChecks.Active.ExpectStatus }, parseWhole),
	"health_body":     one(func(h *Handler) *string { return &h.HealthChecks.Active.ExpectBody }, parseText),

	"max_fails":            one(func(h *Handler) *int { return &h.HealthChecks.Passive.MaxFails }, parseWhole),
	"fail_window":          one(func(h *Handler) *caddy.Duration { return &h.HealthChecks.Passive.FailWindow }, parseDuration),
	"eject_time":           one(func(h *Handler) *caddy.Duration { return &h.HealthChecks.Passive.EjectTime }, parseDuration),
	"max_eject_time":       one(func(h *Handler) *caddy.Duration { return &h.HealthChecks.Passive.MaxEjectTime }, parseDuration),
	"max_ejection_percent": one(func(h *Handler) *int { return &h.HealthChecks.Passive.MaxEjectionPercent }, parseWhole),
	"stall_factor":         one(func(h *Handler) *float64 { return &h.HealthChecks.Passive.StallFactor }, parseNumber),
	"min_ready":            one(func(h *Handler) *int { return &h.HealthChecks.MinReady }, parseWhole),

	"weights_mode":        one(func(h *Handler) *string { return &h.Weights.Mode }, parseText),
	"rolling_batch":       one(func(h *Handler) *int { return &h.Weights.RollingBatch }, parseWhole),
	"drain_timeout":       one(func(h *Handler) *caddy.Duration { return &h.Weights.DrainTimeout }, parseDuration),
	"weights_timeout":     one(func(h *Handler) *caddy.Duration { return &h.Weights.Timeout }, parseDuration),
	"weights_path_prefix": several(func(h *Handler) *[]string { return &h.Weights.PathPrefixes }),
	"version_policy":      {list: true, read: readVersionPolicy},

	"admin_allow": several(func(h *Handler) *[]string { return &h.Admin.Allow }),
	"admin_token": one(func(h *Handler) *string { return &h.Admin.Token }, parseText),

	"max_held_answer":      one(func(h *Handler) *int64 { return &h.Answers.MaxHeld }, orWord("off", int64(-1), parseByteSize)),
	"max_held_total":       one(func(h *Handler) *int64 { return &h.Answers.MaxHeldTotal }, parseByteSize),
	"answer_stall_timeout": one(func(h *Handler) *caddy.Duration { return &h.Answers.StallTimeout }, parseDuration),

	"forward_paths":          several(func(h *Handler) *[]string { return &h.ForwardPaths }),
	"max_workers":            one(func(h *Handler) *int { return &h.MaxWorkers }, parseWhole),
	"adapter":                {list: true, read: readAdapter},
	"adapter_from":           one(func(h *Handler) *string { return &h.AdapterFrom }, parseText),
	"adapter_switch_prior":   one(func(h *Handler) *caddy.Duration { return &h.Placement.SwitchPrior }, parseDuration),
	"adapter_max_switches":   one(func(h *Handler) *int { return &h.Placement.MaxSwitches }, parseWhole),
	"adapter_turn":           one(func(h *Handler) *caddy.Duration { return &h.Placement.Turn }, parseDuration),
	"adapter_switch_timeout": one(func(h *Handler) *caddy.Duration { return &h.Placement.SwitchTimeout }, parseDuration),
	"adapter_retry":          one(func(h *Handler) *caddy.Duration { return &h.Placement.Retry }, parseDuration),
	"max_body":               one(func(h *Handler) *int64 { return &h.MaxBody }, parseByteSize),
	"max_body_total":         one(func(h *Handler) *int64 { return &h.MaxBodyTotal }, parseByteSize),
	"body_timeout":           one(func(h *Handler) *caddy.Duration { return &h.BodyTimeout }, parseDuration),
	"upstream_timeout":       one(func(h *Handler) *caddy.Duration { return &h.UpstreamTimeout }, parseDuration),
	"dashboard":              one(func(h *Handler) *bool { return &h.DashboardOff }, parseOff),
	"persist":                one(func(h *Handler) *bool { return &h.PersistOff }, parseOff),
	"retry_on":               {list: true, read: readRetryOn},
	"max_attempts":           one(func(h *Handler) *int { return &h.LoadBalancing.MaxAttempts }, parseWhole),
	"hedge_after":            one(func(h *Handler) *float64 { return &h.LoadBalancing.HedgeAfter }, parseHedgeAfter),
	"initial_speed":          one(func(h *Handler) *float64 { return &h.LoadBalancing.InitialSpeed }, parseNumber),
	"ha":                     {list: true, read: readHA},
}

// one is an option of one value, read by parse into the field. parse
// reports what the value should have been when it is not.
func one[T any](field func(*Handler) *T, parse func(string) (T, string)) option {
	return option{read: func(h *Handler, d *caddyfile.Dispenser, name string, args []string) error {
		v, want := parse(args[0])
		if want != "" {
			return d.Errf("%s: %q is not %s", name, args[0], want)
		}
		*field(h) = v
		return nil
	}}
}

// several is an option of several values that add up.
func several(field func(*Handler) *[]string) option {
	return option{list: true, read: func(h *Handler, _ *caddyfile.Dispenser, _ string, args []string) error {
		*field(h) = append(*field(h), args...)
		return nil
	}}
}

// A value of zero would read as "the default" in the JSON config, so the
// parsers refuse it: leaving the option out says that.

func parseText(v string) (string, string) { return v, "" }

func parseWhole(v string) (int, string) {
	n, err := strconv.Atoi(v)
	if err != nil || n == 0 {
		return 0, "a whole number other than 0"
	}
	return n, ""
}

func parseNumber(v string) (float64, string) {
	const want = "a plain decimal number other than 0, like 0.8"
	if !plainDecimal(v) {
		return 0, want
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || f == 0 {
		return 0, want
	}
	return f, ""
}

// plainDecimal says v is digits with at most one point and an optional
// sign. ParseFloat alone also takes NaN, Inf, hex and digits split by
// underscores ("1_0" reads as 10), none of which an operator means: NaN
// and Inf cannot even be written into the JSON config.
func plainDecimal(v string) bool {
	if v != "" && (v[0] == '+' || v[0] == '-') {
		v = v[1:]
	}
	whole, frac, _ := strings.Cut(v, ".")
	return whole+frac != "" && onlyDigits(whole) && onlyDigits(frac)
}

func onlyDigits(s string) bool { return strings.Trim(s, "0123456789") == "" }

func parseDuration(v string) (caddy.Duration, string) {
	dur, err := caddy.ParseDuration(v)
	if err != nil || dur == 0 {
		return 0, "a duration like 10m, other than 0"
	}
	return caddy.Duration(dur), ""
}

func parseByteSize(v string) (int64, string) {
	size, err := humanize.ParseBytes(v)
	if err != nil || size == 0 || size > math.MaxInt64 {
		return 0, "a positive size like 64MiB"
	}
	return int64(size), ""
}

// orWord reads word as value (a JSON value of its own, such as -1), and
// anything else as parse does.
func orWord[T any](word string, value T, parse func(string) (T, string)) func(string) (T, string) {
	return func(v string) (T, string) {
		if v == word {
			return value, ""
		}
		n, want := parse(v)
		if want != "" {
			want += ", or " + word
		}
		return n, want
	}
}

// parseOff reads on|off into an option that is on by default.
func parseOff(v string) (bool, string) {
	if v != "on" && v != "off" {
		return false, "on or off"
	}
	return v == "off", ""
}

// readWorkersDNS reads `workers_dns <name> <port>`: one name per line, as
// each has its port.
func readWorkersDNS(h *Handler, d *caddyfile.Dispenser, name string, args []string) error {
	if len(args) != 2 {
		return d.Errf("%s takes a name and a port: %s <name> <port>", name, name)
	}
	port, want := parseWhole(args[1])
	if want != "" {
		return d.Errf("%s: port %q is not %s", name, args[1], want)
	}
	h.Discovery.A = append(h.Discovery.A, DNSName{Name: args[0], Port: port})
	return nil
}

// readWorkersSRV reads `workers_srv <name>`, one name per line like
// workers_dns.
func readWorkersSRV(h *Handler, d *caddyfile.Dispenser, name string, args []string) error {
	if len(args) != 1 {
		return d.Errf("%s takes one name per line: %s <name>", name, name)
	}
	h.Discovery.SRV = append(h.Discovery.SRV, args[0])
	return nil
}

// readWorkersKubernetes reads a `workers_kubernetes { ... }` block, one
// lookup of EndpointSlices.
func readWorkersKubernetes(h *Handler, d *caddyfile.Dispenser, name string, _ []string) error {
	var k KubernetesLookup
	fields := map[string]*string{
		"namespace": &k.Namespace, "service": &k.Service, "selector": &k.Selector,
		"port": &k.Port, "address_type": &k.AddressType, "kubeconfig": &k.Kubeconfig,
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub, vals := d.Val(), d.RemainingArgs()
		field, ok := fields[sub]
		switch {
		case !ok:
			return d.Errf("unknown %s option %q (options: %s)", name, sub, strings.Join(slices.Sorted(maps.Keys(fields)), ", "))
		case len(vals) != 1:
			return d.Errf("%s %s takes exactly one value, got %d", name, sub, len(vals))
		case *field != "":
			return d.Errf("%s %s is given twice", name, sub)
		}
		*field = vals[0]
	}
	h.Discovery.Kubernetes = append(h.Discovery.Kubernetes, k)
	return nil
}

// readTenantWeight reads `tenant_weight <name> <weight>`, one tenant per
// line.
func readTenantWeight(h *Handler, d *caddyfile.Dispenser, name string, args []string) error {
	if len(args) != 2 {
		return d.Errf("%s takes a tenant and a weight: %s <name> <weight>", name, name)
	}
	w, want := parseNumber(args[1])
	if want != "" {
		return d.Errf("%s: weight %q is not %s", name, args[1], want)
	}
	if h.Queue.TenantWeights == nil {
		h.Queue.TenantWeights = map[string]float64{}
	}
	h.Queue.TenantWeights[args[0]] = w
	return nil
}

// readAdapter reads an adapter: its name, path and, optionally, strength.
func readAdapter(h *Handler, d *caddyfile.Dispenser, name string, args []string) error {
	if len(args) != 2 && len(args) != 3 {
		return d.Errf("%s takes a name, a path and optionally a strength: %s <name> <lora_path> [<strength>]", name, name)
	}
	a := Adapter{Name: args[0], Path: args[1]}
	if len(args) == 3 {
		var want string
		if a.Strength, want = parseNumber(args[2]); want != "" {
			return d.Errf("%s: strength %q is not %s", name, args[2], want)
		}
	}
	h.Adapters = append(h.Adapters, a)
	return nil
}

// readVersionPolicy reads `version_policy latest` or `version_policy
// max_staleness <k>` as the JSON config writes it, one string; its
// provisioning checks it.
func readVersionPolicy(h *Handler, d *caddyfile.Dispenser, name string, args []string) error {
	if len(args) > 2 {
		return d.Errf("%s takes latest or max_staleness <k>, got %d values", name, len(args))
	}
	h.Weights.VersionPolicy = strings.Join(args, " ")
	return nil
}

// readRetryOn reads retry_on's status codes.
func readRetryOn(h *Handler, d *caddyfile.Dispenser, name string, args []string) error {
	for _, a := range args {
		n, err := strconv.Atoi(a)
		if err != nil {
			return d.Errf("%s: %q is not a status code", name, a)
		}
		h.LoadBalancing.RetryOn = append(h.LoadBalancing.RetryOn, n)
	}
	return nil
}

// parseHedgeAfter reads hedge_after: a factor, or off (-1 in JSON).
func parseHedgeAfter(v string) (float64, string) {
	if v == "off" {
		return -1, ""
	}
	f, want := parseNumber(v)
	if want != "" {
		return 0, "a number or off"
	}
	return f, ""
}

// readHA reads `ha etcd <endpoint...>` and its optional block.
func readHA(h *Handler, d *caddyfile.Dispenser, name string, args []string) error {
	if args[0] != "etcd" {
		return d.Errf("%s: %q is not a kind of election; the one there is: %s etcd <endpoint...>", name, args[0], name)
	}
	if h.HA.Etcd != nil {
		return d.Errf("%s is given twice; list every etcd endpoint on one line", name)
	}
	e := &EtcdElection{Endpoints: args[1:]}
	h.HA.Etcd = e
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub := d.Val()
		if sub == "tls" {
			if err := readEtcdTLS(e, d); err != nil {
				return err
			}
			continue
		}
		vals := d.RemainingArgs()
		if len(vals) != 1 {
			return d.Errf("%s %s takes exactly one value, got %d", name, sub, len(vals))
		}
		switch sub {
		case "key_prefix":
			e.KeyPrefix = vals[0]
		case "advertise":
			e.Advertise = vals[0]
		case "lease_ttl":
			ttl, want := parseDuration(vals[0])
			if want != "" {
				return d.Errf("%s lease_ttl: %q is not %s", name, vals[0], want)
			}
			e.LeaseTTL = ttl
		default:
			return d.Errf("unknown %s etcd option %q (options: advertise, key_prefix, lease_ttl, tls)", name, sub)
		}
	}
	return nil
}

// readEtcdTLS reads the tls block of `ha etcd`.
func readEtcdTLS(e *EtcdElection, d *caddyfile.Dispenser) error {
	if d.NextArg() {
		return d.Errf("ha etcd tls takes a block, not %q", d.Val())
	}
	t := new(EtcdTLS)
	e.TLS = t
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub, vals := d.Val(), d.RemainingArgs()
		switch {
		case sub == "client_cert" && len(vals) == 2:
			t.ClientCert, t.ClientKey = vals[0], vals[1]
		case sub == "client_cert":
			return d.Errf("ha etcd tls client_cert takes a certificate file and a key file")
		case sub != "ca" && sub != "server_name":
			return d.Errf("unknown ha etcd tls option %q (options: ca, client_cert, server_name)", sub)
		case len(vals) != 1:
			return d.Errf("ha etcd tls %s takes exactly one value, got %d", sub, len(vals))
		case sub == "ca":
			t.CA = vals[0]
		default:
			t.ServerName = vals[0]
		}
	}
	return nil
}

// optionNames lists the handler's Caddyfile options for error messages.
func optionNames() []string {
	names := append(slices.Collect(maps.Keys(handlerOptions)), "reverse_proxy")
	slices.Sort(names)
	return names
}

// Interface guards
var _ caddyfile.Unmarshaler = (*Handler)(nil)
