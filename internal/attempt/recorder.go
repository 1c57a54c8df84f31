package attempt

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"go.opentelemetry.io/otel/trace"

	"github.com/miles-rollout/miles-diffusion-router/internal/answer"
	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// Recorder is the client's end of a request: it notes the status the
// client got, names the weight version of the worker that served a proxied
// answer, and, while an attempt runs, keeps the answer's first bytes for
// its kind of job or holds the answer back until it is the client's;
// everything else streams straight through.
type Recorder struct {
	http.ResponseWriter // the client's
	// Tracer is the job's, when its site traces requests; nil: not traced.
	Tracer trace.Tracer
	run    *Runner           // the rules of the attempt under way; nil before the first
	ticket *scheduler.Ticket // the attempt's
	// slot is the claim of the attempt under way on its worker, kept here
	// by value: a Recorder serves one attempt at a time, and the slot
	// costs no allocation of its own.
	slot      slot
	freeEarly bool // release slot as the answer begins (see send)
	status    int  // the status the client got; 0 until then
	peekLimit int
	peek      []byte
	held      *heldAnswer // the answer of an attempt, until it is known to be the client's
	// heldBuf is where held points while an answer is held: a Recorder
	// holds one answer at a time, which thus costs no allocation of its own.
	heldBuf heldAnswer
	// checks says the attempt's 2xx answers are held back until whole, or
	// checked as they stream: a worker's answer with a body (not a HEAD's).
	checks bool
	stream *answer.Stream // the check of a 2xx answer streaming to the client
	// learns says the peek is read (Kinds.Learn) each time it grows, before
	// the bytes that grew it go out, until it had what it needs.
	learns bool
	// stall ends the attempt under way if its held answer stops coming.
	stall *stallWatch
	// tries counts the job's attempts.
	tries tries
}

// NewRecorder is the client's end of a request answered through w.
func NewRecorder(w http.ResponseWriter) *Recorder { return &Recorder{ResponseWriter: w} }

// Status is the status the client got; 0 until then.
func (rec *Recorder) Status() int { return rec.status }

// Unwrap is the client's writer, for http.ResponseController.
func (rec *Recorder) Unwrap() http.ResponseWriter { return rec.ResponseWriter }

// Push passes an HTTP/2 server push on to the client's writer, as Caddy's
// own response wrappers do.
func (rec *Recorder) Push(target string, opts *http.PushOptions) error {
	if p, ok := rec.ResponseWriter.(http.Pusher); ok {
		return p.Push(target, opts)
	}
	return http.ErrNotSupported
}

// heldAnswer is a worker's answer kept from the client until it is judged
// to be the client's: while the job may still run on another worker, or
// while a 2xx answer has not all come and been checked.
type heldAnswer struct {
	header http.Header
	judge  judge
	// race, when set, is the hedge's race the answer is in, as racer's:
	// it becomes the client's only if no other copy's already is. It is
	// claimed as the answer is let through.
	race      *race
	racer     *scheduler.Ticket
	rerun     bool // the job may run again after this answer
	state     verdict
	status    int    // the worker's status; 0 until it answered
	body      []byte // the first heldBodyLimit bytes of an answer set aside
	truncated bool   // the body was longer than what was kept
	whole     answer.Held
	format    answer.Format
	length    int64 // the Content-Length the worker declared; -1: none
	broken    error // why a kept answer is not whole
}

// verdict is what becomes of a held answer.
type verdict uint8

const (
	undecided verdict = iota // the worker has not answered yet
	pass                     // the client gets it
	drop                     // set aside: the job runs again, unless it cannot
	read                     // set aside until its first bytes decide
	lost                     // another copy of the job answered first, or the router ended the attempt
	kept                     // a 2xx held whole until it has all come and is checked
	broken                   // kept, and broke off or is not whole: none of it reaches the client
)

// heldBodyLimit bounds what is kept of an answer set aside. Error answers
// are short; one being read that outgrows this is passed on.
const heldBodyLimit = 16 << 10

// hold makes rec keep the next answer from the client until j lets it
// through; rerun says whether the job may run again after it.
func (rec *Recorder) hold(j judge, rerun bool) *heldAnswer {
	rec.heldBuf = heldAnswer{header: make(http.Header), judge: j, rerun: rerun}
	rec.held = &rec.heldBuf
	return rec.held
}

// Header is the held answer's header while one is held.
func (rec *Recorder) Header() http.Header {
	if rec.held != nil {
		return rec.held.header
	}
	return rec.ResponseWriter.Header()
}

// WriteHeader records the final status; informational ones pass by. The
// weight version a proxied answer names is the router's record of the
// worker that served it, never the worker's word: sglang reports none.
func (rec *Recorder) WriteHeader(status int) {
	if a := rec.held; a != nil {
		if status < 200 || a.state != undecided {
			return
		}
		a.status, a.state = status, a.judge.verdict(status)
		if a.state != pass || rec.keep(a) || !rec.letThrough() {
			rec.stall.arm()
			return
		}
		rec.checkStream(a)
	}
	if rec.status == 0 && status >= 200 {
		rec.status = status
		if t := rec.ticket; t != nil {
			if v := t.VersionServed(); v != "" {
				rec.Header().Set(request.VersionHeader, v)
			} else {
				rec.Header().Del(request.VersionHeader)
			}
			if status/100 == 3 {
				rec.run.relocate(rec.Header())
			}
		}
		rec.answered()
	}
	rec.ResponseWriter.WriteHeader(status)
}

// relocate makes the Location of a worker's redirect that names a
// worker of the pool a path on the router (its path and query), so that
// the client follows it through the router and never learns a worker's
// address: uvicorn redirects /v1/set_lora/ to http://<the Host it was
// sent, the worker's>/v1/set_lora. Any other Location passes as it is.
func (run *Runner) relocate(h http.Header) {
	u, err := url.Parse(h.Get("Location"))
	if err != nil || u.Host == "" {
		return
	}
	scheme := u.Scheme
	if scheme == "" {
		scheme = "http" // a scheme-relative //host/path
	}
	if _, ok := run.Pool.Worker(scheme + "://" + u.Host); ok {
		h.Set("Location", u.RequestURI())
	}
}

// answered releases the attempt's worker, once, as its answer begins,
// when the attempt frees it early.
func (rec *Recorder) answered() {
	if rec.freeEarly {
		rec.freeEarly = false
		s := &rec.slot
		s.release(s.run.ended(s.r, rec, s.t, nil))
	}
}

// keep holds a's answer whole when it is a 2xx with a body (not a stream
// of events) that fits what may be held, and reports whether it does.
// Either way, the worker's answer has begun.
func (rec *Recorder) keep(a *heldAnswer) bool {
	if !rec.checks || !checked(a.status) {
		return false
	}
	contentType := a.header.Get("Content-Type")
	if strings.HasPrefix(contentType, "text/event-stream") {
		return false
	}
	a.format, a.length = rec.formatOf(contentType), contentLength(a.header)
	whole, err := rec.run.Budget.Hold(a.length)
	if err != nil {
		rec.run.streamedFor(err)
		return false
	}
	a.whole, a.state = whole, kept
	rec.answered()
	return true
}

// checked reports whether an answer of status is one the client must get
// whole: a success with a body.
func checked(status int) bool {
	return status >= 200 && status <= 299 && status != http.StatusNoContent
}

// streamedFor counts an answer that streams because of err, the budget's
// refusal.
func (run *Runner) streamedFor(err error) {
	reason := "size"
	if err == answer.ErrNoRoom {
		reason = "budget"
	}
	run.Metrics.Streamed.WithLabelValues(reason).Inc()
}

// contentLength is the length h declares, or -1.
func contentLength(h http.Header) int64 {
	n, err := strconv.ParseInt(h.Get("Content-Length"), 10, 64)
	if err != nil || n < 0 {
		return -1
	}
	return n
}

// checkStream checks a's answer, which streams to the client, as it
// passes, when it is a worker's 2xx whose format has a structure.
func (rec *Recorder) checkStream(a *heldAnswer) {
	if rec.checks && checked(a.status) {
		rec.stream = answer.NewStream(rec.formatOf(a.header.Get("Content-Type")), contentLength(a.header))
	}
}

// formatOf is the format a 2xx answer labelled contentType is checked for:
// a job's, what its endpoint answers (see request.Endpoint.Answers), so
// that the worker's label alone cannot make a success of a page of HTML.
func (rec *Recorder) formatOf(contentType string) answer.Format {
	if t := rec.ticket; t != nil && t.Job {
		return t.Route.Answers.Expect(contentType)
	}
	return answer.FormatOf(contentType)
}

// letThrough ends the hold, unless the answer lost its race to another
// copy's: the held header becomes the client's.
func (rec *Recorder) letThrough() bool {
	a := rec.held
	if a.race != nil && !a.race.claim(a.racer) {
		a.state = lost
		return false
	}
	rec.held = nil
	rec.stall.disarm() // from now on the client's pace sets the answer's
	h := rec.ResponseWriter.Header()
	for k, v := range a.header {
		h[k] = v
	}
	if a.truncated {
		h.Del("Content-Length")
	}
	return true
}

// passHeld gives the client the answer that was set aside, if any: a
// broken one as the error it is.
func (rec *Recorder) passHeld() error {
	a := rec.held
	switch {
	case a == nil:
		return nil
	case a.state == broken:
		rec.dropHeld()
		status, what := http.StatusBadGateway, "was cut short"
		switch {
		case a.broken == errStalled:
			status, what = http.StatusGatewayTimeout, "stalled"
		case !answer.CutShort(a.broken):
			what = "is not the " + a.format.String() + " its endpoint answers"
		}
		return answer.WriteError(rec, status, fmt.Sprintf("Worker request failed: its %d answer %s (%v)", a.status, what, a.broken))
	case a.status == 0 || a.state == lost || a.state == kept:
		rec.dropHeld()
		return nil
	}
	if !rec.letThrough() {
		return nil
	}
	rec.WriteHeader(a.status)
	_, err := rec.Write(a.body)
	return err
}

// dropHeld lets go of the held answer, and of the room a whole one took.
func (rec *Recorder) dropHeld() {
	if a := rec.held; a != nil {
		a.whole.Release()
		rec.held = nil
	}
}

// settle ends the hold on a 2xx answer kept whole, once its attempt ended
// with err: an answer that came whole goes to the client, unless another
// copy's did; one that broke off, or whose JSON or msgpack is cut short,
// is broken. ended says the router ended the attempt (upstream_timeout, a
// copy that won, the client gone): its answer is lost, no fault of the
// worker's.
func (rec *Recorder) settle(err error, ended bool) error {
	a := rec.held
	if a == nil || a.state != kept {
		return nil
	}
	defer a.whole.Release()
	switch {
	case err == nil:
		if a.broken = a.format.Check(a.whole.Body()); a.broken == nil {
			return rec.passKept(a)
		}
	case ended:
		a.state = lost
		return nil
	default:
		a.broken = err
	}
	a.state = broken
	return nil
}

// passKept gives the client a kept answer that came whole.
func (rec *Recorder) passKept(a *heldAnswer) error {
	if !rec.letThrough() {
		return nil
	}
	rec.WriteHeader(a.status)
	_, err := rec.Write(a.whole.Body())
	return err
}

// outgrown passes on a kept answer that grew past what may be held: the
// client gets what came so far and b, and the rest streams, checked as it
// passes.
func (rec *Recorder) outgrown(a *heldAnswer, b []byte) (int, error) {
	defer a.whole.Release()
	a.state = pass
	if !rec.letThrough() {
		return len(b), nil
	}
	rec.stream = answer.NewStream(a.format, a.length)
	rec.WriteHeader(a.status)
	if _, err := rec.Write(a.whole.Body()); err != nil {
		return 0, err
	}
	return rec.Write(b)
}

// Write keeps up to peekLimit bytes of the body; an answer held whole is
// kept whole, an answer set aside keeps its first bytes only.
func (rec *Recorder) Write(b []byte) (int, error) {
	if rec.status == 0 {
		rec.WriteHeader(http.StatusOK)
	}
	if a := rec.held; a != nil {
		return rec.holdBytes(a, b)
	}
	if room := rec.peekLimit - len(rec.peek); room > 0 {
		rec.observe(b[:min(room, len(b))])
	}
	if rec.stream != nil {
		return rec.stream.Pass(rec.ResponseWriter, b)
	}
	return rec.ResponseWriter.Write(b)
}

// observe keeps b, the next bytes of the answer within peekLimit, or
// learns from them. What is learned from the first write alone (an
// answer's start usually comes whole) is not copied.
func (rec *Recorder) observe(b []byte) {
	if len(rec.peek) == 0 && rec.learned(b) {
		rec.learns, rec.peekLimit = false, 0
		return
	}
	rec.peek = append(rec.peek, b...)
	if rec.learned(rec.peek) {
		rec.learns, rec.peekLimit = false, len(rec.peek)
	}
}

// learned has the job's kind learn what peek, the start of the
// attempt's answer, tells, and reports whether it had all it needed: an
// answer that is no 2xx tells nothing.
func (rec *Recorder) learned(peek []byte) bool {
	if !rec.learns {
		return false
	}
	s := &rec.slot
	return rec.status < 200 || rec.status > 299 || rec.run.Kinds.Learn(s.r, s.t, peek)
}

// holdBytes keeps b, the next bytes of a held answer.
func (rec *Recorder) holdBytes(a *heldAnswer, b []byte) (int, error) {
	rec.stall.arm()
	switch {
	case a.state == kept:
		err := a.whole.Add(b)
		if err == nil {
			return len(b), nil
		}
		rec.run.streamedFor(err)
		return rec.outgrown(a, b)
	case a.state == read && len(a.body)+len(b) > heldBodyLimit:
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

// finishStream ends the check of an answer that streamed to the client:
// whole, its withheld last byte goes out; not, the client's answer is
// aborted, as for an answer that broke off (see send).
func (rec *Recorder) finishStream() {
	s := rec.stream
	if s == nil {
		return
	}
	rec.stream = nil
	if err := s.Finish(rec.ResponseWriter); err != nil {
		panic(http.ErrAbortHandler)
	}
}

// reset breaks the client's connection (TCP RST, SO_LINGER 0), so that no
// client reads an answer cut short as one that ended. Under TLS it closes
// the TCP connection beneath, so that no close_notify ends the answer
// cleanly either. Where the connection is not the answer's own (HTTP/2,
// HTTP/3), the caller's abort resets the stream; where Caddy wrapped it
// (for its access log), it is closed.
func (rec *Recorder) reset() {
	conn, _, err := http.NewResponseController(rec.ResponseWriter).Hijack()
	if err != nil {
		return
	}
	if tc, ok := conn.(interface{ NetConn() net.Conn }); ok {
		conn = tc.NetConn()
	}
	if tc, ok := conn.(interface{ SetLinger(int) error }); ok {
		_ = tc.SetLinger(0)
	}
	_ = conn.Close()
}

// ReadFrom keeps the fast path of the underlying writer unless the body is
// being peeked at, held or checked.
func (rec *Recorder) ReadFrom(r io.Reader) (int64, error) {
	if rec.peekLimit > 0 || rec.held != nil || rec.stream != nil {
		return io.Copy(writerOnly{rec}, r)
	}
	if rec.status == 0 {
		rec.WriteHeader(http.StatusOK)
	}
	if rf, ok := rec.ResponseWriter.(io.ReaderFrom); ok {
		return rf.ReadFrom(r)
	}
	return io.Copy(writerOnly{rec.ResponseWriter}, r)
}

// FlushError flushes what the client has been sent; a held answer has
// nothing to flush.
func (rec *Recorder) FlushError() error {
	if rec.held != nil {
		return nil
	}
	return http.NewResponseController(rec.ResponseWriter).Flush()
}

// writerOnly hides ReadFrom so io.Copy goes through Write.
type writerOnly struct{ io.Writer }
