package diffusionrouter

import (
	"context"
	"encoding/json"
	"io"
	"net/http"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

type ticketKey struct{}

// withTicket carries a ticket through reverse_proxy, whose request clone
// keeps the context.
func withTicket(ctx context.Context, t *ticket) context.Context {
	return context.WithValue(ctx, ticketKey{}, t)
}

func ticketFrom(ctx context.Context) *ticket {
	t, _ := ctx.Value(ticketKey{}).(*ticket)
	return t
}

// writeJSON answers with v as JSON.
func writeJSON(w http.ResponseWriter, status int, v any) error {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	return json.NewEncoder(w).Encode(v)
}

// writeError answers with the error shape of the Python router:
// {"error": "..."}.
func writeError(w http.ResponseWriter, status int, msg string) error {
	return writeJSON(w, status, map[string]string{"error": msg})
}

// weightVersionHeader names the weight version that served a generation,
// and, on a request, the only version that may serve it.
const weightVersionHeader = "X-Weight-Version"

// recorder notes the status of a proxied response, names the weight version
// of the worker that served it, and, when asked, keeps its first bytes;
// everything else streams straight through.
type recorder struct {
	// A value, not a pointer: one allocation per request rather than two.
	caddyhttp.ResponseWriterWrapper
	ticket    *ticket
	onHeader  func(status int) // called once the final status is known
	status    int
	peekLimit int
	peek      []byte
}

// WriteHeader records the final status; informational ones pass by. The
// weight version a proxied answer names is the router's record of the
// worker that served it, never the worker's word: sglang reports none.
func (rec *recorder) WriteHeader(status int) {
	if rec.status == 0 && status >= 200 {
		rec.status = status
		if t := rec.ticket; t != nil {
			if v := t.versionServed(); v != "" {
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

// versionServed is the weight version the router records for the worker
// that served t; for a worker whose model id is not known yet (its
// /v1/models did not answer), the pool's.
func (t *ticket) versionServed() string {
	if t.servedVersion != "" || t.pool == nil {
		return t.servedVersion
	}
	return t.pool.stats().version
}

// Write keeps up to peekLimit bytes of the body.
func (rec *recorder) Write(b []byte) (int, error) {
	if rec.status == 0 {
		rec.WriteHeader(http.StatusOK)
	}
	if room := rec.peekLimit - len(rec.peek); room > 0 {
		rec.peek = append(rec.peek, b[:min(room, len(b))]...)
	}
	return rec.ResponseWriterWrapper.Write(b)
}

// ReadFrom keeps the fast path of the underlying writer unless the body is
// being peeked at.
func (rec *recorder) ReadFrom(r io.Reader) (int64, error) {
	if rec.peekLimit > 0 {
		return io.Copy(writerOnly{rec}, r)
	}
	if rec.status == 0 {
		rec.WriteHeader(http.StatusOK)
	}
	return rec.ResponseWriterWrapper.ReadFrom(r)
}

// writerOnly hides ReadFrom so io.Copy goes through Write.
type writerOnly struct{ io.Writer }
