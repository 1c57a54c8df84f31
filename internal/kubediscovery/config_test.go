package kubediscovery

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/zap"
)

// Each bad input is refused with an error naming the field at fault.
func TestCheckRefuses(t *testing.T) {
	dir := t.TempDir()
	garbage := filepath.Join(dir, "garbage")
	if err := os.WriteFile(garbage, []byte("clusters: [not a kubeconfig"), 0o600); err != nil {
		t.Fatal(err)
	}
	empty := filepath.Join(dir, "empty")
	if err := os.WriteFile(empty, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	svc := Config{Service: "engines"}
	with := func(f func(*Config)) Config {
		c := svc
		f(&c)
		return c
	}
	for _, tc := range []struct {
		name  string
		c     Config
		names string
	}{
		{"neither service nor selector", Config{Namespace: "prod"}, "service or selector"},
		{"both service and selector", Config{Service: "engines", Selector: "app=engines"}, "service and selector"},
		{"a selector that does not parse", Config{Selector: "app in (engines"}, `selector "app in (engines"`},
		{"a selector with a bad operator", Config{Selector: "app=>engines"}, "selector"},
		{"a service that is not a name", with(func(c *Config) { c.Service = "Engines_1" }), `service "Engines_1"`},
		{"a namespace that is not a name", with(func(c *Config) { c.Namespace = "prod/x" }), `namespace "prod/x"`},
		{"port 0", with(func(c *Config) { c.Port = "0" }), "port 0"},
		{"port 70000", with(func(c *Config) { c.Port = "70000" }), "port 70000"},
		{"a negative port", with(func(c *Config) { c.Port = "-1" }), "port -1"},
		{"a port name too long", with(func(c *Config) { c.Port = "a-very-long-port-name" }), `port "a-very-long-port-name"`},
		{"a port name with capitals", with(func(c *Config) { c.Port = "HTTP" }), `port "HTTP"`},
		{"a port name of digits and dashes", with(func(c *Config) { c.Port = "80-80" }), `port "80-80"`},
		{"an address type", with(func(c *Config) { c.AddressType = "ipv4" }), `address_type "ipv4"`},
		{"FQDN", with(func(c *Config) { c.AddressType = "FQDN" }), `address_type "FQDN"`},
		{"a kubeconfig that is not there", with(func(c *Config) { c.Kubeconfig = filepath.Join(dir, "missing") }), "kubeconfig " + filepath.Join(dir, "missing")},
		{"a kubeconfig that is a directory", with(func(c *Config) { c.Kubeconfig = dir }), "kubeconfig " + dir},
		{"a kubeconfig that does not parse", with(func(c *Config) { c.Kubeconfig = garbage }), "kubeconfig " + garbage},
		{"a kubeconfig with no cluster", with(func(c *Config) { c.Kubeconfig = empty }), "kubeconfig " + empty},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.c.Check()
			if err == nil {
				t.Fatalf("%+v accepted", tc.c)
			}
			if !strings.Contains(err.Error(), tc.names) {
				t.Errorf("error %q does not name %q", err, tc.names)
			}
		})
	}
}

// A good kubeconfig and every valid form of each field pass, without
// contacting the server the kubeconfig names.
func TestCheckAccepts(t *testing.T) {
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(kubeconfig, []byte(`apiVersion: v1
kind: Config
clusters:
- name: c
  cluster: {server: "https://192.0.2.1:6443"}
users:
- name: u
  user: {token: secret}
contexts:
- name: x
  context: {cluster: c, user: u}
current-context: x
`), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []Config{
		{Service: "engines"},
		{Namespace: "prod", Service: "engines", Port: "30000", AddressType: "IPv4"},
		{Selector: "app=engines,tier in (gpu,cpu)", Port: "http", AddressType: "IPv6"},
		{Selector: "!canary", Port: "65535"},
		{Service: "engines", Port: "1", Kubeconfig: kubeconfig},
	} {
		if err := c.Check(); err != nil {
			t.Errorf("%+v: %v", c, err)
		}
	}
	if _, err := Client(Config{Service: "engines", Kubeconfig: kubeconfig}); err != nil {
		t.Errorf("client from the kubeconfig: %v", err)
	}
}

// Outside a cluster, in-cluster mode fails at once, naming itself.
func TestInClusterOutsideACluster(t *testing.T) {
	if os.Getenv("KUBERNETES_SERVICE_HOST") != "" {
		t.Skip("running inside a cluster")
	}
	err := Watch(context.Background(), Config{Service: "engines"}, zap.NewNop(), func([]Endpoint) {}, func(bool) {})
	if err == nil || !strings.Contains(err.Error(), "in-cluster") {
		t.Errorf("Watch outside a cluster: %v, want an error naming in-cluster mode", err)
	}
}

// Watch refuses a config that Check refuses, before anything else.
func TestWatchChecks(t *testing.T) {
	err := Watch(context.Background(), Config{Service: "engines", Port: "0"}, zap.NewNop(), func([]Endpoint) {}, func(bool) {})
	if err == nil || !strings.Contains(err.Error(), "port 0") {
		t.Errorf("Watch with port 0: %v", err)
	}
}
