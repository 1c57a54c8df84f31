package request

import "strings"

// MaxID bounds a request's id (its X-Request-Id), which goes out again in
// headers and log lines.
const MaxID = 128

// ValidID reports whether id may be a request's id: 1 to MaxID printable
// ASCII characters, so that it can go out again as it came.
func ValidID(id string) bool {
	return id != "" && len(id) <= MaxID && !strings.ContainsFunc(id, func(c rune) bool { return c < 0x20 || c > 0x7e })
}

// IDHeader carries a request's id: the client's, or one the router makes;
// the response echoes it and the worker sees it.
const IDHeader = "X-Request-Id"

// VersionHeader names the weight version that served a generation, and,
// on a request, the only version that may serve it.
const VersionHeader = "X-Weight-Version"
