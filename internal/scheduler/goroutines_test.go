package scheduler

import (
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
)

// Leak checks look at goroutines by what their stacks name, not at the
// process's goroutine count, which other tests, Caddy and net/http move
// at any time.

// packagePrefix is this package's import path followed by a dot, as
// function names in stack traces start ("example.com/m.(*Pool).Acquire");
// the packages below it (examples/fakeworker) continue with a slash.
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

// waitNoNewPackageGoroutines waits, for up to 30 s, until every goroutine
// of this package still running was already running when before was taken,
// and otherwise fails the test with the stacks of the new ones.
func waitNoNewPackageGoroutines(t *testing.T, what string, before map[string]string) {
	t.Helper()
	var added []string
	testkit.WaitUntil(30*time.Second, func() bool {
		added = added[:0]
		for id, s := range packageGoroutines() {
			if _, ok := before[id]; !ok {
				added = append(added, s)
			}
		}
		return len(added) == 0
	})
	if len(added) > 0 {
		t.Fatalf("%s left %d goroutines of this package running:\n\n%s", what, len(added), strings.Join(added, "\n\n"))
	}
}
