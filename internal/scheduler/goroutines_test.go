package scheduler

import (
	"runtime"
	"strings"

	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
)

// Leak checks look at goroutines by what their stacks name, not at the
// process's goroutine count, which other tests, Caddy and net/http move
// at any time.

// packagePrefix is this package's import path followed by a dot, as
// function names in stack traces start ("example.com/m.(*Pool).Acquire");
// the packages below it (internal/fakeworker) continue with a slash.
var packagePrefix = func() string {
	pc, _, _, _ := runtime.Caller(0)
	name := runtime.FuncForPC(pc).Name() // <import path>.init.func1 or similar
	slash := strings.LastIndexByte(name, '/')
	return name[:slash+strings.IndexByte(name[slash:], '.')+1]
}()

// packageGoroutines returns the stacks, by goroutine id, of the goroutines
// other than the caller's that run or were started by this package's code.
func packageGoroutines() map[string]string {
	out := map[string]string{}
	for id, s := range testkit.Stacks() {
		if strings.Contains(s, "\n"+packagePrefix) || strings.Contains(s, "created by "+packagePrefix) {
			out[id] = s
		}
	}
	return out
}
