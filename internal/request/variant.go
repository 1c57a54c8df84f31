package request

import (
	"net/url"
	"strings"
)

// Canonical returns u with the path a variant of it stands for: repeated
// slashes merged, each segment's ;params cut, and a trailing slash
// dropped; ok is false when u's path is its own. The path is worked on as
// sent (escaped), so that an escaped slash stays one: it is no separator
// to the router, only to a worker that decodes it.
//
// A worker may take a variant for its path, or a proxy before the router
// may (uvicorn redirects /v1/set_lora/ to /v1/set_lora, naming itself in
// the redirect), so the router decides on a variant as on the path it
// stands for.
func Canonical(u *url.URL) (canonical *url.URL, ok bool) {
	if !mayBeVariant(u.Path) {
		return u, false
	}
	var b strings.Builder
	for seg := range strings.SplitSeq(u.EscapedPath(), "/") {
		if seg, _, _ = strings.Cut(seg, ";"); seg != "" {
			b.WriteByte('/')
			b.WriteString(seg)
		}
	}
	escaped := b.String()
	if escaped == "" {
		escaped = "/"
	}
	path, err := url.PathUnescape(escaped)
	if err != nil {
		return u, false // not from an escaped path that parsed
	}
	c := *u
	c.Path, c.RawPath = path, ""
	if c.EscapedPath() != escaped {
		c.RawPath = escaped
	}
	return &c, true
}

// mayBeVariant reports whether path has what a variant has: a repeated or
// trailing slash, or a ;. A path without them is its own canonical path.
func mayBeVariant(path string) bool {
	return strings.Contains(path, "//") || strings.IndexByte(path, ';') >= 0 || len(path) > 1 && path[len(path)-1] == '/'
}
