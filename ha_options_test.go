package diffusionrouter

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestCaddyfileHA(t *testing.T) {
	cfg, err := adapt(t, `diffusion_router rollout {
		ha etcd https://etcd-0:2379 https://etcd-1:2379 {
			key_prefix /rollout
			lease_ttl 3s
			advertise http://router-0.router:8080
			tls {
				ca /etc/etcd/ca.pem
				client_cert /etc/etcd/router.pem /etc/etcd/router-key.pem
				server_name etcd.cluster
			}
		}
	}`)
	if err != nil {
		t.Fatal(err)
	}
	want := `"ha":{"etcd":{"advertise":"http://router-0.router:8080","endpoints":["https://etcd-0:2379","https://etcd-1:2379"],"key_prefix":"/rollout","lease_ttl":3000000000,` +
		`"tls":{"ca":"/etc/etcd/ca.pem","client_cert":"/etc/etcd/router.pem","client_key":"/etc/etcd/router-key.pem","server_name":"etcd.cluster"}}}`
	if !strings.Contains(cfg, want) {
		t.Fatalf("adapted config lacks %s:\n%s", want, cfg)
	}
}

// The block may be left out: the defaults are key_prefix
// /diffusion-router and lease_ttl 5s, and the election is
// /diffusion-router/<pool>.
func TestHAWithoutBlockTakesTheDefaults(t *testing.T) {
	cfg, err := adapt(t, "diffusion_router rollout {\nha etcd http://etcd-0:2379 http://etcd-1:2379\n}")
	if err != nil {
		t.Fatal(err)
	}
	h := handlerFrom(t, cfg)
	if err := h.provisionOptions(); err != nil {
		t.Fatal(err)
	}
	got, _ := json.Marshal(h.HA)
	if want := `{"etcd":{"endpoints":["http://etcd-0:2379","http://etcd-1:2379"],"key_prefix":"/diffusion-router","lease_ttl":5000000000}}`; string(got) != want {
		t.Fatalf("provisioned ha is %s; want %s", got, want)
	}
	c := h.ha.Config
	if c.Pool != "rollout" || c.KeyPrefix != "/diffusion-router" || c.LeaseTTL != 5*time.Second || c.TLS != nil || c.Identity != "" {
		t.Fatalf("election config %+v", c)
	}
}

// Without `ha` there is no election: the JSON has no ha and the pool's
// election holds no campaign.
func TestNoHAByDefault(t *testing.T) {
	cfg, err := adapt(t, "diffusion_router {\nworkers http://10.0.0.1:30000\n}")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(cfg, `"ha"`) {
		t.Fatalf("adapted config has ha without the option:\n%s", cfg)
	}
	h := handlerFrom(t, cfg)
	if err := h.provisionOptions(); err != nil || h.ha != nil {
		t.Fatalf("provisioned without ha: err %v, election %+v", err, h.ha)
	}
	if e := newElection(nil, nil); !e.Leading() || e.Leader() != "" || e.inGroup() {
		t.Fatal("an election without a campaign does not say the router leads alone")
	}
}

// The JSON twin, as a config written by hand gives it.
func TestHAFromJSON(t *testing.T) {
	var h Handler
	raw := `{"pool":"rollout","ha":{"etcd":{"endpoints":["https://etcd:2379"],"lease_ttl":"2s","advertise":"https://{env.HA_TEST_HOST}:8443"}}}`
	if err := json.Unmarshal([]byte(raw), &h); err != nil {
		t.Fatal(err)
	}
	t.Setenv("HA_TEST_HOST", "router-1")
	if err := h.provisionOptions(); err != nil {
		t.Fatal(err)
	}
	c := h.ha.Config
	if c.Identity != "https://router-1:8443" || c.LeaseTTL != 2*time.Second || c.TLS == nil || c.KeyPrefix != "/diffusion-router" {
		t.Fatalf("election config %+v", c)
	}
}

func TestHABadSyntaxNamesLine(t *testing.T) {
	cases := map[string]string{
		"not etcd":             "ha consul http://consul:8500",
		"twice":                "ha etcd http://a:2379\nha etcd http://b:2379",
		"unknown sub-option":   "ha etcd http://a:2379 {\nttl 5s\n}",
		"bad lease_ttl":        "ha etcd http://a:2379 {\nlease_ttl soon\n}",
		"zero lease_ttl":       "ha etcd http://a:2379 {\nlease_ttl 0s\n}",
		"key_prefix no value":  "ha etcd http://a:2379 {\nkey_prefix\n}",
		"advertise two values": "ha etcd http://a:2379 {\nadvertise http://a http://b\n}",
		"tls with a value":     "ha etcd https://a:2379 {\ntls on\n}",
		"tls unknown option":   "ha etcd https://a:2379 {\ntls {\ninsecure yes\n}\n}",
		"client_cert one file": "ha etcd https://a:2379 {\ntls {\nclient_cert /c.pem\n}\n}",
		"ca two files":         "ha etcd https://a:2379 {\ntls {\nca /a.pem /b.pem\n}\n}",
	}
	for name, lines := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := adapt(t, "diffusion_router {\n"+lines+"\n}")
			if err == nil || !strings.Contains(err.Error(), "Caddyfile:") || !strings.Contains(err.Error(), "ha") {
				t.Fatalf("%q: adapting said %v; want an error naming ha and its line", lines, err)
			}
		})
	}
}

func TestHABadValuesNameTheOption(t *testing.T) {
	dir := t.TempDir()
	notPEM := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(notPEM, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	cases := []struct{ lines, want string }{
		{"ha etcd", "ha etcd (ha.etcd.endpoints): needs at least one etcd endpoint"},
		{"ha etcd etcd:2379", `ha etcd (ha.etcd.endpoints): "etcd:2379" is not an etcd client URL`},
		{"ha etcd ftp://etcd:2379", `ha etcd (ha.etcd.endpoints): "ftp://etcd:2379" is not an etcd client URL`},
		{"ha etcd http://etcd:2379/v3", `ha etcd (ha.etcd.endpoints): "http://etcd:2379/v3" is not an etcd client URL`},
		{"ha etcd http://user:pw@etcd:2379", `ha etcd (ha.etcd.endpoints): "http://user:pw@etcd:2379" is not an etcd client URL`},
		{"ha etcd http://a:2379 https://b:2379", "ha etcd (ha.etcd.endpoints): endpoints mix http:// and https://"},
		{"ha etcd http://a:2379 {\nlease_ttl 500ms\n}", "lease_ttl (ha.etcd.lease_ttl): must be whole seconds, at least 1s"},
		{"ha etcd http://a:2379 {\nlease_ttl 1500ms\n}", "lease_ttl (ha.etcd.lease_ttl): must be whole seconds, at least 1s"},
		{"ha etcd http://a:2379 {\nlease_ttl -5s\n}", "lease_ttl (ha.etcd.lease_ttl): must be whole seconds, at least 1s"},
		{"ha etcd http://a:2379 {\nadvertise router-0:8080\n}", `advertise (ha.etcd.advertise): "router-0:8080" is not a URL`},
		{"ha etcd http://a:2379 {\nadvertise {env.HA_TEST_UNSET_VAR}\n}", `advertise (ha.etcd.advertise): "" is not a URL`},
		{"ha etcd http://a:2379 {\ntls {\nserver_name etcd\n}\n}", "tls (ha.etcd.tls): needs https:// endpoints"},
		{"ha etcd https://a:2379 {\ntls {\nca " + filepath.Join(dir, "missing.pem") + "\n}\n}", "tls (ha.etcd.tls): ca:"},
		{"ha etcd https://a:2379 {\ntls {\nca " + notPEM + "\n}\n}", "tls (ha.etcd.tls): ca: " + notPEM + " holds no PEM certificate"},
		{"ha etcd https://a:2379 {\ntls {\nclient_cert " + notPEM + " " + notPEM + "\n}\n}", "tls (ha.etcd.tls): client_cert:"},
	}
	for _, tc := range cases {
		t.Run(tc.lines, func(t *testing.T) {
			cfg, err := adapt(t, "diffusion_router {\n"+tc.lines+"\n}")
			if err != nil {
				t.Fatalf("%q: the syntax is right, yet adapting failed: %v", tc.lines, err)
			}
			h := handlerFrom(t, cfg)
			err = h.provisionOptions()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("%q: provisioning said %v; want an error containing %q", tc.lines, err, tc.want)
			}
		})
	}
	var h Handler // the JSON twin's half-given client certificate
	h.HA.Etcd = &EtcdElection{Endpoints: []string{"https://a:2379"}, TLS: &EtcdTLS{ClientCert: "/c.pem"}}
	if err := h.provisionOptions(); err == nil || !strings.Contains(err.Error(), "tls (ha.etcd.tls): client_cert needs both") {
		t.Fatalf("client_cert without client_key: %v", err)
	}
}
