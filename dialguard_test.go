package diffusionrouter

import (
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

func TestDialGuardChecksTheResolvedAddress(t *testing.T) {
	ctx, err := caddy.ProvisionContext(&caddy.Config{Admin: &caddy.AdminConfig{
		Listen: "localhost:12019",
		Remote: &caddy.RemoteAdmin{Listen: ":12021"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	g := newDialGuard(ctx)
	if !slices.Equal(g.AdminPorts(), []uint16{12019, 12021}) {
		t.Fatalf("admin ports %v; want 12019 and 12021 read from the config", g.AdminPorts())
	}
	disabled, _ := caddy.ProvisionContext(&caddy.Config{Admin: &caddy.AdminConfig{Disabled: true}})
	if ports := newDialGuard(disabled).AdminPorts(); len(ports) != 0 {
		t.Fatalf("admin off: ports %v; want none", ports)
	}
	for addr, refused := range map[string]bool{
		"127.0.0.1:12019":             true,
		"[::1]:12019":                 true,
		"127.0.0.1:30000":             false,
		"10.1.2.3:12019":              false,
		"169.254.169.254:80":          true,
		"[::ffff:169.254.169.254]:80": true,
		"[fd00:ec2::254]:80":          true,
		"100.100.100.200:80":          true,
		"0.0.0.0:30000":               true,
	} {
		if got := g.Refuses(netip.MustParseAddrPort(addr)); got != refused {
			t.Errorf("refuses(%s) = %v; want %v", addr, got, refused)
		}
	}

	// The router's own client dials through the guard.
	p := newPool(t.Name())
	p.fleet.UseGuard(g)
	_, err = p.fleet.Client().Get("http://127.0.0.1:12019/config/")
	if err == nil || !strings.Contains(err.Error(), "blocked") {
		t.Fatalf("the pool's client reached Caddy's admin port: %v", err)
	}
}
