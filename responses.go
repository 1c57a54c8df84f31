package diffusionrouter

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"

	"github.com/miles-rollout/miles-diffusion-router/internal/answer"
	"github.com/miles-rollout/miles-diffusion-router/internal/control"
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
	ticket *scheduler.Ticket
	// slot is the claim of the attempt under way on its worker, kept here
	// by value: a recorder serves one attempt at a time, and the slot
	// costs no allocation of its own.
	slot      slot
	freeEarly bool // release slot as the answer begins (see send)
	status    int  // the status the client got; 0 until then
	peekLimit int
	peek      []byte
	held      *heldAnswer // the answer of an attempt, until it is known to be the client's
	// heldBuf is where held points while an answer is held: a recorder
	// holds one answer at a time, which thus costs no allocation of its own.
	heldBuf heldAnswer
	// answers, when set, are the answers held back until they are whole
	// (a worker's, not the router's own); nil holds and checks nothing.
	answers *heldAnswers
	stream  *answer.Stream // the check of a 2xx answer streaming to the client
	// learn, when set, is what the peek tells of the worker's image jobs:
	// it is read each time it grows, before the bytes that grew it go out,
	// until it had what it needs (see learnImageJobs).
	learn  imageLearning
	tracer trace.Tracer // the job's, when its site traces requests; nil: not traced
	// stall ends the attempt under way if its held answer stops coming.
	stall *stallWatch
}

// heldAnswers are a handler's rules for holding answers back: its budget,
// and the count of answers that stream instead.
type heldAnswers struct {
	budget       *answer.Budget
	streamed     *prometheus.CounterVec // by reason: size, budget
	stallTimeout time.Duration          // answers.stall_timeout
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
	race      *hedge
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
func (rec *recorder) hold(j judge, rerun bool) *heldAnswer {
	rec.heldBuf = heldAnswer{header: make(http.Header), judge: j, rerun: rerun}
	rec.held = &rec.heldBuf
	return rec.held
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
				rec.Header().Set(weightVersionHeader, v)
			} else {
				rec.Header().Del(weightVersionHeader)
			}
		}
		rec.answered(status)
	}
	rec.ResponseWriterWrapper.WriteHeader(status)
}

// answered releases the attempt's worker, once, as its answer begins,
// when the attempt frees it early.
func (rec *recorder) answered(status int) {
	if rec.freeEarly {
		rec.freeEarly = false
		s := &rec.slot
		s.release(outcomeOf(s.r, s.t, nil, status))
	}
}

// keep holds a's answer whole when it is a 2xx with a body (not a stream
// of events) that fits what may be held, and reports whether it does.
// Either way, the worker's answer has begun.
func (rec *recorder) keep(a *heldAnswer) bool {
	if rec.answers == nil || !checked(a.status) {
		return false
	}
	contentType := a.header.Get("Content-Type")
	if strings.HasPrefix(contentType, "text/event-stream") {
		return false
	}
	a.format, a.length = rec.formatOf(contentType), contentLength(a.header)
	whole, err := rec.answers.budget.Hold(a.length)
	if err != nil {
		rec.answers.streamedFor(err)
		return false
	}
	a.whole, a.state = whole, kept
	rec.answered(a.status)
	return true
}

// checked reports whether an answer of status is one the client must get
// whole: a success with a body.
func checked(status int) bool {
	return status >= 200 && status <= 299 && status != http.StatusNoContent
}

// streamedFor counts an answer that streams because of err, the budget's
// refusal.
func (ha *heldAnswers) streamedFor(err error) {
	reason := "size"
	if err == answer.ErrNoRoom {
		reason = "budget"
	}
	ha.streamed.WithLabelValues(reason).Inc()
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
func (rec *recorder) checkStream(a *heldAnswer) {
	if rec.answers != nil && checked(a.status) {
		rec.stream = answer.NewStream(rec.formatOf(a.header.Get("Content-Type")), contentLength(a.header))
	}
}

// formatOf is the format a 2xx answer labelled contentType is checked for:
// a job's, what its endpoint answers (see request.Endpoint.Answers), so
// that the worker's label alone cannot make a success of a page of HTML.
func (rec *recorder) formatOf(contentType string) answer.Format {
	if t := rec.ticket; t != nil && t.Job {
		return t.Route.Answers.Expect(contentType)
	}
	return answer.FormatOf(contentType)
}

// letThrough ends the hold, unless the answer lost its race to another
// copy's: the held header becomes the client's.
func (rec *recorder) letThrough() bool {
	a := rec.held
	if a.race != nil && !a.race.claim(a.racer) {
		a.state = lost
		return false
	}
	rec.held = nil
	rec.stall.disarm() // from now on the client's pace sets the answer's
	h := rec.ResponseWriterWrapper.Header()
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
func (rec *recorder) passHeld() error {
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
		return control.WriteError(rec, status, fmt.Sprintf("Worker request failed: its %d answer %s (%v)", a.status, what, a.broken))
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
func (rec *recorder) dropHeld() {
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
func (rec *recorder) settle(err error, ended bool) error {
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
func (rec *recorder) passKept(a *heldAnswer) error {
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
func (rec *recorder) outgrown(a *heldAnswer, b []byte) (int, error) {
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
func (rec *recorder) Write(b []byte) (int, error) {
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
		return rec.stream.Pass(&rec.ResponseWriterWrapper, b)
	}
	return rec.ResponseWriterWrapper.Write(b)
}

// observe keeps b, the next bytes of the answer within peekLimit, or
// learns from them. What is learned from the first write alone (an
// answer's start usually comes whole) is not copied.
func (rec *recorder) observe(b []byte) {
	if len(rec.peek) == 0 && rec.learned(b) {
		rec.learn, rec.peekLimit = learnNothing, 0
		return
	}
	rec.peek = append(rec.peek, b...)
	if rec.learned(rec.peek) {
		rec.learn, rec.peekLimit = learnNothing, len(rec.peek)
	}
}

// learned learns what peek, the start of the attempt's answer, tells of
// the worker's image jobs, and reports whether it had all it needed:
// an answer that is no 2xx tells nothing.
func (rec *recorder) learned(peek []byte) bool {
	if rec.learn == learnNothing {
		return false
	}
	s := &rec.slot
	return rec.status < 200 || rec.status > 299 || s.h.learnImage(rec.learn, peek, s.t)
}

// holdBytes keeps b, the next bytes of a held answer.
func (rec *recorder) holdBytes(a *heldAnswer, b []byte) (int, error) {
	rec.stall.arm()
	switch {
	case a.state == kept:
		err := a.whole.Add(b)
		if err == nil {
			return len(b), nil
		}
		rec.answers.streamedFor(err)
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
func (rec *recorder) finishStream() {
	s := rec.stream
	if s == nil {
		return
	}
	rec.stream = nil
	if err := s.Finish(&rec.ResponseWriterWrapper); err != nil {
		panic(http.ErrAbortHandler)
	}
}

// reset breaks the client's connection (TCP RST, SO_LINGER 0), so that no
// client reads an answer cut short as one that ended. Under TLS it closes
// the TCP connection beneath, so that no close_notify ends the answer
// cleanly either. Where the connection is not the answer's own (HTTP/2,
// HTTP/3), the caller's abort resets the stream; where Caddy wrapped it
// (for its access log), it is closed.
func (rec *recorder) reset() {
	conn, _, err := http.NewResponseController(rec.ResponseWriterWrapper.ResponseWriter).Hijack()
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
func (rec *recorder) ReadFrom(r io.Reader) (int64, error) {
	if rec.peekLimit > 0 || rec.held != nil || rec.stream != nil {
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

// errStalled ends an attempt whose held answer went answers.stall_timeout
// without a byte.
var errStalled = errors.New("no byte of it came within answer_stall_timeout")

// stallWatch ends an attempt whose answer, held back, stops coming: no
// byte for its bound. It watches only while the answer is held: bytes
// held are copied into memory as they come, so a pause is the worker's;
// once the answer streams, a slow client may pause it too. One watch
// serves one attempt: a timer that fires late cancels nothing after it.
type stallWatch struct {
	bound  time.Duration
	cancel context.CancelCauseFunc // the attempt's
	timer  *time.Timer             // made at the first arm
	fired  atomic.Bool
}

// watchStalls watches the attempt that cancel ends, within bound.
func watchStalls(bound time.Duration, cancel context.CancelCauseFunc) *stallWatch {
	return &stallWatch{bound: bound, cancel: cancel}
}

// arm starts the bound again: the answer is held, and a byte just came.
func (s *stallWatch) arm() {
	switch {
	case s == nil:
	case s.timer == nil:
		s.timer = time.AfterFunc(s.bound, func() {
			s.fired.Store(true)
			s.cancel(errStalled)
		})
	default:
		s.timer.Reset(s.bound)
	}
}

// disarm stops watching: the answer streams, or the attempt ended.
func (s *stallWatch) disarm() {
	if s != nil && s.timer != nil {
		s.timer.Stop()
	}
}

// stalled reports whether the watch ended its attempt.
func (s *stallWatch) stalled() bool { return s != nil && s.fired.Load() }
