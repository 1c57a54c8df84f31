package diffusionrouter

import (
	"encoding/json"
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
		`"retries":2`,
		`"flush_interval":-1`,
	} {
		if !strings.Contains(cfg, want) {
			t.Errorf("adapted config lacks %s:\n%s", want, cfg)
		}
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
		default_steps 30
		default_size 768x1344
		default_frames 33
		cfg_factor 1.5
		max_body 8MiB
		admin_allow 10.0.0.0/8 192.168.1.7
		admin_token {env.ROUTER_TOKEN}
		upstream_timeout 30m
		weights_mode rolling
		rolling_batch 2
		drain_timeout 5m
		weights_timeout 15m
		weights_path_prefix /ckpt/ s3://bucket/
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
		min_ready 2
		retry_on 500 503
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
		Pool:              "rollout",
		Workers:           []string{"http://10.0.0.1:30000", "https://10.0.0.2:30000"},
		Policy:            "round_robin",
		MaxInflight:       2,
		QueueOrder:        "largest_first",
		QueueTimeout:      caddy.Duration(90 * time.Second),
		MaxQueue:          500,
		DefaultSteps:      30,
		DefaultSize:       "768x1344",
		DefaultFrames:     33,
		CFGFactor:         1.5,
		MaxBody:           8 << 20,
		AdminAllow:        []string{"10.0.0.0/8", "192.168.1.7"},
		AdminToken:        "{env.ROUTER_TOKEN}",
		UpstreamTimeout:   caddy.Duration(30 * time.Minute),
		WeightsMode:       "rolling",
		RollingBatch:      2,
		DrainTimeout:      caddy.Duration(5 * time.Minute),
		WeightsTimeout:    caddy.Duration(15 * time.Minute),
		WeightsPathPrefix: []string{"/ckpt/", "s3://bucket/"},
		HealthURI:         "/health_generate",
		HealthInterval:    caddy.Duration(30 * time.Second),
		HealthTimeout:     caddy.Duration(2 * time.Minute),
		HealthFails:       5,
		HealthPasses:      1,
		HealthStatus:      200,
		HealthBody:        `"ok"`,
		StallFactor:       3.5,
		MaxFails:          4,
		FailWindow:        caddy.Duration(time.Minute),
		EjectTime:         caddy.Duration(20 * time.Second),
		MaxEjectTime:      caddy.Duration(10 * time.Minute),
		MinReady:          2,
	}
	got, _ := json.Marshal(h)
	exp, _ := json.Marshal(want)
	if string(got) != string(exp) {
		t.Fatalf("handler = %s\nwant      %s", got, exp)
	}
	for _, want := range []string{
		`"dial_timeout":3000000000`,
		`"X-Rollout":["yes"]`,
		`"dynamic_upstreams":{"pool":"rollout","source":"diffusion"}`,
		`"selection_policy":{"policy":"diffusion","pool":"rollout"}`,
		`"match":[{"path":["/v1/*"]}]`,
		`"retry_match":[{"expression":"{http.reverse_proxy.status_code} in [500, 503]"}]`,
		`"request_buffers":8388608`,
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
		}
	}`)
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(cfg, `"handler":"reverse_proxy"`); n != 1 {
		t.Fatalf("long form has %d reverse_proxy handlers; want only the user's:\n%s", n, cfg)
	}
	if !strings.Contains(cfg, `"dynamic_upstreams":{"source":"diffusion"}`) || !strings.Contains(cfg, `"selection_policy":{"policy":"diffusion"}`) {
		t.Fatalf("explicit reverse_proxy not wired to the pool:\n%s", cfg)
	}
}

func TestCaddyfileBadInputNamesLine(t *testing.T) {
	cases := map[string]string{
		"unknown option":       "frobnicate yes",
		"bad worker":           "workers ftp://10.0.0.1",
		"worker with path":     "workers http://10.0.0.1:1/v1",
		"unknown policy":       "policy fastest",
		"two policies":         "policy random round_robin",
		"bad size":             "max_body lots",
		"zero size":            "max_body 0",
		"bad cidr":             "admin_allow 10.0.0.0/99",
		"bad duration":         "upstream_timeout soon",
		"negative duration":    "upstream_timeout -5s",
		"missing value":        "admin_token",
		"proxy sets upstreams": "reverse_proxy {\n to 10.0.0.1:1\n }",
		"proxy sets policy":    "reverse_proxy {\n lb_policy first\n }",
		"proxy with address":   "reverse_proxy 10.0.0.1:1",
		"zero max_inflight":    "max_inflight 0",
		"bad max_inflight":     "max_inflight many",
		"unknown queue_order":  "queue_order random",
		"bad queue_timeout":    "queue_timeout forever",
		"negative max_queue":   "max_queue -1",
		"zero default_steps":   "default_steps 0",
		"bad default_size":     "default_size big",
		"zero default_size":    "default_size 0x1024",
		"bad default_frames":   "default_frames 1.5",
		"cfg_factor below 1":   "cfg_factor 0.5",
		"bad cfg_factor":       "cfg_factor double",
		"unknown weights_mode": "weights_mode eager",
		"zero rolling_batch":   "rolling_batch 0",
		"bad drain_timeout":    "drain_timeout never",
		"bad weights_timeout":  "weights_timeout 0s",
		"relative prefix":      "weights_path_prefix ckpt",
		"relative health_uri":  "health_uri health",
		"bad health_interval":  "health_interval often",
		"zero health_fails":    "health_fails 0",
		"bad health_status":    "health_status 700",
		"bad health_body":      "health_body (unclosed",
		"stall_factor below 1": "stall_factor 0.5",
		"bad max_fails":        "max_fails x",
		"bad eject_time":       "eject_time -1s",
		"zero min_ready":       "min_ready 0",
		"retry_on success":     "retry_on 200",
		"retry_on word":        "retry_on errors",
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
		"policy":      {Policy: "fastest"},
		"worker":      {Workers: []string{"http://169.254.169.254"}},
		"allow":       {AdminAllow: []string{"nope"}},
		"empty token": {AdminToken: "{env.DIFFUSION_ROUTER_UNSET_VAR}"},
		"max body":    {MaxBody: -1},
		"inflight":    {MaxInflight: -2},
		"order":       {QueueOrder: "lifo"},
		"queue":       {MaxQueue: -1},
		"size":        {DefaultSize: "1024"},
		"cfg":         {CFGFactor: 0.5},
		"steps":       {DefaultSteps: -3},
		"mode":        {WeightsMode: "eager"},
		"batch":       {RollingBatch: -1},
		"health uri":  {HealthURI: "health"},
		"regexp":      {HealthBody: "(x"},
		"eject":       {EjectTime: caddy.Duration(time.Hour)}, // beyond max_eject_time
		"status":      {HealthStatus: 42},
	} {
		if err := h.parseOptions(); err == nil {
			t.Errorf("%s: bad config accepted", name)
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

func TestMaxInflightDefaultsByPolicy(t *testing.T) {
	for _, tc := range []struct {
		h    Handler
		want int
	}{
		{Handler{}, 1},
		{Handler{Policy: "least_work", MaxInflight: -1}, 0},
		{Handler{Policy: "least_work", MaxInflight: 3}, 3},
		{Handler{Policy: "least_request"}, 0},
		{Handler{Policy: "round_robin", MaxInflight: 2}, 2},
	} {
		if err := tc.h.parseOptions(); err != nil || tc.h.dispatch.maxInflight != tc.want {
			t.Errorf("%s/%d: max_inflight %d (%v); want %d", tc.h.Policy, tc.h.MaxInflight, tc.h.dispatch.maxInflight, err, tc.want)
		}
	}
}
