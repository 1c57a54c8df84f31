package diffusionrouter

import (
	"encoding/json"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/standard"
)

// adapt turns a site body into JSON config the way `caddy adapt` does.
func adapt(t *testing.T, site string) (string, error) {
	t.Helper()
	cf := ":8080 {\n" + site + "\n}\n"
	cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(cf), map[string]any{"filename": "Caddyfile"})
	return string(cfg), err
}

func TestCaddyfileShortFormExpands(t *testing.T) {
	cfg, err := adapt(t, `diffusion_router {
		workers http://127.0.0.1:30001 http://127.0.0.1:30002
	}`)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`{"handler":"diffusion_router","workers":["http://127.0.0.1:30001","http://127.0.0.1:30002"]}`,
		`"dynamic_upstreams":{"source":"diffusion"}`,
		`"selection_policy":{"policy":"diffusion"}`,
		`"transport":{"protocol":"diffusion"}`,
	} {
		if !strings.Contains(cfg, want) {
			t.Errorf("adapted config lacks %s:\n%s", want, cfg)
		}
	}
	// The diffusion policy gives each request its worker's Host: a header
	// operation would make reverse_proxy copy every request's headers.
	if strings.Contains(cfg, `"headers"`) {
		t.Errorf("adapted config has header operations; the short form needs none:\n%s", cfg)
	}
	if strings.Contains(cfg, "flush_interval") {
		t.Errorf("adapted config sets flush_interval; Caddy's own flushing is the default:\n%s", cfg)
	}
}

func TestCaddyfileEveryOption(t *testing.T) {
	cfg, err := adapt(t, `diffusion_router @gen rollout {
		workers http://10.0.0.1:30000
		workers https://10.0.0.2:30000
		policy round_robin
		max_inflight 2
		queue_order largest_first
		queue_timeout 90s
		max_queue 500
		priority {http.request.header.X-Priority}
		max_priority 5
		priority_max_wait 30s
		abort_memory 10m
		tenant {http.request.header.X-Tenant}
		tenants trainer eval
		tenants ci
		tenant_weight trainer 2
		tenant_weight eval 0.5
		tenant_max_queue 100
		max_tenants 16
		default_steps 30
		default_size 768x1344
		default_frames 33
		cfg_factor 1.5
		max_pixels 4194304
		max_body 8MiB
		max_body_total 512MiB
		body_timeout 5m
		admin_allow 10.0.0.0/8 192.168.1.7
		admin_token {env.ROUTER_TOKEN}
		upstream_timeout 30m
		weights_mode rolling
		rolling_batch 2
		drain_timeout 5m
		weights_timeout 15m
		weights_path_prefix /ckpt/ s3://bucket/
		version_policy max_staleness 2
		workers_dns workers.rollout.svc.cluster.local 30000
		workers_dns video-workers.rollout.svc.cluster.local. 30001
		workers_srv _http._tcp.workers.rollout.svc.cluster.local
		dns_refresh 30s
		dns_resolvers 10.96.0.10:53 10.96.0.11
		workers_kubernetes {
			namespace prod
			service engines
			port http
		}
		workers_kubernetes {
			selector app=video-engines
			port 30001
			address_type IPv6
			kubeconfig /etc/router/kubeconfig
		}
		health_uri /health_generate
		health_interval 30s
		health_timeout 2m
		health_fails 5
		health_passes 1
		health_status 200
		health_body "\"ok\""
		stall_factor 3.5
		max_fails 4
		fail_window 1m
		eject_time 20s
		max_eject_time 10m
		max_ejection_percent 25
		min_ready 2
		retry_on 500 503
		max_attempts 2
		hedge_after 3
		initial_speed 4.5
		max_held_answer 48MiB
		max_held_total 1GiB
		adapter policy-a /ckpt/lora/a
		adapter policy-b /ckpt/lora/b 0.8
		adapter_from {http.request.header.X-Policy}
		adapter_switch_prior 20s
		adapter_max_switches 2
		adapter_turn 45s
		adapter_switch_timeout 2m
		adapter_retry 10s
		reverse_proxy {
			transport http {
				dial_timeout 3s
			}
			header_up X-Rollout yes
		}
	}
	@gen path /v1/*`)
	if err != nil {
		t.Fatal(err)
	}
	h := handlerFrom(t, cfg)
	want := Handler{
		Pool:    "rollout",
		Workers: []string{"http://10.0.0.1:30000", "https://10.0.0.2:30000"},
		Discovery: Discovery{
			A: []DNSName{
				{Name: "workers.rollout.svc.cluster.local", Port: 30000},
				{Name: "video-workers.rollout.svc.cluster.local.", Port: 30001},
			},
			SRV:       []string{"_http._tcp.workers.rollout.svc.cluster.local"},
			Refresh:   caddy.Duration(30 * time.Second),
			Resolvers: []string{"10.96.0.10:53", "10.96.0.11"},
			Kubernetes: []KubernetesLookup{
				{Namespace: "prod", Service: "engines", Port: "http"},
				{Selector: "app=video-engines", Port: "30001", AddressType: "IPv6", Kubeconfig: "/etc/router/kubeconfig"},
			},
		},
		LoadBalancing: LoadBalancing{Policy: "round_robin", MaxInflight: 2, MaxAttempts: 2, RetryOn: []int{500, 503}, HedgeAfter: 3, InitialSpeed: 4.5},
		Queue: Queue{
			Order: "largest_first", Timeout: caddy.Duration(90 * time.Second), MaxJobs: 500,
			Priority: "{http.request.header.X-Priority}", MaxPriority: 5, PriorityMaxWait: caddy.Duration(30 * time.Second),
			AbortMemory: caddy.Duration(10 * time.Minute),
			Tenant:      "{http.request.header.X-Tenant}", Tenants: []string{"trainer", "eval", "ci"}, TenantWeights: map[string]float64{"trainer": 2, "eval": 0.5},
			TenantMaxQueue: 100, MaxTenants: 16,
		},
		Cost: CostModel{DefaultSteps: 30, DefaultSize: "768x1344", DefaultFrames: 33, CFGFactor: 1.5, MaxPixels: 4194304},
		HealthChecks: HealthChecks{
			Active: ActiveHealthChecks{
				URI: "/health_generate", Interval: caddy.Duration(30 * time.Second), Timeout: caddy.Duration(2 * time.Minute),
				Fails: 5, Passes: 1, ExpectStatus: 200, ExpectBody: `"ok"`,
			},
			Passive: PassiveHealthChecks{
				MaxFails: 4, FailWindow: caddy.Duration(time.Minute), EjectTime: caddy.Duration(20 * time.Second),
				MaxEjectTime: caddy.Duration(10 * time.Minute), MaxEjectionPercent: 25, StallFactor: 3.5,
			},
			MinReady: 2,
		},
		Weights: Weights{
			Mode: "rolling", RollingBatch: 2, DrainTimeout: caddy.Duration(5 * time.Minute),
			Timeout: caddy.Duration(15 * time.Minute), PathPrefixes: []string{"/ckpt/", "s3://bucket/"},
			VersionPolicy: "max_staleness 2",
		},
		Admin:           Admin{Allow: []string{"10.0.0.0/8", "192.168.1.7"}, Token: "{env.ROUTER_TOKEN}"},
		Answers:         Answers{MaxHeld: 48 << 20, MaxHeldTotal: 1 << 30},
		MaxBody:         8 << 20,
		MaxBodyTotal:    512 << 20,
		BodyTimeout:     caddy.Duration(5 * time.Minute),
		UpstreamTimeout: caddy.Duration(30 * time.Minute),
		Adapters:        []Adapter{{Name: "policy-a", Path: "/ckpt/lora/a"}, {Name: "policy-b", Path: "/ckpt/lora/b", Strength: 0.8}},
		AdapterFrom:     "{http.request.header.X-Policy}",
		Placement: Placement{
			SwitchPrior: caddy.Duration(20 * time.Second), MaxSwitches: 2, Turn: caddy.Duration(45 * time.Second),
			SwitchTimeout: caddy.Duration(2 * time.Minute), Retry: caddy.Duration(10 * time.Second),
		},
	}
	got, _ := json.Marshal(h)
	exp, _ := json.Marshal(want)
	if string(got) != string(exp) {
		t.Fatalf("handler = %s\nwant      %s", got, exp)
	}
	for _, want := range []string{
		`"dial_timeout":3000000000`,
		`"protocol":"diffusion"`,
		`"X-Rollout":["yes"]`,
		`"dynamic_upstreams":{"pool":"rollout","source":"diffusion"}`,
		`"selection_policy":{"policy":"diffusion","pool":"rollout"}`,
		`"match":[{"path":["/v1/*"]}]`,
	} {
		if !strings.Contains(cfg, want) {
			t.Errorf("adapted config lacks %s:\n%s", want, cfg)
		}
	}
}

func TestCaddyfileLongForm(t *testing.T) {
	cfg, err := adapt(t, `route {
		diffusion_router {
			workers http://127.0.0.1:30001
			reverse_proxy external
		}
		reverse_proxy {
			dynamic diffusion
			lb_policy diffusion
			header_up Host {upstream_hostport}
			transport diffusion {
				response_header_timeout 30m
			}
		}
	}`)
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(cfg, `"handler":"reverse_proxy"`); n != 1 {
		t.Fatalf("long form has %d reverse_proxy handlers; want only the user's:\n%s", n, cfg)
	}
	if !strings.Contains(cfg, `"protocol":"diffusion","response_header_timeout":1800000000000`) {
		t.Fatalf("transport diffusion does not take the http transport's options:\n%s", cfg)
	}
	if !strings.Contains(cfg, `"dynamic_upstreams":{"source":"diffusion"}`) || !strings.Contains(cfg, `"selection_policy":{"policy":"diffusion"}`) {
		t.Fatalf("explicit reverse_proxy not wired to the pool:\n%s", cfg)
	}
}

func TestCaddyfileBadSyntaxNamesLine(t *testing.T) {
	cases := map[string]string{
		"unknown option":            "frobnicate yes",
		"unknown option, two words": "workers_consul a b",
		"two policies":              "policy random round_robin",
		"bad size":                  "max_body lots",
		"zero size":                 "max_body 0",
		"zero max_body_total":       "max_body_total 0",
		"bad body_timeout":          "body_timeout slow",
		"bad duration":              "upstream_timeout soon",
		"missing value":             "admin_token",
		"proxy sets upstreams":      "reverse_proxy {\n to 10.0.0.1:1\n }",
		"proxy sets policy":         "reverse_proxy {\n lb_policy first\n }",
		"proxy with address":        "reverse_proxy 10.0.0.1:1",
		"zero max_inflight":         "max_inflight 0",
		"bad max_inflight":          "max_inflight many",
		"bad queue_timeout":         "queue_timeout forever",
		"bad abort_memory":          "abort_memory long",
		"zero abort_memory":         "abort_memory 0s",
		"zero default_steps":        "default_steps 0",
		"bad default_frames":        "default_frames 1.5",
		"bad cfg_factor":            "cfg_factor double",
		"zero max_pixels":           "max_pixels 0",
		"zero rolling_batch":        "rolling_batch 0",
		"bad drain_timeout":         "drain_timeout never",
		"zero weights_timeout":      "weights_timeout 0s",
		"bad health_interval":       "health_interval often",
		"zero health_fails":         "health_fails 0",
		"bad max_fails":             "max_fails x",
		"zero min_ready":            "min_ready 0",
		"bad dashboard":             "dashboard maybe",
		"retry_on word":             "retry_on errors",
		"workers_dns without port":  "workers_dns workers.rollout.svc",
		"workers_dns word port":     "workers_dns workers.rollout.svc http",
		"workers_dns zero port":     "workers_dns workers.rollout.svc 0",
		"workers_dns three values":  "workers_dns workers.rollout.svc 30000 30001",
		"workers_srv two names":     "workers_srv _http._tcp.a _http._tcp.b",
		"bad dns_refresh":           "dns_refresh often",
		"zero dns_refresh":          "dns_refresh 0s",
		"missing dns_resolvers":     "dns_resolvers",
		"bad max_held_answer":       "max_held_answer all",
		"zero max_held_total":       "max_held_total 0",
		"max_held_total off":        "max_held_total off",
		"version_policy three":      "version_policy max_staleness 1 2",
		"workers_kubernetes value":  "workers_kubernetes engines",
	}
	for name, line := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := adapt(t, "diffusion_router {\n"+line+"\n}")
			if err == nil {
				t.Fatalf("%q adapted without error", line)
			}
			if !strings.Contains(err.Error(), "Caddyfile:3") {
				t.Fatalf("error %q does not name Caddyfile line 3", err)
			}
		})
	}
	for block, says := range map[string]string{
		"service engines\nnamespaces prod": `unknown workers_kubernetes option "namespaces"`,
		"service":                          "workers_kubernetes service takes exactly one value, got 0",
		"service a\nservice b":             "workers_kubernetes service is given twice",
		"port 1 2":                         "workers_kubernetes port takes exactly one value, got 2",
	} {
		if _, err := adapt(t, "diffusion_router {\nworkers_kubernetes {\n"+block+"\n}\n}"); err == nil || !strings.Contains(err.Error(), says) {
			t.Errorf("workers_kubernetes {%s}: %v; want an error saying %q", block, err, says)
		}
	}
	_, err := adapt(t, "diffusion_router {\nworkers_consul a b\n}")
	if err == nil || !strings.Contains(err.Error(), `unknown diffusion_router option "workers_consul"`) {
		t.Errorf("unknown option with two values: %v; want it called unknown", err)
	}
}

// TestNumbersArePlainDecimals: strconv alone reads NaN and Inf (which
// then cannot be written as JSON, so the handler adapted to null) and
// reads "1_0" as 10. Each is an error naming the option and its line.
func TestNumbersArePlainDecimals(t *testing.T) {
	for _, line := range []string{
		"adapter a /ckpt/x NaN", "adapter a /ckpt/x Inf", "adapter a /ckpt/x -Inf", "adapter a /ckpt/x 1_0",
		"adapter a /ckpt/x 0x1p-2", "cfg_factor infinity", "tenant_weight trainer 1_0", "hedge_after NaN",
	} {
		_, err := adapt(t, "diffusion_router {\n"+line+"\n}")
		option := strings.Fields(line)[0]
		if err == nil || !strings.Contains(err.Error(), "Caddyfile:3") || !strings.Contains(err.Error(), option) {
			t.Errorf("%q: adapting said %v; want an error naming %s on Caddyfile line 3", line, err, option)
		}
	}
	cfg, err := adapt(t, "diffusion_router {\nadapter a /ckpt/x 0.8\ncfg_factor 2\n}")
	if err != nil {
		t.Fatal(err)
	}
	if h := handlerFrom(t, cfg); h.Adapters[0].Strength != 0.8 || h.Cost.CFGFactor != 2 {
		t.Fatalf("plain decimals adapted to strength %v, cfg_factor %v", h.Adapters[0].Strength, h.Cost.CFGFactor)
	}
}

// TestBadValuesNameTheOption adapts options whose syntax is right but
// whose values are not, and provisions them: the error names the option
// as the Caddyfile and as the JSON config spell it.
func TestBadValuesNameTheOption(t *testing.T) {
	cases := []struct{ line, want string }{
		{"workers ftp://10.0.0.1", "workers (workers):"},
		{"workers http://10.0.0.1:1/v1", "workers (workers):"},
		{"policy fastest", "policy (load_balancing.policy): unknown policy"},
		{"max_inflight -2", "max_inflight (load_balancing.max_inflight):"},
		{"queue_order random", "queue_order (queue.order): unknown order"},
		{"queue_timeout -1s", "queue_timeout (queue.timeout):"},
		{"max_queue -1", "max_queue (queue.max_jobs):"},
		{"max_priority -1", "max_priority (queue.max_priority):"},
		{"priority_max_wait -2s", "priority_max_wait (queue.priority_max_wait):"},
		{"abort_memory -2s", "abort_memory (queue.abort_memory):"},
		{"tenant_weight a/b 2", "tenant_weight (queue.tenant_weights): \"a/b\" is not a tenant name"},
		{"tenant_weight trainer -1", "tenant_weight (queue.tenant_weights): the weight of \"trainer\" must be a positive number"},
		{"tenant_max_queue -1", "tenant_max_queue (queue.tenant_max_queue):"},
		{"max_tenants -1", "max_tenants (queue.max_tenants):"},
		{"tenant x\ntenants a a/b", "tenants (queue.tenants): \"a/b\" is not a tenant name"},
		{"tenants a b", "tenants (queue.tenants): lists tenants, but no tenant option says where"},
		{"tenant x\ntenants a\ntenant_weight b 2", "tenant_weight (queue.tenant_weights): \"b\" is not on tenants"},
		{"tenant x\ntenants a b c\nmax_tenants 2", "max_tenants (queue.max_tenants): is 2, fewer than the 3 tenants listed"},
		{"default_steps -3", "default_steps (cost.default_steps):"},
		{"default_size big", "default_size (cost.default_size):"},
		{"default_size 0x1024", "default_size (cost.default_size):"},
		{"default_frames -1", "default_frames (cost.default_frames):"},
		{"cfg_factor 0.5", "cfg_factor (cost.cfg_factor):"},
		{"max_pixels -1", "max_pixels (cost.max_pixels):"},
		{"max_pixels 4096", "default_size (cost.default_size): 1024x1024 is more pixels than max_pixels (4096)"},
		{"admin_allow 10.0.0.0/99", "admin_allow (admin.allow):"},
		{"admin_token {env.DIFFUSION_ROUTER_UNSET_VAR}", "admin_token (admin.token):"},
		{"upstream_timeout -5s", "upstream_timeout (upstream_timeout):"},
		{"weights_mode eager", "weights_mode (weights.Mode): unknown mode"},
		{"rolling_batch -1", "rolling_batch (weights.rolling_batch):"},
		{"drain_timeout -1m", "drain_timeout (weights.drain_timeout):"},
		{"weights_path_prefix ckpt", "weights_path_prefix (weights.path_prefixes):"},
		{"version_policy newest", `version_policy (weights.version_policy): "newest" is neither latest nor max_staleness <k>`},
		{"version_policy max_staleness", `version_policy (weights.version_policy): "max_staleness" is neither latest`},
		{"version_policy max_staleness x", `version_policy (weights.version_policy): "max_staleness x" is neither latest`},
		{"version_policy max_staleness -1", "version_policy (weights.version_policy): the staleness bound must be 0 to 1000, got -1"},
		{"version_policy max_staleness 1001", "version_policy (weights.version_policy): the staleness bound must be 0 to 1000, got 1001"},
		{"version_policy latest 1", `version_policy (weights.version_policy): "latest 1" is neither latest`},
		{"health_uri health", "health_uri (health_checks.active.uri):"},
		{"health_interval -1s", "health_interval (health_checks.active.interval):"},
		{"health_fails -1", "health_fails (health_checks.active.fails):"},
		{"health_status 700", "health_status (health_checks.active.expect_status):"},
		{"health_body (unclosed", "health_body (health_checks.active.expect_body):"},
		{"stall_factor 0.5", "stall_factor (health_checks.passive.stall_factor):"},
		{"max_fails -4", "max_fails (health_checks.passive.max_fails):"},
		{"max_ejection_percent 101", "max_ejection_percent (health_checks.passive.max_ejection_percent): must be 1 to 100"},
		{"max_ejection_percent -5", "max_ejection_percent (health_checks.passive.max_ejection_percent): must be 1 to 100"},
		{"eject_time -1s", "eject_time (health_checks.passive.eject_time):"},
		{"eject_time 1h", "max_eject_time (health_checks.passive.max_eject_time): must be at least eject_time"},
		{"min_ready -1", "min_ready (health_checks.min_ready):"},
		{"forward_paths v1", "forward_paths (forward_paths):"},
		{"forward_paths /v1/*/x", "forward_paths (forward_paths):"},
		{"max_workers -1", "max_workers (max_workers):"},
		{"adapter a/b /l/a", "adapter (adapters): \"a/b\" is not an adapter name"},
		{"adapter a /l/a\nadapter a /l/b", "adapter (adapters): \"a\" is declared twice"},
		{"adapter a /l/a -1", "adapter (adapters): the strength of \"a\" must be a positive number"},
		{"weights_path_prefix /ckpt/\nadapter a /tmp/a", "adapter (adapters): the path of \"a\":"},
		{"adapter_switch_prior -1s", "adapter_switch_prior (placement.switch_prior):"},
		{"adapter_max_switches -1", "adapter_max_switches (placement.max_switches):"},
		{"adapter_turn -1s", "adapter_turn (placement.turn):"},
		{"adapter_switch_timeout -1s", "adapter_switch_timeout (placement.switch_timeout):"},
		{"adapter_retry -1s", "adapter_retry (placement.retry):"},
		{"max_attempts -1", "max_attempts (load_balancing.max_attempts):"},
		{"retry_on 200", "retry_on (load_balancing.retry_on): 200 is not an error status code"},
		{"hedge_after 0.5", "hedge_after (load_balancing.hedge_after):"},
		{"initial_speed -1", "initial_speed (load_balancing.initial_speed): must be a positive number"},
		{"workers_dns http://workers.rollout.svc 30000", "workers_dns (discovery.a): \"http://workers.rollout.svc\": is not a DNS name"},
		{"workers_dns 10.0.0.1 30000", "workers_dns (discovery.a): \"10.0.0.1\": is an address, not a name to look up"},
		{"workers_dns workers.rollout.svc 70000", "workers_dns (discovery.a): port 70000 of workers.rollout.svc is not a number from 1 to 65535"},
		{"workers_srv _http._tcp..svc", "workers_srv (discovery.srv): \"_http._tcp..svc\": is not a DNS name"},
		{"workers_srv w\ndns_resolvers 10.0.0.10:dns", "dns_resolvers (discovery.resolvers):"},
		{"workers_srv w\ndns_resolvers 10.0.0.10:53-54", "dns_resolvers (discovery.resolvers):"},
		{"workers_srv w\ndns_refresh -1s", "dns_refresh (discovery.refresh): must be positive"},
		{"dns_refresh 30s", "dns_refresh (discovery.refresh): is set, but no workers_dns or workers_srv names a lookup"},
		{"workers_kubernetes {\nnamespace prod\n}", "workers_kubernetes (discovery.kubernetes): service or selector"},
		{"workers_kubernetes {\nservice engines\nselector app=engines\n}", "workers_kubernetes (discovery.kubernetes): service and selector: give one, not both"},
		{"workers_kubernetes {\nselector app==,\n}", "workers_kubernetes (discovery.kubernetes): selector"},
		{"workers_kubernetes {\nservice engines\nport 70000\n}", "workers_kubernetes (discovery.kubernetes): port 70000"},
		{"workers_kubernetes {\nservice engines\nport no_such-port!\n}", "workers_kubernetes (discovery.kubernetes): port"},
		{"workers_kubernetes {\nservice engines\naddress_type FQDN\n}", "workers_kubernetes (discovery.kubernetes): address_type"},
		{"workers_kubernetes {\nservice engines\nkubeconfig /nonexistent/kubeconfig\n}", "workers_kubernetes (discovery.kubernetes): kubeconfig /nonexistent/kubeconfig"},
		{"dns_resolvers 10.0.0.10", "dns_resolvers (discovery.resolvers): are set, but no workers_dns or workers_srv names a lookup"},
	}
	for _, tc := range cases {
		t.Run(tc.line, func(t *testing.T) {
			cfg, err := adapt(t, "diffusion_router {\n"+tc.line+"\n}")
			if err != nil {
				t.Fatalf("%q: the syntax is right, yet adapting failed: %v", tc.line, err)
			}
			h := handlerFrom(t, cfg)
			err = h.provisionOptions()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("%q: provisioning said %v; want an error containing %q", tc.line, err, tc.want)
			}
		})
	}
}

func TestSelectorAndSourceCaddyfile(t *testing.T) {
	for _, tc := range []struct {
		tokens string
		pool   string
		ok     bool
	}{
		{"diffusion", "", true},
		{"diffusion rollout", "rollout", true},
		{"diffusion a b", "", false},
		{"diffusion {\n strategy x\n}", "", false},
	} {
		var s DiffusionSelection
		err := s.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.tokens))
		if (err == nil) != tc.ok || (tc.ok && s.Pool != tc.pool) {
			t.Errorf("lb_policy %s: pool=%q err=%v", tc.tokens, s.Pool, err)
		}
		var u DiffusionUpstreams
		err = u.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.tokens))
		if (err == nil) != tc.ok || (tc.ok && u.Pool != tc.pool) {
			t.Errorf("dynamic %s: pool=%q err=%v", tc.tokens, u.Pool, err)
		}
	}
}

func TestProvisionRejectsBadJSONConfig(t *testing.T) {
	for name, h := range map[string]Handler{
		"max body":                 {MaxBody: -1},
		"body total below max":     {MaxBody: 8 << 20, MaxBodyTotal: 4 << 20},
		"body total below default": {MaxBody: 512 << 20, MaxBodyTotal: 256 << 20},
		"body timeout":             {BodyTimeout: -1},
		"health":                   {HealthChecks: HealthChecks{Active: ActiveHealthChecks{ExpectStatus: 42}}},
		"passive":                  {HealthChecks: HealthChecks{Passive: PassiveHealthChecks{StallFactor: math.Inf(1)}}},
		"weights":                  {Weights: Weights{Timeout: -1}},
		"held":                     {Answers: Answers{MaxHeld: -2}},
		"total":                    {Answers: Answers{MaxHeldTotal: -1}},
	} {
		if err := h.provisionOptions(); err == nil {
			t.Errorf("%s: bad config accepted", name)
		}
	}
}

func TestTheBodyBudgetIsNeverBelowMaxBody(t *testing.T) {
	h := Handler{MaxBody: 8 << 20, MaxBodyTotal: 4 << 20}
	err := h.provisionOptions()
	if err == nil || !strings.Contains(err.Error(), "max_body_total (max_body_total): must be at least max_body (8388608 bytes), got 4194304") {
		t.Errorf("a budget below max_body: %v", err)
	}
	h = Handler{MaxBody: 7 << 20 * 64} // 448 MiB
	if err := h.provisionOptions(); err != nil || h.MaxBodyTotal != 512<<20 {
		t.Errorf("with max_body 448MiB and no budget: %v, budget %d; want 512MiB, which keeps an eighth beside it", err, h.MaxBodyTotal)
	}
}

func TestProvisionFillsDefaults(t *testing.T) {
	var h Handler
	if err := h.provisionOptions(); err != nil {
		t.Fatal(err)
	}
	got, _ := json.Marshal(h)
	for _, want := range []string{
		`"pool":"default"`,
		`"load_balancing":{"policy":"least_work","max_attempts":3,"hedge_after":5,"initial_speed":1}`,
		`"queue":{"order":"adaptive","max_jobs":10000,"max_priority":10,"priority_max_wait":60000000000,"abort_memory":300000000000,"max_tenants":64}`,
		`"cost":{"default_steps":20,"default_size":"1024x1024","default_frames":96,"cfg_factor":2,"max_pixels":16777216}`,
		`"active":{"uri":"/health","interval":10000000000,"timeout":5000000000,"fails":3,"passes":2}`,
		`"min_ready":1`,
		`"weights":{"mode":"drain","rolling_batch":1,"drain_timeout":600000000000,"timeout":600000000000}`,
		`"max_body":67108864,"max_body_total":268435456,"body_timeout":60000000000`,
		`"answers":{"max_held":33554432,"max_held_total":268435456,"stall_timeout":30000000000}`,
		`"placement":{"switch_prior":30000000000,"max_switches":4,"turn":60000000000,"switch_timeout":60000000000,"retry":5000000000}`,
	} {
		if !strings.Contains(string(got), want) {
			t.Errorf("provisioned handler lacks %s:\n%s", want, got)
		}
	}
}

// handlerFrom digs the diffusion_router handler out of an adapted config.
func handlerFrom(t *testing.T, cfg string) Handler {
	t.Helper()
	var config struct {
		Apps struct {
			HTTP struct {
				Servers map[string]struct {
					Routes []struct {
						Handle []json.RawMessage `json:"handle"`
					} `json:"routes"`
				} `json:"servers"`
			} `json:"http"`
		} `json:"apps"`
	}
	if err := json.Unmarshal([]byte(cfg), &config); err != nil {
		t.Fatal(err)
	}
	for _, srv := range config.Apps.HTTP.Servers {
		for _, route := range srv.Routes {
			for _, raw := range route.Handle {
				var h Handler
				if strings.Contains(string(raw), `"handler":"diffusion_router"`) && json.Unmarshal(raw, &h) == nil {
					return h
				}
			}
		}
	}
	t.Fatalf("no diffusion_router handler in %s", cfg)
	return Handler{}
}

func TestMaxHeldAnswerOff(t *testing.T) {
	cfg, err := adapt(t, "diffusion_router {\nmax_held_answer off\n}")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(cfg, `"answers":{"max_held":-1}`) {
		t.Fatalf("max_held_answer off adapted to %s; want answers.max_held -1", cfg)
	}
	h := handlerFrom(t, cfg)
	if err := h.provisionOptions(); err != nil {
		t.Fatal(err)
	}
	if _, err := h.attempts.Budget.Hold(1); err == nil {
		t.Fatal("max_held_answer off, yet an answer of 1 byte is held")
	}
}

func TestAbortMemoryOff(t *testing.T) {
	cfg, err := adapt(t, "diffusion_router {\nabort_memory off\n}")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(cfg, `"queue":{"abort_memory":-1}`) {
		t.Fatalf("abort_memory off adapted to %s; want queue.abort_memory -1", cfg)
	}
	h := handlerFrom(t, cfg)
	if err := h.provisionOptions(); err != nil || h.Queue.AbortMemory != -1 {
		t.Fatalf("abort_memory off provisioned as %d (%v)", h.Queue.AbortMemory, err)
	}
}

// hedge_after off reaches the pool as no hedging at all; that a job then
// gets no copy however long it overruns is internal/attempt's
// TestHedgingOffGivesAHungJobNoCopy.
func TestHedgeAfterOff(t *testing.T) {
	cfg, err := adapt(t, "diffusion_router {\nhedge_after off\n}")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(cfg, `"hedge_after":-1`) {
		t.Fatalf("hedge_after off adapted to %s; want load_balancing.hedge_after -1", cfg)
	}
	h := handlerFrom(t, cfg)
	if err := h.provisionOptions(); err != nil || h.dispatch.HedgeAfter != 0 {
		t.Fatalf("hedge_after off provisioned as %g (%v); want 0, no copies", h.dispatch.HedgeAfter, err)
	}
}

func TestMaxInflightDefaultsByPolicy(t *testing.T) {
	for _, tc := range []struct {
		h    Handler
		want int
	}{
		{Handler{}, 1},
		{Handler{LoadBalancing: LoadBalancing{Policy: "least_work", MaxInflight: -1}}, 0},
		{Handler{LoadBalancing: LoadBalancing{Policy: "least_work", MaxInflight: 3}}, 3},
		{Handler{LoadBalancing: LoadBalancing{Policy: "least_request"}}, 0},
		{Handler{LoadBalancing: LoadBalancing{Policy: "round_robin", MaxInflight: 2}}, 2},
	} {
		lb := tc.h.LoadBalancing
		if err := tc.h.provisionOptions(); err != nil || tc.h.dispatch.MaxInflight != tc.want {
			t.Errorf("%s/%d: max_inflight %d (%v); want %d", lb.Policy, lb.MaxInflight, tc.h.dispatch.MaxInflight, err, tc.want)
		}
	}
}

// Every tenant listed is tracked: a list longer than max_tenants' default
// raises it, so that no listed tenant shares other.
func TestTenantListRaisesMaxTenants(t *testing.T) {
	h := Handler{Queue: Queue{Tenant: "{http.auth.user.id}"}}
	for i := range 100 {
		h.Queue.Tenants = append(h.Queue.Tenants, fmt.Sprint("team-", i))
	}
	if err := h.provisionOptions(); err != nil {
		t.Fatal(err)
	}
	if h.dispatch.MaxTenants != 100 {
		t.Fatalf("max_tenants with 100 tenants listed: %d; want 100", h.dispatch.MaxTenants)
	}
}
