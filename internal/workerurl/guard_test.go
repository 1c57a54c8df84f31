package workerurl

import (
	"errors"
	"net"
	"net/netip"
	"testing"
)

func TestGuardRefusesBlockedAddressesAndTheAdminAPI(t *testing.T) {
	g := NewGuard([]uint16{12019})
	for addr, refused := range map[string]bool{
		"127.0.0.1:12019":             true,
		"[::1]:12019":                 true,
		"127.0.0.1:30000":             false,
		"10.1.2.3:12019":              false, // another machine's port
		"169.254.169.254:80":          true,
		"[::ffff:169.254.169.254]:80": true,
		"0.0.0.0:30000":               true,
	} {
		if got := g.Refuses(netip.MustParseAddrPort(addr)); got != refused {
			t.Errorf("Refuses(%s) = %v; want %v", addr, got, refused)
		}
	}
	if !g.RefusesURL("http://localhost:12019") || g.RefusesURL("http://workers.internal:12019") {
		t.Error("RefusesURL judges names it cannot resolve, or misses localhost")
	}
}

func TestGuardedClientDialsThroughTheGuard(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := uint16(ln.Addr().(*net.TCPAddr).Port)
	c := GuardedClient(func() *Guard { return NewGuard([]uint16{port}) })
	_, err = c.Get("http://" + ln.Addr().String() + "/config/")
	if !errors.Is(err, ErrDialBlocked) {
		t.Fatalf("the client reached a refused port: %v", err)
	}
}
