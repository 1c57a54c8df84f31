package diffusionrouter

import (
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strings"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// clientIP is the client address as Caddy determined it, which honours the
// server's trusted_proxies setting. Behind a trusted proxy, it is with an
// error when the proxy's client IP headers hold an address that does not
// parse: Caddy passes over such an entry, and then takes the proxy's own
// address (which admin_allow private_ranges admits) or, with
// trusted_proxies_strict, an address further left, which the client may
// have written itself. Either way the address is not known to be the
// client's.
func clientIP(r *http.Request) (string, error) {
	ip, ok := caddyhttp.GetVar(r.Context(), caddyhttp.ClientIPVarKey).(string)
	if !ok || ip == "" {
		ip, _, _ = strings.Cut(r.RemoteAddr, ":")
	}
	if !throughProxy(r) {
		return ip, nil
	}
	return ip, checkForwarded(r)
}

// checkForwarded returns an error naming the first entry of r's client IP
// headers (the server's client_ip_headers, X-Forwarded-For by default)
// that is not an address as Caddy reads one: an IP, with or without a
// port and a zone.
func checkForwarded(r *http.Request) error {
	headers := []string{"X-Forwarded-For"}
	if srv, ok := r.Context().Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server); ok && len(srv.ClientIPHeaders) > 0 {
		headers = srv.ClientIPHeaders
	}
	for _, name := range headers {
		for _, value := range r.Header.Values(name) {
			for entry := range strings.SplitSeq(value, ",") {
				if !isAddress(entry) {
					return fmt.Errorf("%s from trusted proxy %s holds %.64q, which is not an address", name, r.RemoteAddr, entry)
				}
			}
		}
	}
	return nil
}

// isAddress reports whether entry of a client IP header is an IP address
// as Caddy's reading takes one (caddyhttp's trustedRealClientIP).
func isAddress(entry string) bool {
	host, _, err := net.SplitHostPort(entry)
	if err != nil {
		host = entry
	}
	host, _, _ = strings.Cut(strings.TrimSpace(host), "%")
	_, err = netip.ParseAddr(host)
	return err == nil
}

// throughProxy reports whether r came from one of the server's
// trusted_proxies, which then names the client.
func throughProxy(r *http.Request) bool {
	trusted, _ := caddyhttp.GetVar(r.Context(), caddyhttp.TrustedProxyVarKey).(bool)
	return trusted
}
