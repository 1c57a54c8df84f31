package diffusionrouter

import (
	"context"
	"io"
	"net/http"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

type ticketKey struct{}

// withTicket carries a ticket through reverse_proxy, whose request clone
// keeps the context.
func withTicket(ctx context.Context, t *scheduler.Ticket) context.Context {
	return context.WithValue(ctx, ticketKey{}, t)
}

func ticketFrom(ctx context.Context) *scheduler.Ticket {
	t, _ := ctx.Value(ticketKey{}).(*scheduler.Ticket)
	return t
}

// weightVersionHeader names the weight version that served a generation,
// and, on a request, the only version that may serve it.
const weightVersionHeader = "X-Weight-Version"

// recorder notes the status of a proxied response, names the weight version
// of the worker that served it, and, when asked, keeps its first bytes or
// holds the answer back; everything else streams straight through.
type recorder struct {
	// A value, not a pointer: one allocation per request rather than two.
	caddyhttp.ResponseWriterWrapper
	ticket    *scheduler.Ticket
	onHeader  func(status int) // called once the final status is known
	status    int              // the status the client got; 0 until then
	peekLimit int
	peek      []byte
	held      *heldAnswer // the answer of an attempt that may yet give way to another
	// onPeek, when set, reads the peek each time it grows, before the
	// bytes that grew it go out, until it reports it has what it needs.
	onPeek func(peek []byte) (done bool)
}

// heldAnswer is a worker's answer kept from the client while the job may
// still run on another worker: the client gets it only once it is judged
// to be the answer.
type heldAnswer struct {
	header    http.Header
	judge     func(status int) verdict
	state     verdict
	status    int    // the worker's status; 0 until it answered
	body      []byte // the first heldBodyLimit bytes of an answer set aside
	truncated bool   // the body was longer than what was kept
}

// verdict is what becomes of a held answer.
type verdict uint8

const (
	undecided verdict = iota // the worker has not answered yet
	pass                     // the client gets it
	drop                     // set aside: the job runs again, unless it cannot
	read                     // set aside until its first bytes decide
	lost                     // another copy of the job answered first
)

// heldBodyLimit bounds what is kept of an answer set aside. Error answers
// are short; one being read that outgrows this is passed on.
const heldBodyLimit = 16 << 10

// hold makes rec keep the next answer from the client until judge lets it
// through.
func (rec *recorder) hold(judge func(status int) verdict) {
	rec.held = &heldAnswer{header: make(http.Header), judge: judge}
}

// Header is the held answer's header while one is held.
func (rec *recorder) Header() http.Header {
	if rec.held != nil {
		return rec.held.header
	}
	return rec.ResponseWriterWrapper.Header()
}

// WriteHeader records the final status; informational ones pass by. The
// weight version a proxied answer names is the router's record of the
// worker that served it, never the worker's word: sglang reports none.
func (rec *recorder) WriteHeader(status int) {
	if a := rec.held; a != nil {
		if status < 200 || a.state != undecided {
			return
		}
		if a.status, a.state = status, a.judge(status); a.state != pass {
			return
		}
		rec.letThrough()
	}
	if rec.status == 0 && status >= 200 {
		rec.status = status
		if t := rec.ticket; t != nil {
			if v := t.VersionServed(); v != "" {
				rec.Header().Set(weightVersionHeader, v)
			} else {
				rec.Header().Del(weightVersionHeader)
			}
		}
		if rec.onHeader != nil {
			rec.onHeader(status)
		}
	}
	rec.ResponseWriterWrapper.WriteHeader(status)
}

// letThrough ends the hold: the held header becomes the client's.
func (rec *recorder) letThrough() {
	a := rec.held
	rec.held = nil
	h := rec.ResponseWriterWrapper.Header()
	for k, v := range a.header {
		h[k] = v
	}
	if a.truncated {
		h.Del("Content-Length")
	}
}

// passHeld gives the client the answer that was set aside, if any.
func (rec *recorder) passHeld() error {
	a := rec.held
	if a == nil || a.status == 0 || a.state == lost {
		rec.held = nil
		return nil
	}
	rec.letThrough()
	rec.WriteHeader(a.status)
	_, err := rec.Write(a.body)
	return err
}

// Write keeps up to peekLimit bytes of the body; an answer set aside keeps
// its first bytes only.
func (rec *recorder) Write(b []byte) (int, error) {
	if rec.status == 0 {
		rec.WriteHeader(http.StatusOK)
	}
	if a := rec.held; a != nil {
		if a.state == read && len(a.body)+len(b) > heldBodyLimit {
			// Too long to be the short answer being looked for.
			if err := rec.passHeld(); err != nil {
				return 0, err
			}
			return rec.Write(b)
		}
		kept := min(heldBodyLimit-len(a.body), len(b))
		a.body, a.truncated = append(a.body, b[:kept]...), a.truncated || kept < len(b)
		return len(b), nil
	}
	if room := rec.peekLimit - len(rec.peek); room > 0 {
		rec.observe(b[:min(room, len(b))])
	}
	return rec.ResponseWriterWrapper.Write(b)
}

// observe keeps b, the next bytes of the answer within peekLimit, or
// hands them to onPeek. What onPeek reads from the first write alone (an
// answer's start usually comes whole) is not copied.
func (rec *recorder) observe(b []byte) {
	if len(rec.peek) == 0 && rec.onPeek != nil && rec.onPeek(b) {
		rec.onPeek, rec.peekLimit = nil, 0
		return
	}
	rec.peek = append(rec.peek, b...)
	if rec.onPeek != nil && rec.onPeek(rec.peek) {
		rec.onPeek, rec.peekLimit = nil, len(rec.peek)
	}
}

// ReadFrom keeps the fast path of the underlying writer unless the body is
// being peeked at or held.
func (rec *recorder) ReadFrom(r io.Reader) (int64, error) {
	if rec.peekLimit > 0 || rec.held != nil {
		return io.Copy(writerOnly{rec}, r)
	}
	if rec.status == 0 {
		rec.WriteHeader(http.StatusOK)
	}
	return rec.ResponseWriterWrapper.ReadFrom(r)
}

// FlushError flushes what the client has been sent; a held answer has
// nothing to flush.
func (rec *recorder) FlushError() error {
	if rec.held != nil {
		return nil
	}
	return http.NewResponseController(rec.ResponseWriterWrapper.ResponseWriter).Flush()
}

// writerOnly hides ReadFrom so io.Copy goes through Write.
type writerOnly struct{ io.Writer }
