package testrouter

import (
	"fmt"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
)

// Leak checks look at goroutines by what their stacks name, not at the
// process's goroutine count, which other tests, Caddy and net/http move
// at any time.

// modulePath is the router's module path, as function names in stack traces
// start with it.
const modulePath = "github.com/miles-rollout/miles-diffusion-router"

// routerCode reports whether a function name in a stack trace is the
// router's own code: the root package or a package under internal/ (where
// the core lives), but not this harness; the examples' fake workers are
// not the router.
func routerCode(frame string) bool {
	return strings.HasPrefix(frame, modulePath+".") ||
		strings.HasPrefix(frame, modulePath+"/internal/") && !strings.HasPrefix(frame, modulePath+"/internal/testrouter.")
}

// RouterGoroutines returns the stacks, by goroutine id, of the goroutines
// other than the caller's that run or were started by the router's code.
func RouterGoroutines() map[string]string {
	out := map[string]string{}
	for id, s := range testkit.Stacks() {
		for _, line := range strings.Split(s, "\n") {
			if routerCode(strings.TrimPrefix(line, "created by ")) {
				out[id] = s
				break
			}
		}
	}
	return out
}

// WaitNoNewRouterGoroutines waits, for up to 30 s, until every goroutine of
// the router's code still running was already running when before was
// taken (by RouterGoroutines), and otherwise fails the test with the stacks
// of the new ones. what names the step that should have left none.
func WaitNoNewRouterGoroutines(t testing.TB, what string, before map[string]string) {
	t.Helper()
	testkit.WaitNoNewGoroutines(t, what, "the router", before, RouterGoroutines)
}

// DescribeGoroutines counts goroutines by the function that started them,
// for a failure message.
func DescribeGoroutines(stacks map[string]string) string {
	count := map[string]int{}
	for _, s := range stacks {
		creator := "(no creator)"
		if _, after, ok := strings.Cut(s, "\ncreated by "); ok {
			creator, _, _ = strings.Cut(after, " in goroutine")
			creator, _, _ = strings.Cut(creator, "\n")
		}
		count[creator]++
	}
	var b strings.Builder
	for c, n := range count {
		fmt.Fprintf(&b, "%5d %s\n", n, c)
	}
	return b.String()
}
