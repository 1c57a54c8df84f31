package diffusionrouter

import (
	"net/http"
	"strings"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// clientIP is the client address as Caddy determined it, which honours the
// server's trusted_proxies setting.
func clientIP(r *http.Request) string {
	if ip, ok := caddyhttp.GetVar(r.Context(), caddyhttp.ClientIPVarKey).(string); ok && ip != "" {
		return ip
	}
	host, _, _ := strings.Cut(r.RemoteAddr, ":")
	return host
}

// throughProxy reports whether r came from one of the server's
// trusted_proxies, which then names the client.
func throughProxy(r *http.Request) bool {
	trusted, _ := caddyhttp.GetVar(r.Context(), caddyhttp.TrustedProxyVarKey).(bool)
	return trusted
}
