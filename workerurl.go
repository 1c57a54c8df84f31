package diffusionrouter

import (
	"errors"
	"net"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
)

// Worker URLs come from configs, from registrations by anyone admin_allow
// admits, and from DNS, and the router then sends requests there on its
// clients' behalf. So a worker URL is parsed once, strictly, into a
// canonical form that always parses back to itself, and hosts that lead to
// cloud instance metadata or to link-local services are refused in every
// spelling. A name is only a promise: the address it resolves to is
// checked again when it is dialled (see dialGuard).

// Errors of worker URLs, worded as the Python router words them where it
// has the same check.
var (
	errWorkerURLEmpty    = errors.New("worker_url cannot be empty")
	errWorkerURLScheme   = errors.New("worker_url must start with http:// or https://")
	errWorkerURLInvalid  = errors.New("worker_url is not a valid URL")
	errWorkerURLHost     = errors.New("worker_url must include host and port")
	errWorkerURLUser     = errors.New("worker_url must not include user credentials")
	errWorkerURLQuery    = errors.New("worker_url must not include query or fragment")
	errWorkerURLPath     = errors.New("worker_url path is not allowed")
	errWorkerURLPort     = errors.New("worker_url port must be a number from 1 to 65535")
	errWorkerURLHostName = errors.New("worker_url host must be an IP address or a DNS name (letters, digits, '-', '_' and '.')")
	errWorkerURLNumeric  = errors.New("worker_url host made of numbers must be a dotted IPv4 address")
	errWorkerURLBlocked  = errors.New("worker_url host is blocked: cloud metadata and link-local addresses are never workers")
	errWorkerURLAdmin    = errors.New("worker_url is blocked: it is Caddy's admin API")
)

// parseWorkerURL validates a worker URL and returns it as
// scheme://host[:port], lower case, without a trailing dot, so that one
// worker has one identity.
func parseWorkerURL(raw string) (string, error) {
	raw = strings.TrimSpace(raw)
	if raw == "" {
		return "", errWorkerURLEmpty
	}
	u, err := url.Parse(raw)
	switch {
	case err != nil && !strings.Contains(raw, "://"), err == nil && u.Scheme != "http" && u.Scheme != "https":
		return "", errWorkerURLScheme
	case err != nil, u.Opaque != "":
		return "", errWorkerURLInvalid
	case u.Host == "" || u.Hostname() == "":
		return "", errWorkerURLHost
	case u.User != nil:
		return "", errWorkerURLUser
	case u.RawQuery != "" || u.ForceQuery || u.Fragment != "":
		return "", errWorkerURLQuery
	case u.Path != "" && u.Path != "/":
		return "", errWorkerURLPath
	}
	host, err := canonicalHost(u.Hostname())
	if err != nil {
		return "", err
	}
	if port := u.Port(); port != "" {
		n, err := strconv.Atoi(port)
		if err != nil || n < 1 || n > 65535 {
			return "", errWorkerURLPort
		}
		return u.Scheme + "://" + net.JoinHostPort(host, strconv.Itoa(n)), nil
	}
	if strings.Contains(host, ":") {
		host = "[" + host + "]"
	}
	return u.Scheme + "://" + host, nil
}

// canonicalHost checks a URL's host and returns its canonical spelling.
func canonicalHost(host string) (string, error) {
	host = strings.ToLower(host)
	if a, err := netip.ParseAddr(host); err == nil {
		if a.Zone() != "" || blockedAddr(a) {
			return "", errWorkerURLBlocked
		}
		return a.String(), nil
	}
	host = strings.TrimSuffix(host, ".") // "metadata.google.internal." is the same name
	if !isDNSName(host) {
		return "", errWorkerURLHostName
	}
	if isNumericHost(host) {
		// 2852039166, 0xa9fea9fe and 0251.0376.0251.0376 are all
		// 169.254.169.254 to the C resolver, but not to Go's.
		return "", errWorkerURLNumeric
	}
	if blockedNames[host] {
		return "", errWorkerURLBlocked
	}
	return host, nil
}

// isDNSName reports whether s is a host name: labels of letters, digits,
// '-' and '_', 1 to 63 characters each, 253 in all.
func isDNSName(s string) bool {
	if s == "" || len(s) > 253 {
		return false
	}
	for label := range strings.SplitSeq(s, ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for _, c := range []byte(label) {
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				return false
			}
		}
	}
	return true
}

// isNumericHost reports whether every label of s is a number as the C
// library's inet_aton reads one: decimal, octal (leading 0) or hex (0x).
func isNumericHost(s string) bool {
	for label := range strings.SplitSeq(s, ".") {
		digits := strings.TrimPrefix(label, "0x")
		if digits == "" && label != "0x" {
			return false
		}
		for _, c := range []byte(digits) {
			if !(c >= '0' && c <= '9' || label != digits && c >= 'a' && c <= 'f') {
				return false
			}
		}
	}
	return true
}

// blockedNames are the names of cloud instance metadata services.
var blockedNames = map[string]bool{
	"metadata":                   true, // GCE's short name
	"metadata.google.internal":   true,
	"metadata.goog":              true,
	"instance-data":              true, // EC2
	"instance-data.ec2.internal": true,
	"metadata.azure.internal":    true,
}

// Addresses of metadata services outside the link-local range.
var (
	alibabaMetadata = netip.MustParseAddr("100.100.100.200")
	awsMetadataV6   = netip.MustParseAddr("fd00:ec2::254")
	nat64Prefix     = netip.MustParsePrefix("64:ff9b::/96")
)

// blockedAddr reports whether a is never a worker's address: link-local
// (where cloud metadata lives), a metadata service, unspecified (which
// dials this very machine) or multicast, also when written as an IPv4
// address inside an IPv6 one.
func blockedAddr(a netip.Addr) bool {
	a = embeddedIPv4(a)
	return a.IsLinkLocalUnicast() || a.IsLinkLocalMulticast() || a.IsInterfaceLocalMulticast() ||
		a.IsMulticast() || a.IsUnspecified() || a == alibabaMetadata || a == awsMetadataV6
}

// embeddedIPv4 returns the IPv4 address an IPv6 address carries (mapped
// ::ffff:a.b.c.d, compatible ::a.b.c.d, NAT64 64:ff9b::a.b.c.d), or a.
func embeddedIPv4(a netip.Addr) netip.Addr {
	a = a.Unmap()
	if !a.Is6() {
		return a
	}
	b := a.As16()
	compatible := [12]byte(b[:12]) == [12]byte{} && a != netip.IPv6Unspecified() && a != netip.IPv6Loopback()
	if compatible || nat64Prefix.Contains(a) {
		return netip.AddrFrom4([4]byte(b[12:]))
	}
	return a
}
