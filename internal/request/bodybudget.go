package request

import (
	"context"
	"errors"
	"io"
	"os"
	"sync"
	"time"
)

// A body is held in memory taken as its bytes arrive, a chunk at a time,
// never in one buffer sized from what its Content-Length announces. Room
// for it in the budget is another matter: a body that tells its length
// takes room for all of it once its first byte has arrived, so that a body
// let in can always finish. Were room taken a chunk at a time, uploads
// under way together could fill the budget halfway each and wait for each
// other until their time ran out. A body that does not tell its length
// takes room a chunk at a time, and gives up after RoomWait like any other
// wait for room.
const (
	// FirstChunk is the size of a body's first chunk: most jobs' JSON fits
	// in it.
	FirstChunk = 4 << 10
	// BodyChunk is the size of a body's later chunks.
	BodyChunk = 64 << 10
	// SmallBody is the largest declared length that may use the budget's
	// reserve.
	SmallBody = 1 << 20
	// RoomWait is how long a body may wait for room before it is refused.
	RoomWait = 5 * time.Second
)

var (
	// ErrNoRoom ends a body that waited RoomWait for room.
	ErrNoRoom = errors.New("the router holds as many request bodies as max_body_total allows; send it again later")
	// ErrBodyTimeout ends a body that took longer than body_timeout to
	// arrive.
	ErrBodyTimeout = errors.New("request body did not arrive within body_timeout")
	// errLonger ends a body that goes on past the length it declared.
	errLonger = errors.New("request body is longer than its Content-Length")
)

// Gauge is where a budget reports the bytes it holds (a Prometheus gauge
// satisfies it).
type Gauge interface{ Add(float64) }

// Chunks not in use, kept for the next bodies rather than made anew.
var (
	firstChunks = sync.Pool{New: func() any { return new([FirstChunk]byte) }}
	bodyChunks  = sync.Pool{New: func() any { return new([BodyChunk]byte) }}
)

// BodyBudget bounds the bytes of request bodies held at once. An eighth of
// it (less where a body of max_body would not fit beside it) is kept for
// bodies that declare at most SmallBody, so that ordinary jobs pass while
// large uploads wait.
type BodyBudget struct {
	total, reserve, maxBody int64
	gauge                   Gauge
	after                   func(time.Duration) <-chan time.Time // the clock of waits for room

	mu      sync.Mutex
	held    int64
	waiters []*waiter // in the order they came
}

// waiter is a body waiting for room for size bytes; ready is closed once
// they are taken for it.
type waiter struct {
	size    int64
	small   bool
	ready   chan struct{}
	granted bool
}

// NewBodyBudget holds at most total bytes of bodies; maxBody, the largest
// body, always fits. gauge, when not nil, follows the bytes held.
func NewBodyBudget(total, maxBody int64, gauge Gauge) *BodyBudget {
	return &BodyBudget{
		total:   total,
		reserve: max(0, min(total/8, total-maxBody)),
		maxBody: maxBody,
		gauge:   gauge,
		after:   time.After,
	}
}

// Held is the bytes of bodies held now: those read and those let in.
func (b *BodyBudget) Held() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.held
}

// Read reads body whole within the budget; length is its declared length
// (-1: none), at most max_body, and deadline its body_timeout (the caller
// sets it on the connection too, so that a read blocked on a silent sender
// ends). The body's len(data) bytes stay taken from the budget until the
// caller gives them back with Release. The error is ErrNoRoom,
// ErrBodyTimeout, ctx's when its client left while it waited for room, or
// the read's (io.ErrUnexpectedEOF for a body cut short).
func (b *BodyBudget) Read(ctx context.Context, body io.Reader, length int64, deadline time.Time) (data []byte, err error) {
	r := bodyRead{budget: b, length: length}
	defer func() {
		if err != nil {
			r.giveBack()
		}
	}()
	for {
		// A chunk is taken once a byte for it has arrived: a sender that
		// sends nothing holds nothing, and a body that ends at a chunk's
		// end needs no room beyond it.
		var next [1]byte
		if _, err := io.ReadFull(body, next[:]); err == io.EOF {
			return r.whole(), nil
		} else if err != nil {
			return nil, readError(err)
		}
		if err := r.makeRoom(ctx, deadline); err != nil {
			return nil, err
		}
		chunk := r.newChunk()
		chunk[0] = next[0]
		got, err := fill(body, chunk[1:])
		r.n += 1 + got
		if err == io.EOF {
			return r.whole(), nil
		}
		if err != nil {
			return nil, readError(err)
		}
	}
}

// fill reads into chunk until it is full or the body ends (io.EOF); a
// body cut short is the reader's io.ErrUnexpectedEOF, not its end.
func fill(body io.Reader, chunk []byte) (int, error) {
	n := 0
	for n < len(chunk) {
		got, err := body.Read(chunk[n:])
		n += got
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// readError is what a failed read of a body means: ErrBodyTimeout when
// the connection's read deadline, body_timeout, ended it, else the read's
// own error.
func readError(err error) error {
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return ErrBodyTimeout
	}
	return err
}

// Release gives back the n bytes of a body Read returned, once its
// request has ended.
func (b *BodyBudget) Release(n int) { b.give(int64(n)) }

// bodyRead is one body being read: its chunks, the bytes in them and the
// room it has taken.
type bodyRead struct {
	budget *BodyBudget
	length int64 // declared; -1: none
	chunks [][]byte
	n      int
	room   int64
}

// makeRoom takes room for the chunk about to be read: a body that
// declared its length takes room for all of it at its first chunk, one
// that did not, room for each chunk.
func (r *bodyRead) makeRoom(ctx context.Context, deadline time.Time) error {
	want := r.chunkSize()
	switch {
	case r.length >= 0 && int64(r.n) >= r.length:
		return errLonger
	case r.length >= 0 && len(r.chunks) > 0:
		return nil
	case r.length >= 0:
		want = min(r.length, r.budget.maxBody)
	}
	if err := r.budget.take(ctx, want, r.length >= 0 && r.length <= SmallBody, deadline); err != nil {
		return err
	}
	r.room += want
	return nil
}

// chunkSize is the size of the body's next chunk: no more than a body of
// max_body needs, so that one always fits a budget of max_body.
func (r *bodyRead) chunkSize() int64 {
	if len(r.chunks) == 0 {
		return min(FirstChunk, r.budget.maxBody)
	}
	return max(1, min(BodyChunk, r.budget.maxBody-int64(r.n)))
}

// newChunk adds a chunk for the body's next bytes.
func (r *bodyRead) newChunk() []byte {
	var chunk []byte
	switch size := r.chunkSize(); size {
	case FirstChunk:
		chunk = firstChunks.Get().(*[FirstChunk]byte)[:]
	case BodyChunk:
		chunk = bodyChunks.Get().(*[BodyChunk]byte)[:]
	default: // a body's last, cut to max_body
		chunk = make([]byte, size)
	}
	r.chunks = append(r.chunks, chunk)
	return chunk
}

// whole copies the body into one slice of its size, gives its chunks
// back, and keeps only its size of the room it took.
func (r *bodyRead) whole() []byte {
	var data []byte
	if r.n > 0 {
		data = make([]byte, 0, r.n)
		for _, c := range r.chunks {
			data = append(data, c[:min(len(c), r.n-len(data))]...)
		}
	}
	r.room -= int64(r.n)
	r.giveBack()
	return data
}

// giveBack returns the body's chunks to their pools and the room it still
// holds to the budget.
func (r *bodyRead) giveBack() {
	for _, c := range r.chunks {
		switch len(c) {
		case FirstChunk:
			firstChunks.Put((*[FirstChunk]byte)(c))
		case BodyChunk:
			bodyChunks.Put((*[BodyChunk]byte)(c))
		}
	}
	r.chunks = nil
	r.budget.give(r.room)
	r.room = 0
}

// take takes size bytes of room for a body, small telling whether it may
// use the reserve, waiting for them up to RoomWait and its deadline.
func (b *BodyBudget) take(ctx context.Context, size int64, small bool, deadline time.Time) error {
	b.mu.Lock()
	if b.fits(size, small) { // the waiters before it do not fit: none is passed over
		b.charge(size)
		b.mu.Unlock()
		return nil
	}
	w := &waiter{size: size, small: small, ready: make(chan struct{})}
	b.waiters = append(b.waiters, w)
	b.mu.Unlock()
	select {
	case <-w.ready:
		return nil
	case <-b.after(RoomWait):
		return b.leave(w, ErrNoRoom)
	case <-b.after(time.Until(deadline)):
		return b.leave(w, ErrBodyTimeout)
	case <-ctx.Done():
		return b.leave(w, ctx.Err())
	}
}

// leave takes a waiter that gave up out of the queue, and gives back the
// room it was granted meanwhile.
func (b *BodyBudget) leave(w *waiter, err error) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if w.granted {
		b.charge(-w.size)
	}
	b.waiters = deleteWaiter(b.waiters, w)
	b.serve()
	return err
}

func deleteWaiter(waiters []*waiter, w *waiter) []*waiter {
	for i, other := range waiters {
		if other == w {
			return append(waiters[:i], waiters[i+1:]...)
		}
	}
	return waiters
}

// give returns n bytes of room to the budget.
func (b *BodyBudget) give(n int64) {
	if n == 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.charge(-n)
	b.serve()
}

// serve grants room to every waiter it fits, in the order they came: a
// small body need not wait behind a large one there is no room for, and
// one there is no room for long gives up at RoomWait. Called with b.mu
// held.
func (b *BodyBudget) serve() {
	kept := b.waiters[:0]
	for _, w := range b.waiters {
		if b.fits(w.size, w.small) {
			b.charge(w.size)
			w.granted = true
			close(w.ready)
			continue
		}
		kept = append(kept, w)
	}
	clear(b.waiters[len(kept):])
	b.waiters = kept
}

// fits reports whether size bytes of room for a body fit beside what is
// held, small telling whether it may use the reserve. Called with b.mu
// held.
func (b *BodyBudget) fits(size int64, small bool) bool {
	limit := b.total - b.reserve
	if small {
		limit = b.total
	}
	return b.held+size <= limit
}

// charge adds delta to the bytes held. Called with b.mu held.
func (b *BodyBudget) charge(delta int64) {
	b.held += delta
	if b.gauge != nil {
		b.gauge.Add(float64(delta))
	}
}
