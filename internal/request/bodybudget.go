package request

import (
	"context"
	"errors"
	"io"
	"os"
	"sync"
	"time"
)

// Body memory is taken from a budget shared by every body a router reads,
// a chunk at a time as the bytes arrive: what a client announces in
// Content-Length reserves nothing, and a sender that cannot be given room
// is simply not read from, so it waits on TCP.
const (
	// FirstChunk is the size of a body's first chunk: most jobs' JSON fits
	// in it, and it is reused rather than made anew for each request.
	FirstChunk = 4 << 10
	// BodyChunk is the size of a body's later chunks.
	BodyChunk = 64 << 10
	// SmallBody is the largest body that may use the budget's reserve.
	SmallBody = 1 << 20
	// RoomWait is how long a body may wait for room to start before it is
	// refused. One already being read waits for room as long as its
	// body_timeout lets it: refusing it would throw away what has arrived.
	RoomWait = 5 * time.Second
)

var (
	// ErrNoRoom ends a body that waited RoomWait for room to start in.
	ErrNoRoom = errors.New("the router holds as many request bodies as max_body_total allows; send it again later")
	// ErrBodyTimeout ends a body that took longer than body_timeout to
	// arrive.
	ErrBodyTimeout = errors.New("request body did not arrive within body_timeout")
)

// Gauge is where a budget reports the bytes it holds (a Prometheus gauge
// satisfies it).
type Gauge interface{ Add(float64) }

// BodyBudget bounds the bytes of request bodies held at once. An eighth of
// it (less where a body of max_body would not fit beside it) is kept for
// bodies of at most SmallBody, so that ordinary jobs pass while large
// uploads wait. Chunks given back while bodies wait for room go to them
// rather than to the garbage collector, so that memory under contention
// stays within the budget instead of growing with the garbage.
type BodyBudget struct {
	total, reserve int64
	maxBody        int64
	gauge          Gauge
	after          func(time.Duration) <-chan time.Time // the clock of waits for room

	mu      sync.Mutex
	held    int64
	waiters [2][]waiter // by smallness: [0] large, [1] small
	free    [][]byte    // chunks of BodyChunk given back while bodies waited
}

// waiter is a body waiting for room for a chunk of size bytes, which it
// is handed on ready.
type waiter struct {
	size  int64
	ready chan []byte
}

// firstChunks are the FirstChunk buffers not in use.
var firstChunks = sync.Pool{New: func() any { return new([FirstChunk]byte) }}

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

// Held is the bytes of bodies held now.
func (b *BodyBudget) Held() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.held
}

// Read reads body whole within the budget, small telling whether its
// declared length lets it use the reserve, by deadline (body_timeout; the
// caller sets it on the connection too, so that a read blocked on a
// silent sender ends). The body's len(data) bytes stay taken from the
// budget until the caller gives them back with Release. The error is
// ErrNoRoom, ErrBodyTimeout, ctx's when its client left while it waited
// for room, or the read's.
func (b *BodyBudget) Read(ctx context.Context, body io.Reader, small bool, deadline time.Time) (data []byte, err error) {
	var chunks [][]byte
	n := 0
	defer func() {
		if err != nil {
			b.give(chunks, charged(chunks))
		}
	}()
	for {
		// A chunk is taken once a byte for it has arrived: a sender that
		// sends nothing holds nothing, and a body that ends at a chunk's
		// end needs no room beyond it.
		var next [1]byte
		if _, err := io.ReadFull(body, next[:]); err == io.EOF {
			return b.whole(chunks, n), nil
		} else if err != nil {
			return nil, readError(err)
		}
		chunk, err := b.take(ctx, small, len(chunks) == 0, b.chunkSize(len(chunks), n), deadline)
		if err != nil {
			return nil, err
		}
		chunks = append(chunks, chunk)
		chunk[0] = next[0]
		got, err := io.ReadFull(body, chunk[1:])
		n += 1 + got
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			return b.whole(chunks, n), nil
		}
		if err != nil {
			return nil, readError(err)
		}
	}
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

// whole copies the n bytes read into chunks into one slice of their size,
// and gives the chunks back but for n bytes of their charge.
func (b *BodyBudget) whole(chunks [][]byte, n int) []byte {
	var data []byte
	if n > 0 {
		data = make([]byte, 0, n)
		for _, c := range chunks {
			data = append(data, c[:min(len(c), n-len(data))]...)
		}
	}
	b.give(chunks, charged(chunks)-int64(n))
	return data
}

// charged is what chunks were charged: their sizes.
func charged(chunks [][]byte) int64 {
	var n int64
	for _, c := range chunks {
		n += int64(len(c))
	}
	return n
}

// Release gives back the n bytes of a body Read returned, once its
// request has ended.
func (b *BodyBudget) Release(n int) {
	if n > 0 {
		b.give(nil, int64(n))
	}
}

// chunkSize is the size of the next chunk of a body that has had, chunks
// chunks for its n bytes: no more than a body of max_body needs, so that
// one always fits in a budget of max_body.
func (b *BodyBudget) chunkSize(chunks, n int) int64 {
	if chunks == 0 {
		return min(FirstChunk, b.maxBody)
	}
	return max(1, min(BodyChunk, b.maxBody-int64(n)))
}

// take gets a chunk of size bytes for a body, waiting for room until its
// deadline, and up to RoomWait for its first.
func (b *BodyBudget) take(ctx context.Context, small, first bool, size int64, deadline time.Time) ([]byte, error) {
	b.mu.Lock()
	if b.fits(small, size) {
		chunk := b.charge(size)
		b.mu.Unlock()
		return chunk, nil
	}
	ready := make(chan []byte, 1)
	queue := &b.waiters[smallIndex(small)]
	*queue = append(*queue, waiter{size, ready})
	b.mu.Unlock()

	var gaveUp <-chan time.Time // nil: waits until the deadline
	if first {
		gaveUp = b.after(RoomWait)
	}
	select {
	case chunk := <-ready:
		return chunk, nil
	case <-gaveUp:
		return nil, b.leave(queue, ready, ErrNoRoom)
	case <-b.after(time.Until(deadline)):
		return nil, b.leave(queue, ready, ErrBodyTimeout)
	case <-ctx.Done():
		return nil, b.leave(queue, ready, ctx.Err())
	}
}

// leave takes a waiter that gave up out of its queue. A chunk handed to it
// meanwhile is given back.
func (b *BodyBudget) leave(queue *[]waiter, ready chan []byte, err error) error {
	b.mu.Lock()
	for i, w := range *queue {
		if w.ready == ready {
			*queue = append((*queue)[:i], (*queue)[i+1:]...)
			b.mu.Unlock()
			return err
		}
	}
	b.mu.Unlock()
	chunk := <-ready
	b.give([][]byte{chunk}, int64(len(chunk)))
	return err
}

func smallIndex(small bool) int {
	if small {
		return 1
	}
	return 0
}

// fits reports whether a chunk of size bytes for a body fits. Called
// with b.mu held.
func (b *BodyBudget) fits(small bool, size int64) bool {
	limit := b.total - b.reserve
	if small {
		limit = b.total
	}
	return b.held+size <= limit
}

// charge takes size bytes from the budget and returns a chunk of that
// size. Called with b.mu held.
func (b *BodyBudget) charge(size int64) []byte {
	b.held += size
	b.report(size)
	switch {
	case size == FirstChunk:
		return firstChunks.Get().(*[FirstChunk]byte)[:]
	case size < BodyChunk: // a body's last, cut to max_body
		return make([]byte, size)
	}
	if last := len(b.free) - 1; last >= 0 {
		chunk := b.free[last]
		b.free = b.free[:last]
		return chunk
	}
	return make([]byte, BodyChunk)
}

// give returns n bytes to the budget and chunks to its bodies: to those
// waiting for room, small bodies first, while any still wait; with none
// waiting, large chunks are left to the collector.
func (b *BodyBudget) give(chunks [][]byte, n int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.held -= n
	b.report(-n)
	for _, c := range chunks {
		switch len(c) {
		case FirstChunk:
			firstChunks.Put((*[FirstChunk]byte)(c))
		case BodyChunk:
			b.free = append(b.free, c)
		}
	}
	for _, small := range [...]bool{true, false} {
		queue := &b.waiters[smallIndex(small)]
		for len(*queue) > 0 && b.fits(small, (*queue)[0].size) {
			w := (*queue)[0]
			*queue = (*queue)[1:]
			w.ready <- b.charge(w.size)
		}
	}
	if len(b.waiters[0])+len(b.waiters[1]) == 0 {
		clear(b.free)
		b.free = b.free[:0]
	}
}

func (b *BodyBudget) report(delta int64) {
	if b.gauge != nil {
		b.gauge.Add(float64(delta))
	}
}
