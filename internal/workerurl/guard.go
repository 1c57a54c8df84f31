package workerurl

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"syscall"
	"time"
)

// Guard refuses connections to addresses that are never workers: the
// blocked ones (BlockedAddr) and Caddy's own admin API, which would hand
// out the config, admin token included, and take a new one. It checks the
// address actually dialled, after name resolution, so a name whose DNS
// answer changes cannot smuggle one in.
type Guard struct {
	adminPorts []uint16     // ports of Caddy's admin API
	local      []netip.Addr // this machine's interface addresses
}

// AdminPorts are the ports of Caddy's admin API the guard refuses on this
// machine's addresses.
func (g *Guard) AdminPorts() []uint16 { return g.adminPorts }

// ErrDialBlocked is the error of a dial the guard refused.
var ErrDialBlocked = errors.New("address is blocked: cloud metadata, link-local and Caddy's admin API are never workers")

// NewGuard is a guard that also refuses Caddy's admin API, listening on
// adminPorts of this machine.
func NewGuard(adminPorts []uint16) *Guard {
	g := &Guard{adminPorts: adminPorts}
	if addrs, err := net.InterfaceAddrs(); err == nil {
		for _, a := range addrs {
			if p, err := netip.ParsePrefix(a.String()); err == nil {
				g.local = append(g.local, p.Addr().Unmap())
			}
		}
	}
	return g
}

// Refuses reports whether the guard refuses to dial ap.
func (g *Guard) Refuses(ap netip.AddrPort) bool {
	a := ap.Addr().Unmap()
	if BlockedAddr(a) {
		return true
	}
	if !slices.Contains(g.adminPorts, ap.Port()) {
		return false
	}
	return a.IsLoopback() || slices.Contains(g.local, a)
}

// RefusesURL reports whether a worker URL (canonical, see Parse)
// names a refused address outright: an address literal, or localhost.
func (g *Guard) RefusesURL(workerURL string) bool {
	host, portText, err := net.SplitHostPort(DialAddress(workerURL))
	if err != nil {
		return false
	}
	port, _ := strconv.ParseUint(portText, 10, 16)
	if host == "localhost" {
		host = "127.0.0.1"
	}
	a, err := netip.ParseAddr(host)
	return err == nil && g.Refuses(netip.AddrPortFrom(a, uint16(port)))
}

// Control is a net.Dialer Control function: it runs after the name is
// resolved and before the connection is made.
func (g *Guard) Control(_, address string, _ syscall.RawConn) error {
	ap, err := netip.ParseAddrPort(address)
	if err == nil && g.Refuses(ap) {
		return fmt.Errorf("dial %s: %w", address, ErrDialBlocked)
	}
	return nil
}

// checkConn closes a connection another dialer made to a refused address,
// before a byte of a request goes over it.
func (g *Guard) checkConn(conn net.Conn, err error) (net.Conn, error) {
	if err != nil {
		return conn, err
	}
	ap, perr := netip.ParseAddrPort(conn.RemoteAddr().String())
	if perr == nil && g.Refuses(ap) {
		conn.Close()
		return nil, fmt.Errorf("dial %s: %w", ap, ErrDialBlocked)
	}
	return conn, nil
}

// WrapDial returns dial with every connection it makes checked.
func (g *Guard) WrapDial(dial func(ctx context.Context, network, addr string) (net.Conn, error)) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		return g.checkConn(dial(ctx, network, addr))
	}
}

// GuardedClient is an HTTP client for the router's own calls to workers
// (probes, model lists, weight updates) whose dials the current guard
// checks. Every call sets its own deadline.
func GuardedClient(current func() *Guard) *http.Client {
	d := &net.Dialer{
		Timeout: 10 * time.Second,
		Control: func(network, address string, c syscall.RawConn) error {
			g := current()
			if g == nil { // no config loaded yet: the blocked addresses still are
				g = new(Guard)
			}
			return g.Control(network, address, c)
		},
	}
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.Proxy = nil // workers are reached directly, never through a proxy from the environment
	t.DialContext = d.DialContext
	return &http.Client{Transport: t}
}
