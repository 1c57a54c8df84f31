package request

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"
)

// manualClock is a budget's clock whose waits the test ends by hand: room
// ends a wait of RoomWait, deadline one for a body's deadline.
type manualClock struct{ room, deadline chan time.Time }

func (c manualClock) after(d time.Duration) <-chan time.Time {
	if d == RoomWait {
		return c.room
	}
	return c.deadline
}

func testBudget(total, maxBody int64) (*BodyBudget, manualClock) {
	b := NewBodyBudget(total, maxBody, nil)
	clock := manualClock{make(chan time.Time), make(chan time.Time)}
	b.after = clock.after
	return b, clock
}

// read is one body being read in the background.
type read struct {
	send *io.PipeWriter
	data []byte
	err  error
	done chan struct{}
}

func startRead(ctx context.Context, b *BodyBudget, small bool) *read {
	pr, pw := io.Pipe()
	r := &read{send: pw, done: make(chan struct{})}
	go func() {
		defer close(r.done)
		r.data, r.err = b.Read(ctx, pr, small, time.Now().Add(time.Hour))
		pr.CloseWithError(io.ErrClosedPipe) // a sender blocked on a refused body returns
	}()
	return r
}

func (r *read) wait(t *testing.T) {
	t.Helper()
	select {
	case <-r.done:
	case <-time.After(10 * time.Second):
		t.Fatal("the body's read did not end")
	}
}

// eventually waits for cond, which the reads in the background make true.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal(what)
		}
	}
}

// F and B are the sizes of a body's first and later chunks.
const F, B = FirstChunk, BodyChunk

func TestBodyMemoryFollowsTheBytesThatArrived(t *testing.T) {
	b, _ := testBudget(64<<20, 64<<20)
	r := startRead(context.Background(), b, false)
	sent := bytes.Repeat([]byte("x"), F+B+100)
	r.send.Write(sent[:F])
	eventually(t, "a body of one small chunk's bytes holds other than one small chunk", func() bool { return b.Held() == F })
	r.send.Write(sent[F:])
	eventually(t, "a body of F+B+100 bytes holds other than F+2B", func() bool { return b.Held() == F+2*B })
	r.send.Close()
	r.wait(t)
	if r.err != nil || !bytes.Equal(r.data, sent) {
		t.Fatalf("read %d bytes, err %v; want the %d sent", len(r.data), r.err, len(sent))
	}
	if got := b.Held(); got != int64(len(sent)) {
		t.Errorf("a body read whole holds %d bytes, want its %d", got, len(sent))
	}
	b.Release(len(r.data))
	if got := b.Held(); got != 0 {
		t.Errorf("released, the budget holds %d bytes", got)
	}
}

func TestABodyThatFindsNoRoomToStartIsRefused(t *testing.T) {
	const total = F + 3*B
	b, clock := testBudget(total, total) // no reserve: a max_body body must fit
	big := startRead(context.Background(), b, false)
	big.send.Write(make([]byte, total))
	eventually(t, "the first body did not fill the budget", func() bool { return b.Held() == total })

	late := startRead(context.Background(), b, false)
	late.send.Write([]byte("{"))
	clock.room <- time.Now() // RoomWait passes
	late.wait(t)
	if !errors.Is(late.err, ErrNoRoom) {
		t.Errorf("a body with no room to start: %v, want ErrNoRoom", late.err)
	}
	big.send.Close() // a body that ends at its last chunk's end needs no room past it
	big.wait(t)
	if big.err != nil || len(big.data) != total {
		t.Errorf("the body that had room: %d bytes, %v", len(big.data), big.err)
	}
	b.Release(len(big.data))
	if got := b.Held(); got != 0 {
		t.Errorf("after both, the budget holds %d bytes", got)
	}
}

func TestABodyOfMaxBodyFitsABudgetOfMaxBody(t *testing.T) {
	for _, maxBody := range []int64{100, 100_000, F + 3*B} {
		b, _ := testBudget(maxBody, maxBody)
		data, err := b.Read(context.Background(), bytes.NewReader(make([]byte, maxBody)), false, time.Now().Add(time.Hour))
		if err != nil || int64(len(data)) != maxBody {
			t.Errorf("a body of max_body %d in a budget of as much: %d bytes, %v", maxBody, len(data), err)
		}
		b.Release(len(data))
	}
}

func TestABodyUnderWayWaitsForRoomUntilAnotherGivesItBack(t *testing.T) {
	const total = 2*F + B + B/2
	b, _ := testBudget(total, total)
	first := startRead(context.Background(), b, false)
	first.send.Write(make([]byte, F+B))
	second := startRead(context.Background(), b, false)
	second.send.Write(make([]byte, F))
	eventually(t, "the two bodies do not hold 2F+B", func() bool { return b.Held() == 2*F+B })
	second.send.Write([]byte("y")) // its second chunk must wait for room

	first.send.Close()
	first.wait(t)
	b.Release(len(first.data)) // the second body gets the room back and goes on
	second.send.Close()
	second.wait(t)
	if second.err != nil || len(second.data) != F+1 {
		t.Errorf("the body that waited: %d bytes, %v", len(second.data), second.err)
	}
}

func TestSmallBodiesPassWhileLargeOnesWait(t *testing.T) {
	const total, maxBody = 16 * B, 15*B + F // a reserve of B-F
	b, clock := testBudget(total, maxBody)
	ctx, clientGone := context.WithCancel(context.Background())
	large := startRead(ctx, b, false)
	large.send.Write(make([]byte, F+15*B)) // all but the reserve
	eventually(t, "the large body did not fill its share", func() bool { return b.Held() == F+15*B })
	large.send.Write([]byte("y")) // and waits for more

	other := startRead(context.Background(), b, false)
	other.send.Write([]byte("{"))
	small := startRead(context.Background(), b, true)
	small.send.Write([]byte(`{"prompt": "a fox"}`))
	small.send.Close()
	small.wait(t)
	if small.err != nil || string(small.data) != `{"prompt": "a fox"}` {
		t.Fatalf("a small body beside a full budget: %q, %v", small.data, small.err)
	}
	b.Release(len(small.data))
	clock.room <- time.Now()
	other.wait(t)
	if !errors.Is(other.err, ErrNoRoom) {
		t.Errorf("a second large body took the reserve: %v", other.err)
	}
	clientGone() // while it waits for room to go on
	large.wait(t)
	if !errors.Is(large.err, context.Canceled) {
		t.Errorf("a body whose client left: %v", large.err)
	}
	if got := b.Held(); got != 0 {
		t.Errorf("after a failed read, the budget holds %d bytes", got)
	}
}

func TestABodyWaitingForRoomPastItsTimeoutIsATimeout(t *testing.T) {
	const total = F + 3*B
	b, clock := testBudget(total, total)
	hog := startRead(context.Background(), b, false)
	hog.send.Write(make([]byte, total))
	eventually(t, "the budget did not fill", func() bool { return b.Held() == total })
	waiting := startRead(context.Background(), b, false)
	waiting.send.Write([]byte("{")) // its first byte is in: it waits for room
	clock.deadline <- time.Now()
	waiting.wait(t)
	if !errors.Is(waiting.err, ErrBodyTimeout) {
		t.Errorf("a body whose time ran out waiting for room: %v", waiting.err)
	}
	hog.send.CloseWithError(errors.New("client gone"))
	hog.wait(t)
	if got := b.Held(); got != 0 {
		t.Errorf("after both ended, the budget holds %d bytes", got)
	}
}

func TestABodyBlockedReadingPastItsTimeoutIsATimeout(t *testing.T) {
	b, _ := testBudget(64<<20, 64<<20)
	r := startRead(context.Background(), b, false)
	r.send.Write(make([]byte, F+1))
	eventually(t, "the body did not start", func() bool { return b.Held() == F+B })
	r.send.CloseWithError(fmt.Errorf("read tcp: %w", os.ErrDeadlineExceeded)) // what the connection's read deadline does
	r.wait(t)
	if !errors.Is(r.err, ErrBodyTimeout) {
		t.Errorf("a read ended by the deadline: %v, want ErrBodyTimeout", r.err)
	}
	if got := b.Held(); got != 0 {
		t.Errorf("the budget holds %d bytes of a body that timed out", got)
	}
}

func TestABodyOverMaxBodyIsRefusedAndFreed(t *testing.T) {
	b, _ := testBudget(64<<20, 64<<20)
	body := http.MaxBytesReader(nil, io.NopCloser(strings.NewReader(strings.Repeat("x", 3*B))), 2*B)
	_, err := b.Read(context.Background(), body, false, time.Now().Add(time.Hour))
	if !OverMaxBody(err) {
		t.Errorf("a body over its bound: %v, want the MaxBytesError", err)
	}
	if got := b.Held(); got != 0 {
		t.Errorf("the budget holds %d bytes of a refused body", got)
	}
}

func TestAnEmptyBodyHoldsNothing(t *testing.T) {
	b, _ := testBudget(64<<20, 64<<20)
	data, err := b.Read(context.Background(), http.NoBody, true, time.Now().Add(time.Hour))
	if err != nil || len(data) != 0 {
		t.Fatalf("an empty body: %q, %v", data, err)
	}
	if got := b.Held(); got != 0 {
		t.Errorf("an empty body holds %d bytes", got)
	}
	b.Release(len(data))
}

// gauge records what a budget reports.
type gauge struct{ v float64 }

func (g *gauge) Add(d float64) { g.v += d }

func TestTheGaugeFollowsTheBytesHeld(t *testing.T) {
	g := &gauge{}
	b := NewBodyBudget(64<<20, 64<<20, g)
	data, err := b.Read(context.Background(), strings.NewReader(strings.Repeat("x", 1000)), true, time.Now().Add(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if g.v != 1000 {
		t.Errorf("the gauge reads %v while a body of 1000 bytes is held", g.v)
	}
	b.Release(len(data))
	if g.v != 0 {
		t.Errorf("the gauge reads %v once it was released", g.v)
	}
}
