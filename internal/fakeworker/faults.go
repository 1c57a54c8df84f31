package fakeworker

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"strconv"
)

// Break is a way a worker breaks an answer it has started as a success:
// the gray failures a router must not pass on to its client as one.
type Break int

// The ways to break an answer. Each sends the status and headers of the
// answer and half of its body.
const (
	// BreakClose promises the whole body in Content-Length and closes the
	// connection after half of it, as a worker process dying mid-answer.
	BreakClose Break = iota + 1
	// BreakReset does the same and then resets the connection (TCP RST,
	// SO_LINGER 0), as a crashed host or a proxy in between would.
	BreakReset
	// BreakTruncate completes the HTTP answer, its Content-Length matching,
	// with a body cut in half: the HTTP framing is whole and the JSON or
	// msgpack in it is not, as when a serializer died or a proxy cut it.
	// The connection stays open for the next request.
	BreakTruncate
	// BreakHTML answers 200 with a whole HTML page, labelled text/html,
	// instead of the endpoint's JSON or msgpack, as a proxy or load
	// balancer in front of a worker may when it, not the worker, answers.
	BreakHTML
	// BreakStall sends the status, the headers with the whole body's
	// Content-Length and half the body, then nothing: the connection stays
	// open and silent until the client leaves or the worker closes, as a
	// worker wedged mid-answer.
	BreakStall
)

func (b Break) String() string {
	switch b {
	case BreakClose:
		return "close"
	case BreakReset:
		return "reset"
	case BreakTruncate:
		return "truncate"
	case BreakHTML:
		return "html"
	case BreakStall:
		return "stall"
	}
	return "none"
}

// SetBreakRate makes that fraction of the successful generation answers
// from now on break the way b says (1: every one), as Config's CloseRate,
// ResetRate, TruncateRate, HTMLRate and StallRate do from the start; 0
// ends it.
func (w *Worker) SetBreakRate(b Break, rate float64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if b >= BreakClose && b <= BreakStall {
		w.breakRates[b-BreakClose] = rate
	}
}

// SetOOMPixels makes every job from now on whose width×height reaches
// pixels fail as sglang does when CUDA runs out of memory, as
// Config.OOMPixels does from the start; 0 ends it.
func (w *Worker) SetOOMPixels(pixels int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.oomPixels = pixels
}

// drawBreak decides how a successful answer breaks, if it does. The draw
// comes from the rand of Config.Seed only while a rate is set, so that a
// worker without broken answers fails the same jobs as before.
func (w *Worker) drawBreak() Break {
	w.mu.Lock()
	defer w.mu.Unlock()
	var total float64
	for _, rate := range w.breakRates {
		total += rate
	}
	if total <= 0 {
		return 0
	}
	u := w.rng.Float64()
	for i, rate := range w.breakRates {
		if u < rate {
			w.stats.Broken++
			return BreakClose + Break(i)
		}
		u -= rate
	}
	return 0
}

// breakable lets the answers of a generation endpoint be broken. An answer
// is held only once it is known to break, at its first byte (a 2xx status);
// every other answer passes straight through.
func (w *Worker) breakable(h http.HandlerFunc) http.HandlerFunc {
	return func(rw http.ResponseWriter, r *http.Request) {
		bw := &breakWriter{ResponseWriter: rw, w: w}
		h(bw, r)
		bw.finish(r.Context())
	}
}

// breakWriter holds an answer that is to break, and sends it broken once
// the handler is done.
type breakWriter struct {
	http.ResponseWriter
	w       *Worker
	started bool  // the status is decided
	kind    Break // how the answer breaks; 0 passes it through
	status  int
	body    bytes.Buffer
}

func (b *breakWriter) WriteHeader(status int) {
	if b.started {
		b.ResponseWriter.WriteHeader(status) // net/http reports the superfluous call
		return
	}
	b.started = true
	if status >= 200 && status <= 299 {
		b.kind = b.w.drawBreak()
	}
	if b.kind == 0 {
		b.ResponseWriter.WriteHeader(status)
		return
	}
	b.status = status
}

func (b *breakWriter) Write(p []byte) (int, error) {
	if !b.started {
		b.WriteHeader(http.StatusOK)
	}
	if b.kind == 0 {
		return b.ResponseWriter.Write(p)
	}
	return b.body.Write(p)
}

// Flush passes through for answers that do not break; a breaking answer
// is sent at the end.
func (b *breakWriter) Flush() {
	if f, ok := b.ResponseWriter.(http.Flusher); ok && b.kind == 0 {
		f.Flush()
	}
}

// finish sends a breaking answer: the status, the headers with a
// Content-Length, and the first half of the body; then, by its kind, ends
// the answer there or cuts the connection. Write errors mean the client
// left; there is nothing more to break.
func (b *breakWriter) finish(ctx context.Context) {
	if b.kind == 0 {
		return
	}
	body := b.body.Bytes()
	cut := body[:len(body)/2]
	rw := b.ResponseWriter
	switch b.kind {
	case BreakHTML:
		rw.Header().Set("Content-Type", "text/html; charset=utf-8")
		rw.Header().Set("Content-Length", strconv.Itoa(len(htmlPage)))
		rw.WriteHeader(b.status)
		rw.Write([]byte(htmlPage))
		return
	case BreakTruncate:
		rw.Header().Set("Content-Length", strconv.Itoa(len(cut)))
		rw.WriteHeader(b.status)
		rw.Write(cut)
		return
	}
	rw.Header().Set("Content-Length", strconv.Itoa(len(body)))
	rw.WriteHeader(b.status)
	rw.Write(cut)
	rc := http.NewResponseController(rw)
	rc.Flush() // the headers and the half body go out before the connection ends
	if b.kind == BreakStall {
		select {
		case <-ctx.Done():
		case <-b.w.life.Done():
		}
		return
	}
	conn, _, err := rc.Hijack()
	if err != nil {
		// Not a connection of its own (HTTP/2, a recorder): ending the
		// handler this way drops the answer unfinished.
		panic(http.ErrAbortHandler)
	}
	if tc, ok := conn.(*net.TCPConn); ok && b.kind == BreakReset {
		tc.SetLinger(0) // close sends RST, not FIN
	}
	conn.Close()
}

// htmlPage is what BreakHTML answers: a whole page, nothing like the
// endpoint's answer.
const htmlPage = "<!DOCTYPE html>\n<html><head><title>Sign in</title></head><body><h1>Sign in to continue</h1></body></html>\n"

// oomError is the scheduler's error for a job of shape s that ran out of
// GPU memory: GPUWorker._execute_forward_common catches
// torch.OutOfMemoryError and sets OutputBatch.error to "Error executing
// request <id>: <exception>", the exception worded as PyTorch's caching
// allocator words it, here on an 80 GB card.
func oomError(s shape) error {
	const gib = 1 << 30
	want := float64(s.width) * float64(s.height) * float64(max(1, s.frames)) * 2048 / gib
	return schedulerError(fmt.Sprintf("Error executing request %s: CUDA out of memory. Tried to allocate %.2f GiB. "+
		"GPU 0 has a total capacity of 79.19 GiB of which 1.87 GiB is free. "+
		"Including non-PyTorch memory, this process has 77.31 GiB memory in use. "+
		"Of the allocated memory 72.46 GiB is allocated by PyTorch, and 3.12 GiB is reserved by PyTorch but unallocated. "+
		"If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  "+
		"See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
		newUUID(), want))
}
