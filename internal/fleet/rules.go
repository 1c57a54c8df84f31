package fleet

import (
	"errors"
	"fmt"
	"path"
	"slices"
	"strings"
)

// What a weights path or version must be, whether it comes through the
// control API or is read back from storage.

// maxWeightVersion bounds a weight version: the router sends it as a
// header on every answer and keeps it in storage, and clients' header
// readers have limits of their own (Python's http.client fails a line of
// 64 KiB).
const maxWeightVersion = 512

// CheckVersion refuses a weight version that could not go out as a header
// value: too long, or with bytes that are not printable ASCII.
func CheckVersion(version string) error {
	if len(version) > maxWeightVersion {
		return fmt.Errorf("the weight version is %d bytes long; at most %d", len(version), maxWeightVersion)
	}
	if strings.ContainsFunc(version, func(c rune) bool { return c < 0x20 || c > 0x7e }) {
		return errors.New("the weight version must be printable ASCII, as it is sent in a header")
	}
	return nil
}

// ErrOutsidePrefix is why a weights path is refused that is clean but
// lies outside weights_path_prefix.
var ErrOutsidePrefix = errors.New("outside weights_path_prefix")

// CheckPath checks a path a worker will load weights from: clean, and
// under one of c.PathPrefixes when there are any (ErrOutsidePrefix
// otherwise).
func (c *Config) CheckPath(p string) error {
	if strings.ContainsRune(p, 0) || slices.Contains(strings.FieldsFunc(p, isPathSeparator), "..") {
		return errors.New("must not contain '..' segments or NUL bytes")
	}
	if len(c.PathPrefixes) > 0 && !slices.ContainsFunc(c.PathPrefixes, func(prefix string) bool { return underPrefix(p, prefix) }) {
		return fmt.Errorf("is %w (%s)", ErrOutsidePrefix, strings.Join(c.PathPrefixes, ", "))
	}
	return nil
}

// underPrefix reports whether p lies under prefix by whole path segments:
// /ckpt admits /ckpt and /ckpt/x but not /ckpt-evil/x, and s3://bucket/
// admits s3://bucket/x but not s3://bucket-evil/x. A URL matches only a
// URL prefix of the same scheme (compared exactly), a path only an
// absolute path prefix. Segments are split at '/' alone, as on the
// workers' POSIX file systems, where /ckpt\x is not under /ckpt. p holds
// no '..' segment (checked before), so cleaning it cannot climb out.
func underPrefix(p, prefix string) bool {
	pScheme, pRest, pURL := cutScheme(p)
	xScheme, xRest, xURL := cutScheme(prefix)
	switch {
	case pURL != xURL, pScheme != xScheme:
		return false
	case !pURL && !strings.HasPrefix(p, "/"):
		return false // a relative path is relative to wherever the worker runs
	}
	a, b := path.Clean("/"+pRest), path.Clean("/"+xRest)
	return a == b || b == "/" || strings.HasPrefix(a, b+"/")
}

// cutScheme splits scheme://rest; a string without a valid scheme is a
// path, returned whole as rest.
func cutScheme(s string) (scheme, rest string, isURL bool) {
	scheme, rest, ok := strings.Cut(s, "://")
	if !ok || !validScheme(scheme) {
		return "", s, false
	}
	return scheme, rest, true
}

// validScheme is RFC 3986's: a letter, then letters, digits, '+', '-', '.'.
func validScheme(s string) bool {
	for i, r := range s {
		letter := 'a' <= r && r <= 'z' || 'A' <= r && r <= 'Z'
		if !letter && (i == 0 || !('0' <= r && r <= '9' || r == '+' || r == '-' || r == '.')) {
			return false
		}
	}
	return s != ""
}

func isPathSeparator(r rune) bool { return r == '/' || r == '\\' }
