package diffusionrouter

import (
	"cmp"
	"reflect"

	"github.com/caddyserver/caddy/v2"

	"github.com/miles-rollout/miles-diffusion-router/internal/workerurl"
)

// newDialGuard is the dial guard for the config ctx provisions: it also
// refuses Caddy's own admin API.
func newDialGuard(ctx caddy.Context) *workerurl.Guard {
	return workerurl.NewGuard(caddyAdminPorts(ctx))
}

// caddyAdminPorts returns the TCP ports Caddy's admin API (local and
// remote) listens on in the config ctx provisions. Caddy keeps the config
// in an unexported field of its Context and offers no getter, so it is
// read by reflection; where that finds nothing (another Caddy version),
// the default admin address, which CADDY_ADMIN sets, is assumed.
func caddyAdminPorts(ctx caddy.Context) []uint16 {
	listens := []string{caddy.DefaultAdminListen}
	if cfg := reflect.ValueOf(ctx).FieldByName("cfg"); cfg.IsValid() && cfg.Kind() == reflect.Pointer && !cfg.IsNil() {
		listens = adminListens(cfg.Elem().FieldByName("Admin"))
	}
	var ports []uint16
	for _, l := range listens {
		addr, err := caddy.ParseNetworkAddressWithDefaults(l, "tcp", 2019)
		if err != nil || addr.IsUnixNetwork() || addr.IsFdNetwork() {
			continue
		}
		for p := addr.StartPort; p <= addr.EndPort; p++ {
			ports = append(ports, uint16(p))
		}
	}
	return ports
}

// adminListens reads the listen addresses of a config's *caddy.AdminConfig.
func adminListens(admin reflect.Value) []string {
	if !admin.IsValid() || admin.Kind() != reflect.Pointer || admin.IsNil() {
		return []string{caddy.DefaultAdminListen}
	}
	a := admin.Elem()
	if a.FieldByName("Disabled").Bool() {
		return nil
	}
	listens := []string{caddy.DefaultAdminListen}
	if l := a.FieldByName("Listen").String(); l != "" {
		listens[0] = l
	}
	if remote := a.FieldByName("Remote"); remote.Kind() == reflect.Pointer && !remote.IsNil() {
		l := remote.Elem().FieldByName("Listen").String()
		listens = append(listens, cmp.Or(l, caddy.DefaultRemoteAdminListen))
	}
	return listens
}
