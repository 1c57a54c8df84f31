// Package workerurl holds the rules for worker addresses: a worker URL
// parsed once into the one form that names it, and the addresses that are
// never workers, refused when a URL names them and again when a
// connection is dialled.
package workerurl

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
// checked again when it is dialled (see Guard).

// Errors of worker URLs, worded as the Python router words them where it
// has the same check.
var (
	// ErrEmpty and the rest are what is wrong with a worker URL.
	ErrEmpty    = errors.New("worker_url cannot be empty")
	ErrScheme   = errors.New("worker_url must start with http:// or https://")
	ErrInvalid  = errors.New("worker_url is not a valid URL")
	ErrHost     = errors.New("worker_url must include host and port")
	ErrUser     = errors.New("worker_url must not include user credentials")
	ErrQuery    = errors.New("worker_url must not include query or fragment")
	ErrPath     = errors.New("worker_url path is not allowed")
	ErrPort     = errors.New("worker_url port must be a number from 1 to 65535")
	ErrHostName = errors.New("worker_url host must be an IP address or a DNS name (letters, digits, '-', '_' and '.')")
	ErrNumeric  = errors.New("worker_url host made of numbers must be a dotted IPv4 address")
	ErrBlocked  = errors.New("worker_url host is blocked: cloud metadata and link-local addresses are never workers")
	ErrAdmin    = errors.New("worker_url is blocked: it is Caddy's admin API")
)

// Parse validates a worker URL and returns it as
// scheme://host[:port], lower case, without a trailing dot, so that one
// worker has one identity.
func Parse(raw string) (string, error) {
	raw = strings.TrimSpace(raw)
	if raw == "" {
		return "", ErrEmpty
	}
	u, err := url.Parse(raw)
	switch {
	case err != nil && !strings.Contains(raw, "://"), err == nil && u.Scheme != "http" && u.Scheme != "https":
		return "", ErrScheme
	case err != nil, u.Opaque != "":
		return "", ErrInvalid
	case u.Host == "" || u.Hostname() == "":
		return "", ErrHost
	case u.User != nil:
		return "", ErrUser
	case u.RawQuery != "" || u.ForceQuery || strings.Contains(raw, "#"): // url.URL keeps no trace of an empty fragment
		return "", ErrQuery
	case u.Path != "" && u.Path != "/":
		return "", ErrPath
	}
	host, err := canonicalHost(u.Hostname())
	if err != nil {
		return "", err
	}
	if port := u.Port(); port != "" {
		n, err := strconv.Atoi(port)
		if err != nil || n < 1 || n > 65535 {
			return "", ErrPort
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
		if a.Zone() != "" || BlockedAddr(a) {
			return "", ErrBlocked
		}
		return a.String(), nil
	}
	host = strings.TrimSuffix(host, ".") // "metadata.google.internal." is the same name
	if !isDNSName(host) {
		return "", ErrHostName
	}
	if isNumericHost(host) {
		// 2852039166, 0xa9fea9fe and 0251.0376.0251.0376 are all
		// 169.254.169.254 to the C resolver, but not to Go's.
		return "", ErrNumeric
	}
	if blockedNames[host] {
		return "", ErrBlocked
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

// CheckLookupName checks a name that DNS discovery looks up: a DNS name,
// absolute (with a final dot) or not.
func CheckLookupName(name string) error {
	bare := strings.TrimSuffix(strings.ToLower(name), ".")
	switch {
	case name == "":
		return errors.New("a name to look up is required")
	case net.ParseIP(bare) != nil, isNumericHost(bare):
		return errors.New("is an address, not a name to look up: list it in workers")
	case !isDNSName(bare):
		return errors.New("is not a DNS name (letters, digits, '-', '_' and '.')")
	}
	return nil
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

// BlockedAddr reports whether a is never a worker's address: link-local
// (where cloud metadata lives), a metadata service, unspecified (which
// dials this very machine) or multicast, also when written as an IPv4
// address inside an IPv6 one.
func BlockedAddr(a netip.Addr) bool {
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

// AddressKey is what identifies the machine and port a dial address
// (host:port) reaches, so that spellings of one address are one worker:
// localhost is 127.0.0.1, and an IPv4 address inside IPv6 is that IPv4
// address. Names other than localhost are taken as they are: what they
// resolve to may change.
func AddressKey(dial string) string {
	host, port, err := net.SplitHostPort(dial)
	if err != nil {
		return dial
	}
	if host == "localhost" {
		return net.JoinHostPort("127.0.0.1", port)
	}
	if a, err := netip.ParseAddr(host); err == nil {
		return net.JoinHostPort(a.Unmap().String(), port)
	}
	return dial
}

// DialAddress turns a worker URL from Parse into the host:port a
// connection to it dials, filling in the scheme's default port.
func DialAddress(workerURL string) string {
	u, err := url.Parse(workerURL)
	if err != nil {
		return workerURL
	}
	if u.Port() != "" {
		return u.Host
	}
	port := "80"
	if u.Scheme == "https" {
		port = "443"
	}
	return net.JoinHostPort(u.Hostname(), port)
}
