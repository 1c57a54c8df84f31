package diffusionrouter

import (
	"bytes"
	"runtime"
	"strings"
	"testing"
	"time"
)

// Leak checks look at goroutines by what their stacks name, not at the
// process's goroutine count, which other tests, Caddy and net/http move
// at any time.

// packagePrefix is this package's import path followed by a dot, as
// function names in stack traces start ("example.com/m.(*pool).acquire");
// the packages below it (examples/fakeworker) continue with a slash.
var packagePrefix = func() string {
	pc, _, _, _ := runtime.Caller(0)
	name := runtime.FuncForPC(pc).Name() // <import path>.init.func1 or similar
	slash := strings.LastIndexByte(name, '/')
	return name[:slash+strings.IndexByte(name[slash:], '.')+1]
}()

// goroutineStacks returns the stacks of all goroutines but the caller's, by
// goroutine id.
func goroutineStacks() map[string]string {
	self := make([]byte, 64)
	self = self[:runtime.Stack(self, false)]
	selfID := goroutineID(self)
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	out := map[string]string{}
	for _, g := range bytes.Split(buf, []byte("\n\n")) {
		if id := goroutineID(g); id != "" && id != selfID {
			out[id] = string(g)
		}
	}
	return out
}

// goroutineID reads N from a stack that starts "goroutine N [...]".
func goroutineID(stack []byte) string {
	rest, ok := bytes.CutPrefix(stack, []byte("goroutine "))
	if !ok {
		return ""
	}
	id, _, _ := bytes.Cut(rest, []byte(" "))
	return string(id)
}

// packageGoroutines returns the stacks, by goroutine id, of the goroutines
// other than the caller's that run or were started by this package's code.
func packageGoroutines() map[string]string {
	out := map[string]string{}
	for id, s := range goroutineStacks() {
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
	waitUntilOr(30*time.Second, func() bool {
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
