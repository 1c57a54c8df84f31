package diffusionrouter

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"reflect"
	"slices"
	"strconv"
	"syscall"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// dialGuard refuses connections to addresses that are never workers: the
// blocked ones (blockedAddr) and Caddy's own admin API, which would hand
// out the config, admin token included, and take a new one. It checks the
// address actually dialled, after name resolution, so a name whose DNS
// answer changes cannot smuggle one in.
type dialGuard struct {
	adminPorts []uint16     // ports of Caddy's admin API
	local      []netip.Addr // this machine's interface addresses
}

// errDialBlocked is the error of a dial the guard refused.
var errDialBlocked = errors.New("address is blocked: cloud metadata, link-local and Caddy's admin API are never workers")

// newDialGuard is the guard for the config ctx provisions.
func newDialGuard(ctx caddy.Context) *dialGuard {
	g := &dialGuard{adminPorts: caddyAdminPorts(ctx)}
	if addrs, err := net.InterfaceAddrs(); err == nil {
		for _, a := range addrs {
			if p, err := netip.ParsePrefix(a.String()); err == nil {
				g.local = append(g.local, p.Addr().Unmap())
			}
		}
	}
	return g
}

// refuses reports whether the guard refuses to dial ap.
func (g *dialGuard) refuses(ap netip.AddrPort) bool {
	a := ap.Addr().Unmap()
	if blockedAddr(a) {
		return true
	}
	if !slices.Contains(g.adminPorts, ap.Port()) {
		return false
	}
	return a.IsLoopback() || slices.Contains(g.local, a)
}

// refusesURL reports whether a worker URL (canonical, see parseWorkerURL)
// names a refused address outright: an address literal, or localhost.
func (g *dialGuard) refusesURL(workerURL string) bool {
	host, portText, err := net.SplitHostPort(dialAddress(workerURL))
	if err != nil {
		return false
	}
	port, _ := strconv.ParseUint(portText, 10, 16)
	if host == "localhost" {
		host = "127.0.0.1"
	}
	a, err := netip.ParseAddr(host)
	return err == nil && g.refuses(netip.AddrPortFrom(a, uint16(port)))
}

// control is a net.Dialer Control function: it runs after the name is
// resolved and before the connection is made.
func (g *dialGuard) control(_, address string, _ syscall.RawConn) error {
	ap, err := netip.ParseAddrPort(address)
	if err == nil && g.refuses(ap) {
		return fmt.Errorf("dial %s: %w", address, errDialBlocked)
	}
	return nil
}

// checkConn closes a connection another dialer made to a refused address,
// before a byte of a request goes over it.
func (g *dialGuard) checkConn(conn net.Conn, err error) (net.Conn, error) {
	if err != nil {
		return conn, err
	}
	ap, perr := netip.ParseAddrPort(conn.RemoteAddr().String())
	if perr == nil && g.refuses(ap) {
		conn.Close()
		return nil, fmt.Errorf("dial %s: %w", ap, errDialBlocked)
	}
	return conn, nil
}

// wrapDial returns dial with every connection it makes checked.
func (g *dialGuard) wrapDial(dial func(ctx context.Context, network, addr string) (net.Conn, error)) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		return g.checkConn(dial(ctx, network, addr))
	}
}

// guardedClient is an HTTP client for the router's own calls to workers
// (probes, model lists, weight updates) whose dials the current guard
// checks. Every call sets its own deadline.
func guardedClient(current func() *dialGuard) *http.Client {
	d := &net.Dialer{
		Timeout: 10 * time.Second,
		Control: func(network, address string, c syscall.RawConn) error {
			g := current()
			if g == nil { // no config loaded yet: the blocked addresses still are
				g = new(dialGuard)
			}
			return g.control(network, address, c)
		},
	}
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.Proxy = nil // workers are reached directly, never through a proxy from the environment
	t.DialContext = d.DialContext
	return &http.Client{Transport: t}
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
