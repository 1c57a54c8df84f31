// Package testkit holds the test helpers that need no Caddy, so that the
// core's tests, the root package's own unit tests and internal/testrouter
// share one copy: waiting for a condition, free ports, goroutine stacks
// for leak checks, and multipart bodies.
package testkit

import (
	"bytes"
	"mime/multipart"
	"net"
	"runtime"
	"strings"
	"testing"
	"time"
)

// WaitUntil polls cond every few milliseconds until it holds or d has
// passed, and reports whether it held.
func WaitUntil(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(5 * time.Millisecond)
	}
	return true
}

// FreePort asks the kernel for a port of 127.0.0.1 that is free right
// now, for a server a test starts a moment later.
func FreePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// Stacks returns the stacks of all goroutines but the caller's, by
// goroutine id.
func Stacks() map[string]string {
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

// MultipartForm is a form with an image file part, then the fields given as
// name, value pairs; it returns the body and its Content-Type.
func MultipartForm(image []byte, fields ...string) (string, string) {
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	fw, _ := mw.CreateFormFile("image", "in.png")
	fw.Write(image)
	for i := 0; i+1 < len(fields); i += 2 {
		mw.WriteField(fields[i], fields[i+1])
	}
	mw.Close()
	return buf.String(), mw.FormDataContentType()
}

// WaitNoNewGoroutines waits, for up to 30 s, until every goroutine that
// current returns (stacks by goroutine id, as Stacks gives them) was
// already in before, and otherwise fails t with the stacks of the new
// ones. what names the step that should have left none, whose the code
// the goroutines run.
func WaitNoNewGoroutines(t testing.TB, what, whose string, before map[string]string, current func() map[string]string) {
	t.Helper()
	var added []string
	WaitUntil(30*time.Second, func() bool {
		added = added[:0]
		for id, s := range current() {
			if _, ok := before[id]; !ok {
				added = append(added, s)
			}
		}
		return len(added) == 0
	})
	if len(added) > 0 {
		t.Fatalf("%s left %d goroutines of %s running:\n\n%s", what, len(added), whose, strings.Join(added, "\n\n"))
	}
}
