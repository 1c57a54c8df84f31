package request

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// manualWait is a budget's RoomWait clock that the test ends by hand.
type manualWait chan time.Time

func (m manualWait) after(time.Duration) <-chan time.Time { return m }

func testBudget(total, maxBody int64) (*BodyBudget, manualWait) {
	b := NewBodyBudget(total, maxBody, nil)
	wait := make(manualWait)
	b.after = wait.after
	return b, wait
}

// read is one body being read in the background.
type read struct {
	send    *io.PipeWriter
	data    []byte
	release func()
	err     error
	done    chan struct{}
}

func startRead(ctx context.Context, b *BodyBudget, small bool) *read {
	pr, pw := io.Pipe()
	r := &read{send: pw, done: make(chan struct{})}
	go func() {
		defer close(r.done)
		r.data, r.release, r.err = b.Read(ctx, pr, small)
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

func TestBodyMemoryFollowsTheBytesThatArrived(t *testing.T) {
	b, _ := testBudget(64<<20, 64<<20)
	r := startRead(context.Background(), b, false)
	sent := bytes.Repeat([]byte("x"), BodyChunk+100)
	if _, err := r.send.Write(sent[:BodyChunk]); err != nil {
		t.Fatal(err)
	}
	eventually(t, "a body of one chunk holds other than one chunk", func() bool { return b.Held() == BodyChunk })
	if _, err := r.send.Write(sent[BodyChunk:]); err != nil {
		t.Fatal(err)
	}
	eventually(t, "a body of one chunk and 100 bytes holds other than two chunks", func() bool { return b.Held() == 2*BodyChunk })
	r.send.Close()
	r.wait(t)
	if r.err != nil || !bytes.Equal(r.data, sent) {
		t.Fatalf("read %d bytes, err %v; want the %d sent", len(r.data), r.err, len(sent))
	}
	if got := b.Held(); got != int64(len(sent)) {
		t.Errorf("a body read whole holds %d bytes, want its %d", got, len(sent))
	}
	r.release()
	r.release() // a second release gives nothing back twice
	if got := b.Held(); got != 0 {
		t.Errorf("released, the budget holds %d bytes", got)
	}
}

func TestABodyThatFindsNoRoomToStartIsRefused(t *testing.T) {
	b, wait := testBudget(4*BodyChunk, 4*BodyChunk) // no reserve: a max_body body must fit
	big := startRead(context.Background(), b, false)
	big.send.Write(make([]byte, 3*BodyChunk+1)) // four chunks: the budget is full
	eventually(t, "the first body did not fill the budget", func() bool { return b.Held() == 4*BodyChunk })

	late := startRead(context.Background(), b, false)
	late.send.Write([]byte("{"))
	wait <- time.Now() // RoomWait passes
	late.wait(t)
	if !errors.Is(late.err, ErrNoRoom) {
		t.Errorf("a body with no room to start: %v, want ErrNoRoom", late.err)
	}
	big.send.Close()
	big.wait(t)
	if big.err != nil || len(big.data) != 3*BodyChunk+1 {
		t.Errorf("the body that had room: %d bytes, %v", len(big.data), big.err)
	}
	big.release()
	if got := b.Held(); got != 0 {
		t.Errorf("after both, the budget holds %d bytes", got)
	}
}

func TestABodyUnderWayWaitsForRoomUntilAnotherGivesItBack(t *testing.T) {
	b, _ := testBudget(4*BodyChunk, 4*BodyChunk)
	first := startRead(context.Background(), b, false)
	first.send.Write(make([]byte, 3*BodyChunk))
	eventually(t, "the first body does not hold three chunks", func() bool { return b.Held() == 3*BodyChunk })
	second := startRead(context.Background(), b, false)
	second.send.Write(make([]byte, BodyChunk)) // the budget's last chunk
	eventually(t, "the second body did not start", func() bool { return b.Held() == 4*BodyChunk })
	second.send.Write([]byte("y")) // its second chunk must wait for room

	first.send.Close()
	first.wait(t)
	first.release() // the second body gets the room back and goes on
	second.send.Close()
	second.wait(t)
	if second.err != nil || len(second.data) != BodyChunk+1 {
		t.Errorf("the body that waited: %d bytes, %v", len(second.data), second.err)
	}
}

func TestSmallBodiesPassWhileLargeOnesWait(t *testing.T) {
	b, wait := testBudget(16*BodyChunk, 8*BodyChunk) // a reserve of two chunks
	ctx, clientGone := context.WithCancel(context.Background())
	large := startRead(ctx, b, false)
	large.send.Write(make([]byte, 14*BodyChunk)) // fills all but the reserve
	eventually(t, "the large body did not fill its share", func() bool { return b.Held() == 14*BodyChunk })
	large.send.Write([]byte("y")) // and waits for a 15th

	other := startRead(context.Background(), b, false)
	other.send.Write([]byte("{"))
	small := startRead(context.Background(), b, true)
	small.send.Write([]byte(`{"prompt": "a fox"}`))
	small.send.Close()
	small.wait(t)
	if small.err != nil || string(small.data) != `{"prompt": "a fox"}` {
		t.Fatalf("a small body beside a full budget: %q, %v", small.data, small.err)
	}
	small.release()
	wait <- time.Now()
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
	b, _ := testBudget(4*BodyChunk, 4*BodyChunk)
	hog := startRead(context.Background(), b, false)
	hog.send.Write(make([]byte, 3*BodyChunk+1))
	eventually(t, "the budget did not fill", func() bool { return b.Held() == 4*BodyChunk })
	ctx, timeout := context.WithCancelCause(context.Background())
	waiting := startRead(ctx, b, false)
	waiting.send.Write([]byte("{")) // its first byte is in: it waits for room
	timeout(ErrBodyTimeout)
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
	b, _ := testBudget(4*BodyChunk, 4*BodyChunk)
	ctx, timeout := context.WithCancelCause(context.Background())
	r := startRead(ctx, b, false)
	r.send.Write(make([]byte, BodyChunk+1))
	eventually(t, "the body did not start", func() bool { return b.Held() == 2*BodyChunk })
	timeout(ErrBodyTimeout)
	r.send.CloseWithError(errors.New("i/o timeout")) // what the read deadline does
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
	body := http.MaxBytesReader(nil, io.NopCloser(strings.NewReader(strings.Repeat("x", 3*BodyChunk))), 2*BodyChunk)
	_, _, err := b.Read(context.Background(), body, false)
	if !OverMaxBody(err) {
		t.Errorf("a body over its bound: %v, want the MaxBytesError", err)
	}
	if got := b.Held(); got != 0 {
		t.Errorf("the budget holds %d bytes of a refused body", got)
	}
}

func TestAnEmptyBodyHoldsNothing(t *testing.T) {
	b, _ := testBudget(64<<20, 64<<20)
	data, release, err := b.Read(context.Background(), http.NoBody, true)
	if err != nil || len(data) != 0 {
		t.Fatalf("an empty body: %q, %v", data, err)
	}
	if got := b.Held(); got != 0 {
		t.Errorf("an empty body holds %d bytes", got)
	}
	release()
}

// gauge records what a budget reports.
type gauge struct{ v float64 }

func (g *gauge) Add(d float64) { g.v += d }

func TestTheGaugeFollowsTheBytesHeld(t *testing.T) {
	g := &gauge{}
	b := NewBodyBudget(64<<20, 64<<20, g)
	_, release, err := b.Read(context.Background(), strings.NewReader(strings.Repeat("x", 1000)), true)
	if err != nil {
		t.Fatal(err)
	}
	if g.v != 1000 {
		t.Errorf("the gauge reads %v while a body of 1000 bytes is held", g.v)
	}
	release()
	if g.v != 0 {
		t.Errorf("the gauge reads %v once it was released", g.v)
	}
}
