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
	"testing/iotest"
	"time"
)

// F and B are the sizes of a body's first and later chunks.
const F, B = FirstChunk, BodyChunk

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

// read is one body being read in the background, of a declared length
// (-1: none).
type read struct {
	send *io.PipeWriter
	data []byte
	err  error
	done chan struct{}
}

func startRead(ctx context.Context, b *BodyBudget, length int64) *read {
	pr, pw := io.Pipe()
	r := &read{send: pw, done: make(chan struct{})}
	go func() {
		defer close(r.done)
		r.data, r.err = b.Read(ctx, pr, length, time.Now().Add(time.Hour))
		pr.CloseWithError(io.ErrClosedPipe) // a sender blocked on a refused body returns
	}()
	return r
}

// sent sends n bytes and ends the body.
func (r *read) sent(t *testing.T, n int64) {
	t.Helper()
	r.send.Write(make([]byte, n))
	r.send.Close()
	r.wait(t)
}

// refusedForRoom ends r's wait for room at RoomWait and checks that it
// was refused for it.
func (r *read) refusedForRoom(t *testing.T, clock manualClock, what string) {
	t.Helper()
	clock.room <- time.Now()
	r.wait(t)
	if !errors.Is(r.err, ErrNoRoom) {
		t.Errorf("%s: %v, want ErrNoRoom", what, r.err)
	}
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

func expectHeld(t *testing.T, b *BodyBudget, want int64, when string) {
	t.Helper()
	eventually(t, fmt.Sprintf("%s, the budget holds %d bytes, want %d", when, b.Held(), want), func() bool { return b.Held() == want })
}

func TestABodyWithoutALengthHoldsWhatHasArrived(t *testing.T) {
	b, _ := testBudget(64<<20, 64<<20)
	r := startRead(context.Background(), b, -1)
	sent := bytes.Repeat([]byte("x"), F+B+100)
	r.send.Write(sent[:F])
	expectHeld(t, b, F, "a body of one small chunk's bytes")
	r.send.Write(sent[F:])
	expectHeld(t, b, F+2*B, "a body of F+B+100 bytes")
	r.send.Close()
	r.wait(t)
	if r.err != nil || !bytes.Equal(r.data, sent) {
		t.Fatalf("read %d bytes, err %v; want the %d sent", len(r.data), r.err, len(sent))
	}
	expectHeld(t, b, int64(len(sent)), "read whole")
	b.Release(len(r.data))
	expectHeld(t, b, 0, "released")
}

func TestABodyWithALengthTakesRoomForAllOfItOnceItStarts(t *testing.T) {
	b, _ := testBudget(64<<20, 64<<20)
	r := startRead(context.Background(), b, 10*B)
	expectHeld(t, b, 0, "before its first byte")
	r.send.Write([]byte("{"))
	expectHeld(t, b, 10*B, "once it started")
	r.sent(t, 10*B-1)
	if r.err != nil || len(r.data) != 10*B {
		t.Fatalf("read %d bytes, %v", len(r.data), r.err)
	}
	b.Release(len(r.data))
	expectHeld(t, b, 0, "released")
}

func TestABodyThatFindsNoRoomIsRefused(t *testing.T) {
	const total = F + 3*B
	b, clock := testBudget(total, total) // no reserve: a max_body body must fit
	big := startRead(context.Background(), b, total)
	big.send.Write([]byte("{"))
	expectHeld(t, b, total, "the first body started")

	late := startRead(context.Background(), b, 100)
	late.send.Write([]byte("{"))
	late.refusedForRoom(t, clock, "a body with no room")
	big.sent(t, total-1)
	if big.err != nil || len(big.data) != total {
		t.Errorf("the body that had room: %d bytes, %v", len(big.data), big.err)
	}
	b.Release(len(big.data))
	expectHeld(t, b, 0, "after both")
}

// Uploads under way together never wait for each other: each was let in
// with room for all of it.
func TestUploadsThatOverfillTheBudgetTogetherAllFinish(t *testing.T) {
	b, _ := testBudget(10*B, 4*B)
	var uploads []*read
	for i := range 3 {
		u := startRead(context.Background(), b, 4*B)
		u.send.Write([]byte("{"))
		uploads = append(uploads, u)
		expectHeld(t, b, int64(min(i+1, 2))*4*B, "the uploads let in") // the third waits
	}
	for _, u := range uploads {
		u.sent(t, 4*B-1)
		if u.err != nil || len(u.data) != 4*B {
			t.Fatalf("an upload: %d bytes, %v", len(u.data), u.err)
		}
		b.Release(len(u.data)) // its request ends: the next gets its room
	}
	expectHeld(t, b, 0, "after the three")
}

func TestSmallBodiesPassWhileLargeOnesWait(t *testing.T) {
	const total, maxBody = 16 * B, 15*B + F // a reserve of B-F
	b, clock := testBudget(total, maxBody)
	large := startRead(context.Background(), b, maxBody)
	large.send.Write([]byte("{"))
	expectHeld(t, b, maxBody, "the large body started")

	other := startRead(context.Background(), b, B)
	other.send.Write([]byte("{"))
	small := startRead(context.Background(), b, 19)
	small.send.Write([]byte(`{"prompt": "a fox"}`))
	small.send.Close()
	small.wait(t)
	if small.err != nil || string(small.data) != `{"prompt": "a fox"}` {
		t.Fatalf("a small body beside a full budget: %q, %v", small.data, small.err)
	}
	b.Release(len(small.data))
	other.refusedForRoom(t, clock, "a second large body took the reserve")
	large.sent(t, maxBody-1)
	b.Release(len(large.data))
	expectHeld(t, b, 0, "after all")
}

func TestAWaiterThatFitsIsNotKeptBehindOneThatDoesNot(t *testing.T) {
	b, clock := testBudget(2*B, 2*B)
	first, second := startRead(context.Background(), b, B), startRead(context.Background(), b, B)
	first.send.Write([]byte("{"))
	second.send.Write([]byte("{"))
	expectHeld(t, b, 2*B, "two bodies started")
	whole := startRead(context.Background(), b, 2*B)
	whole.send.Write([]byte("{")) // waits for all the budget
	half := startRead(context.Background(), b, B)
	half.send.Write([]byte("{")) // waits for half of it

	first.sent(t, B-1)
	b.Release(len(first.data)) // room for half, not for whole
	half.sent(t, B-1)
	if half.err != nil || len(half.data) != B {
		t.Fatalf("the body that fits the room given back: %d bytes, %v", len(half.data), half.err)
	}
	whole.refusedForRoom(t, clock, "the body that never fitted")
	second.sent(t, B-1)
	b.Release(len(second.data))
	b.Release(len(half.data))
	expectHeld(t, b, 0, "after all")
}

func TestABodyWithoutALengthWaitsForRoomOnlyUpToRoomWait(t *testing.T) {
	const total = F + B
	b, clock := testBudget(total, total)
	other := startRead(context.Background(), b, B/2)
	other.send.Write([]byte("{"))
	expectHeld(t, b, B/2, "the first started") // else the stream's second chunk may queue first, and the first waits behind it
	stream := startRead(context.Background(), b, -1)
	stream.send.Write(make([]byte, F+1)) // its second chunk finds no room
	expectHeld(t, b, F+B/2, "the two started")
	stream.refusedForRoom(t, clock, "a body under way that found no room")
	other.sent(t, B/2-1)
	b.Release(len(other.data))
	expectHeld(t, b, 0, "after both")
}

func TestABodyWaitingForRoomPastItsTimeoutIsATimeout(t *testing.T) {
	const total = F + 3*B
	b, clock := testBudget(total, total)
	hog := startRead(context.Background(), b, total)
	hog.send.Write([]byte("{"))
	expectHeld(t, b, total, "the budget filled")
	waiting := startRead(context.Background(), b, 100)
	waiting.send.Write([]byte("{"))
	clock.deadline <- time.Now()
	waiting.wait(t)
	if !errors.Is(waiting.err, ErrBodyTimeout) {
		t.Errorf("a body whose time ran out waiting for room: %v", waiting.err)
	}
	hog.send.CloseWithError(errors.New("client gone"))
	hog.wait(t)
	expectHeld(t, b, 0, "after both ended")
}

func TestABodyWaitingForRoomWhoseClientLeftEnds(t *testing.T) {
	b, _ := testBudget(B, B)
	hog := startRead(context.Background(), b, B)
	hog.send.Write([]byte("{"))
	expectHeld(t, b, B, "the budget filled")
	ctx, leave := context.WithCancel(context.Background())
	waiting := startRead(ctx, b, 100)
	waiting.send.Write([]byte("{"))
	leave()
	waiting.wait(t)
	if !errors.Is(waiting.err, context.Canceled) {
		t.Errorf("a body whose client left: %v", waiting.err)
	}
	hog.send.CloseWithError(errors.New("client gone"))
	hog.wait(t)
	expectHeld(t, b, 0, "after both ended")
}

func TestABodyBlockedReadingPastItsTimeoutIsATimeout(t *testing.T) {
	b, _ := testBudget(64<<20, 64<<20)
	r := startRead(context.Background(), b, 10*B)
	r.send.Write(make([]byte, F+1))
	r.send.CloseWithError(fmt.Errorf("read tcp: %w", os.ErrDeadlineExceeded)) // what the connection's read deadline does
	r.wait(t)
	if !errors.Is(r.err, ErrBodyTimeout) {
		t.Errorf("a read ended by the deadline: %v, want ErrBodyTimeout", r.err)
	}
	expectHeld(t, b, 0, "after a body that timed out")
}

func TestABodyCutShortIsNoBody(t *testing.T) {
	b, _ := testBudget(64<<20, 64<<20)
	for _, n := range []int{10, F + 10, F + B + 10} {
		cut := io.MultiReader(bytes.NewReader(make([]byte, n)), iotest.ErrReader(io.ErrUnexpectedEOF)) // as net/http's body reads
		if _, err := b.Read(context.Background(), cut, int64(n)+100, time.Now().Add(time.Hour)); !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Errorf("a body cut short after %d bytes: %v, want io.ErrUnexpectedEOF", n, err)
		}
	}
	expectHeld(t, b, 0, "after bodies cut short")
}

func TestABodyLongerThanItsLengthIsRefused(t *testing.T) {
	b, _ := testBudget(64<<20, 64<<20)
	if _, err := b.Read(context.Background(), bytes.NewReader(make([]byte, F+1)), F, time.Now().Add(time.Hour)); !errors.Is(err, errLonger) {
		t.Errorf("a body longer than it said: %v", err)
	}
	expectHeld(t, b, 0, "after it")
}

func TestABodyOfMaxBodyFitsABudgetOfMaxBody(t *testing.T) {
	for _, maxBody := range []int64{100, 100_000, F + 3*B} {
		for _, length := range []int64{-1, maxBody} {
			b, _ := testBudget(maxBody, maxBody)
			data, err := b.Read(context.Background(), bytes.NewReader(make([]byte, maxBody)), length, time.Now().Add(time.Hour))
			if err != nil || int64(len(data)) != maxBody {
				t.Errorf("a body of max_body %d (declared %d) in a budget of as much: %d bytes, %v", maxBody, length, len(data), err)
			}
			b.Release(len(data))
		}
	}
}

func TestABodyOverMaxBodyIsRefusedAndFreed(t *testing.T) {
	b, _ := testBudget(64<<20, 64<<20)
	body := http.MaxBytesReader(nil, io.NopCloser(strings.NewReader(strings.Repeat("x", 3*B))), 2*B)
	_, err := b.Read(context.Background(), body, -1, time.Now().Add(time.Hour))
	if !OverMaxBody(err) {
		t.Errorf("a body over its bound: %v, want the MaxBytesError", err)
	}
	expectHeld(t, b, 0, "after a refused body")
}

func TestAnEmptyBodyHoldsNothing(t *testing.T) {
	b, _ := testBudget(64<<20, 64<<20)
	data, err := b.Read(context.Background(), http.NoBody, 0, time.Now().Add(time.Hour))
	if err != nil || len(data) != 0 {
		t.Fatalf("an empty body: %q, %v", data, err)
	}
	expectHeld(t, b, 0, "after an empty body")
}

// gauge records what a budget reports.
type gauge struct{ v float64 }

func (g *gauge) Add(d float64) { g.v += d }

func TestTheGaugeFollowsTheBytesHeld(t *testing.T) {
	g := &gauge{}
	b := NewBodyBudget(64<<20, 64<<20, g)
	data, err := b.Read(context.Background(), strings.NewReader(strings.Repeat("x", 1000)), 1000, time.Now().Add(time.Hour))
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
