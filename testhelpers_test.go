package diffusionrouter

import "time"

// The unit tests of this package cannot use internal/testrouter, which
// imports this package; this is its helper they need.

// waitUntilOr polls cond every few milliseconds until it holds or d has
// passed, and reports whether it held.
func waitUntilOr(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(5 * time.Millisecond)
	}
	return true
}
