// Package answer keeps a client from taking a worker's broken answer for a
// whole one. An answer is held back until it has all come, within a size
// per answer and a budget shared by every answer held at once, and its JSON
// or msgpack is checked for structure before the client gets any of it: a
// broken one may then run again elsewhere. An answer too large to hold
// streams, checked as it passes, its last byte withheld until the check
// passes, so that a client never holds a complete-looking body that is
// not. The router's own answers it writes as JSON, its errors in the
// Python router's shape, {"error": "..."}. It does not import Caddy.
package answer

import (
	"errors"
	"io"
	"math/bits"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/miles-rollout/miles-diffusion-router/internal/msgpack"
	"github.com/miles-rollout/miles-diffusion-router/internal/strictjson"
)

// Format is the structure an answer's body is checked for.
type Format uint8

const (
	// Opaque bodies (images, videos, text) have no structure to check:
	// their framing, Content-Length or chunks, is all that tells them
	// whole.
	Opaque Format = iota
	// JSON is application/json and any +json type.
	JSON
	// Msgpack is application/msgpack, as sglang-diffusion's rollout API
	// answers, and its older names.
	Msgpack
)

// FormatOf is the format of a body of the given Content-Type.
func FormatOf(contentType string) Format {
	mediaType, _, _ := strings.Cut(contentType, ";")
	switch t := strings.ToLower(strings.TrimSpace(mediaType)); {
	case t == "application/json" || strings.HasSuffix(t, "+json"):
		return JSON
	case t == "application/msgpack" || t == "application/x-msgpack" || t == "application/vnd.msgpack":
		return Msgpack
	}
	return Opaque
}

// Expect is the format an answer labelled contentType is checked for when
// its endpoint answers f: f, whatever the label says, so that a 200 page
// of HTML from a proxy in between is no success. A msgpack endpoint's
// answer labelled JSON is JSON: sglang's rollout API answered JSON before
// msgpack. Of an endpoint whose answers are Opaque, the label decides.
func (f Format) Expect(contentType string) Format {
	labelled := FormatOf(contentType)
	if f == Opaque || f == Msgpack && labelled == JSON {
		return labelled
	}
	return f
}

func (f Format) String() string {
	switch f {
	case JSON:
		return "JSON"
	case Msgpack:
		return "msgpack"
	}
	return "opaque"
}

// CutShort reports whether err, why an answer is not whole, says that it
// ended early (its JSON or msgpack ends inside a value, or its connection
// ended) rather than that it is not of its format at all.
func CutShort(err error) bool {
	for _, malformed := range []error{strictjson.ErrStructure, strictjson.ErrTrailing, msgpack.ErrInvalid, msgpack.ErrTrailing} {
		if errors.Is(err, malformed) {
			return false
		}
	}
	return true
}

// Check reports whether body, all of an answer, is whole in format f: nil,
// or why not.
func (f Format) Check(body []byte) error {
	switch f {
	case JSON:
		return strictjson.Whole(body)
	case Msgpack:
		return msgpack.Whole(body)
	}
	return nil
}

// Budget bounds the answers held back: each, and all at once, so that
// slow clients, which hold their answers' memory until they have read
// them, cannot make the router hold more. An answer takes the memory it is
// held in: up to 4 MiB, its size rounded up to a power of two, at least
// 4 KiB. It is safe for concurrent use.
type Budget struct {
	most int64        // largest answer held
	room atomic.Int64 // bytes not held now
}

// NewBudget holds answers of up to most bytes each, and of total bytes in
// all. A most of 0 or less holds none.
func NewBudget(most, total int64) *Budget {
	b := &Budget{most: most}
	b.room.Store(total)
	return b
}

// take reserves n bytes, or reports false. Two answers taking the last of
// the room at once may both be refused; neither may exceed it.
func (b *Budget) take(n int64) bool {
	if b.room.Add(-n) >= 0 {
		return true
	}
	b.room.Add(n)
	return false
}

// Why an answer is not held: it streams instead.
var (
	// ErrTooLarge is an answer larger than an answer held may be.
	ErrTooLarge = errors.New("larger than an answer held may be")
	// ErrNoRoom is an answer the budget has no room for while the answers
	// held now take it.
	ErrNoRoom = errors.New("no room left for answers held")
)

// Hold starts to hold an answer whose header declares length bytes (-1:
// not declared, as a chunked answer), or returns why not: ErrTooLarge or
// ErrNoRoom.
func (b *Budget) Hold(length int64) (Held, error) {
	switch {
	case length > b.most || b.most <= 0:
		return Held{}, ErrTooLarge
	case length < 0:
		return Held{budget: b}, nil
	}
	h := Held{budget: b}
	if err := h.grow(length); err != nil {
		return Held{}, err
	}
	return h, nil
}

// Held is an answer held back whole, its room taken from a budget until
// Release.
type Held struct {
	budget *Budget
	buf    *[]byte // the buffer, from buffers
	body   []byte  // what has been added, in *buf
}

// Add appends p to the answer. When the answer would grow larger than an
// answer held may be, or than the budget has room for, it adds nothing and
// returns ErrTooLarge or ErrNoRoom: the caller passes on what is held and
// streams the rest.
func (h *Held) Add(p []byte) error {
	need := int64(len(h.body) + len(p))
	switch {
	case need > h.budget.most:
		return ErrTooLarge
	case need > int64(cap(h.body)):
		// Doubling, so that an answer of undeclared length is copied
		// O(1) times over.
		if err := h.grow(max(need, min(2*int64(cap(h.body)), h.budget.most))); err != nil {
			return err
		}
	}
	h.body = append(h.body, p...)
	return nil
}

// grow moves the answer to a buffer of room for n bytes, taking what it
// adds to the room from the budget.
func (h *Held) grow(n int64) error {
	buf := buffers.get(n)
	if !h.budget.take(int64(cap(*buf) - cap(h.body))) {
		buffers.put(buf)
		return ErrNoRoom
	}
	*buf = append((*buf)[:0], h.body...)
	if h.buf != nil {
		buffers.put(h.buf)
	}
	h.buf, h.body = buf, *buf
	return nil
}

// Body is what has been added.
func (h *Held) Body() []byte { return h.body }

// Release gives the answer's room back to the budget, and its buffer for
// another answer: the body is not to be used after.
func (h *Held) Release() {
	if h.buf != nil {
		h.budget.room.Add(int64(cap(h.body)))
		buffers.put(h.buf)
	}
	*h = Held{}
}

// buffers keeps the buffers of the answers released, one pool for each
// power of two from 4 KiB to 4 MiB, so that holding an answer of the usual
// sizes (a 1024x1024 PNG is 2 MB of base64) costs a copy of it, not memory
// the runtime must zero (and the kernel map) for each answer and the
// collector reclaim. What the pools keep is what the answers held at once
// took, at most the budget, until the collector's second cycle after. A
// larger buffer goes back to the collector: a pool of those would keep
// tens of MB for the odd answer that large.
var buffers bufferPools

const minBufferShift, maxBufferShift = 12, 22

type bufferPools [maxBufferShift - minBufferShift + 1]sync.Pool

// get returns an empty buffer of room for at least n bytes: one of the
// pools' sizes, or n when it is larger.
func (p *bufferPools) get(n int64) *[]byte {
	shift := minBufferShift
	if n > 1<<minBufferShift {
		shift = bits.Len64(uint64(n - 1))
	}
	if shift > maxBufferShift {
		b := make([]byte, 0, n)
		return &b
	}
	if b, ok := p[shift-minBufferShift].Get().(*[]byte); ok {
		return b
	}
	b := make([]byte, 0, 1<<shift)
	return &b
}

// put keeps b for reuse, when it is of one of the pools' sizes. A writer
// never keeps what it was given to write, so once the client was given
// the answer, its buffer is free.
func (p *bufferPools) put(b *[]byte) {
	if c := cap(*b); c >= 1<<minBufferShift && c <= 1<<maxBufferShift && c&(c-1) == 0 {
		*b = (*b)[:0]
		p[bits.Len(uint(c))-1-minBufferShift].Put(b)
	}
}

// Stream is an answer too large to hold, passed on as it comes while its
// structure is checked. When its header declared its length, the byte that
// completes it is withheld until the check passes: until then no client
// can read a complete body. An answer of undeclared length is complete for
// the client only once the handler ends it (the last chunk), which the
// caller does only after Finish.
type Stream struct {
	check    checker
	left     int64 // bytes still to come by the declared length; -1: not declared
	last     [1]byte
	withheld bool
}

// checker is what strictjson.Stream and msgpack.Stream have in common.
type checker interface {
	Feed(p []byte)
	End() error
}

// NewStream checks an answer of format f and declared length (-1: not
// declared) as it passes; nil for an Opaque one, which has nothing to
// check.
func NewStream(f Format, length int64) *Stream {
	s := &Stream{left: length}
	switch f {
	case JSON:
		s.check = new(strictjson.Stream)
	case Msgpack:
		s.check = new(msgpack.Stream)
	default:
		return nil
	}
	return s
}

// Pass checks p, the next bytes of the answer, and writes them to w, less
// the byte that completes the declared length.
func (s *Stream) Pass(w io.Writer, p []byte) (int, error) {
	s.check.Feed(p)
	out := p
	if s.left -= int64(len(p)); s.left <= 0 && s.left+int64(len(p)) > 0 {
		out, s.last[0], s.withheld = p[:len(p)-1], p[len(p)-1], true
	}
	n, err := w.Write(out)
	if err == nil && s.withheld {
		n = len(p)
	}
	return n, err
}

// Finish checks the whole answer passed. When it is whole it writes the
// withheld byte to w; otherwise it returns why it is not, and the caller
// must break the client's connection rather than end the answer.
func (s *Stream) Finish(w io.Writer) error {
	if err := s.check.End(); err != nil || !s.withheld {
		return err
	}
	_, err := w.Write(s.last[:])
	return err
}
