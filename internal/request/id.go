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
