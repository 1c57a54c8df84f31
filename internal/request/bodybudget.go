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
	// BodyChunk is the unit bodies are read and accounted in.
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
	// ErrBodyTimeout ends a body whose read context ended with it as its
	// cause: the body took longer than body_timeout to arrive.
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
	gauge          Gauge
	after          func(time.Duration) <-chan time.Time // the clock of RoomWait

	mu      sync.Mutex
	held    int64
	waiters [2][]chan []byte // by smallness: [0] large, [1] small; each gets a chunk
	free    [][]byte         // chunks given back while bodies waited
}

// NewBodyBudget holds at most total bytes of bodies; maxBody, the largest
// body, always fits. gauge, when not nil, follows the bytes held.
func NewBodyBudget(total, maxBody int64, gauge Gauge) *BodyBudget {
	return &BodyBudget{
		total:   total,
		reserve: max(0, min(total/8, total-maxBody)),
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
// declared length lets it use the reserve. It returns the body, its bytes
// still taken from the budget until release is called. The error is
// ErrNoRoom, ErrBodyTimeout when ctx ended with that cause, or the read's.
func (b *BodyBudget) Read(ctx context.Context, body io.Reader, small bool) (data []byte, release func(), err error) {
	var chunks [][]byte
	n := 0
	defer func() {
		if err != nil {
			b.give(chunks, int64(len(chunks))*BodyChunk)
		}
	}()
	for {
		// A chunk is taken once a byte for it has arrived: a sender that
		// sends nothing holds nothing, and a body that ends at a chunk's
		// end needs no room beyond it.
		var next [1]byte
		if _, err := io.ReadFull(body, next[:]); err == io.EOF {
			return b.whole(chunks, n), b.releaser(int64(n)), nil
		} else if err != nil {
			return nil, nil, readError(ctx, err)
		}
		chunk, err := b.take(ctx, small, len(chunks) == 0)
		if err != nil {
			return nil, nil, err
		}
		chunks = append(chunks, chunk)
		chunk[0] = next[0]
		got, err := io.ReadFull(body, chunk[1:])
		n += 1 + got
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			return b.whole(chunks, n), b.releaser(int64(n)), nil
		}
		if err != nil {
			return nil, nil, readError(ctx, err)
		}
	}
}

// readError is what a failed read of a body means: ErrBodyTimeout when
// it took too long, else the read's own error.
func readError(ctx context.Context, err error) error {
	if timedOut(ctx, err) {
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
	b.give(chunks, int64(len(chunks))*BodyChunk-int64(n))
	return data
}

// releaser gives n bytes back once.
func (b *BodyBudget) releaser(n int64) func() {
	var once sync.Once
	return func() { once.Do(func() { b.give(nil, n) }) }
}

// take gets a chunk for a body, waiting for room up to RoomWait for its
// first.
func (b *BodyBudget) take(ctx context.Context, small, first bool) ([]byte, error) {
	b.mu.Lock()
	if b.fits(small) {
		chunk := b.charge()
		b.mu.Unlock()
		return chunk, nil
	}
	ready := make(chan []byte, 1)
	queue := &b.waiters[smallIndex(small)]
	*queue = append(*queue, ready)
	b.mu.Unlock()

	var gaveUp <-chan time.Time // nil: waits until ctx ends
	if first {
		gaveUp = b.after(RoomWait)
	}
	select {
	case chunk := <-ready:
		return chunk, nil
	case <-gaveUp:
		return nil, b.leave(queue, ready, ErrNoRoom)
	case <-ctx.Done():
		err := ctx.Err()
		if timedOut(ctx, err) {
			err = ErrBodyTimeout
		}
		return nil, b.leave(queue, ready, err)
	}
}

// timedOut reports whether err, which ended a body's read, means that it
// took longer than body_timeout: ctx, its read context, ended with that
// cause, or the read blocked on the connection ended by its read
// deadline, which is set to ctx's deadline and may fire before ctx's own
// timer does.
func timedOut(ctx context.Context, err error) bool {
	return context.Cause(ctx) == ErrBodyTimeout || errors.Is(err, os.ErrDeadlineExceeded)
}

// leave takes a waiter that gave up out of its queue. A chunk handed to it
// meanwhile is given back.
func (b *BodyBudget) leave(queue *[]chan []byte, ready chan []byte, err error) error {
	b.mu.Lock()
	for i, w := range *queue {
		if w == ready {
			*queue = append((*queue)[:i], (*queue)[i+1:]...)
			b.mu.Unlock()
			return err
		}
	}
	b.mu.Unlock()
	b.give([][]byte{<-ready}, BodyChunk)
	return err
}

func smallIndex(small bool) int {
	if small {
		return 1
	}
	return 0
}

// fits reports whether a chunk for a body fits. Called with b.mu held.
func (b *BodyBudget) fits(small bool) bool {
	limit := b.total - b.reserve
	if small {
		limit = b.total
	}
	return b.held+BodyChunk <= limit
}

// charge takes a chunk's bytes from the budget and returns the chunk.
// Called with b.mu held.
func (b *BodyBudget) charge() []byte {
	b.held += BodyChunk
	b.report(BodyChunk)
	if last := len(b.free) - 1; last >= 0 {
		chunk := b.free[last]
		b.free = b.free[:last]
		return chunk
	}
	return make([]byte, BodyChunk)
}

// give returns n bytes to the budget and chunks to its bodies: to those
// waiting for room, small bodies first, then to the free list while any
// still wait; with none waiting, chunks are left to the collector.
func (b *BodyBudget) give(chunks [][]byte, n int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.held -= n
	b.report(-n)
	b.free = append(b.free, chunks...)
	for _, small := range []bool{true, false} {
		queue := &b.waiters[smallIndex(small)]
		for len(*queue) > 0 && b.fits(small) {
			ready := (*queue)[0]
			*queue = (*queue)[1:]
			ready <- b.charge()
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
