package answer

import (
	"bytes"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/msgpack"
)

// imageAnswer is an answer of /v1/images/generations as sglang-diffusion
// writes it, with an image of about size bytes in base64.
func imageAnswer(size int) []byte {
	return []byte(`{"id":"5a739696","created":1796397810,"data":[{"b64_json":"` + strings.Repeat("iVBO", size/4) +
		`","url":null,"revised_prompt":"a red fox","file_path":"/tmp/out.png"}],"peak_memory_mb":null,"inference_time_s":0.52}`)
}

// rolloutAnswer is a rollout answer in msgpack with a tensor of about size
// bytes in base64.
func rolloutAnswer(t testing.TB, size int) []byte {
	b, err := msgpack.Marshal([]any{msgpack.Map{
		{Key: "request_id", Value: "0b9d"},
		{Key: "generated_output", Value: msgpack.Map{{Key: "__tensor__", Value: true}, {Key: "data", Value: strings.Repeat("QUJD", size/4)}}},
		{Key: "inference_time_s", Value: 0.25},
	}})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestFormatOf(t *testing.T) {
	for ct, want := range map[string]Format{
		"application/json": JSON, "Application/JSON; charset=utf-8": JSON, "application/problem+json": JSON,
		"application/msgpack": Msgpack, "application/x-msgpack": Msgpack, "application/vnd.msgpack": Msgpack,
		"image/png": Opaque, "video/mp4": Opaque, "text/event-stream": Opaque, "": Opaque, "application/jsonl": Opaque,
	} {
		if got := FormatOf(ct); got != want {
			t.Errorf("FormatOf(%q) = %d; want %d", ct, got, want)
		}
	}
}

func TestCheckFindsAnswersCutShort(t *testing.T) {
	for name, tc := range map[string]struct {
		f    Format
		body []byte
	}{
		"json": {JSON, imageAnswer(1 << 10)}, "msgpack": {Msgpack, rolloutAnswer(t, 1<<10)},
	} {
		if err := tc.f.Check(tc.body); err != nil {
			t.Errorf("%s: a whole answer: %v", name, err)
		}
		if err := tc.f.Check(tc.body[:len(tc.body)/2]); err == nil {
			t.Errorf("%s: half an answer passed", name)
		}
		if err := Opaque.Check(tc.body[:len(tc.body)/2]); err != nil {
			t.Errorf("%s: an opaque body was checked: %v", name, err)
		}
	}
}

// TestEndpointsFormatOutranksTheLabel: an answer is checked as what its
// endpoint answers, not as the worker labels it, save a msgpack endpoint's
// answer labelled JSON (sglang's older rollout answer).
func TestEndpointsFormatOutranksTheLabel(t *testing.T) {
	for _, tc := range []struct {
		endpoint    Format
		contentType string
		want        Format
	}{
		{JSON, "text/html", JSON}, {JSON, "application/msgpack", JSON}, {JSON, "", JSON},
		{Msgpack, "text/html", Msgpack}, {Msgpack, "application/json", JSON}, {Msgpack, "application/msgpack", Msgpack},
		{Opaque, "video/mp4", Opaque}, {Opaque, "application/json", JSON},
	} {
		if got := tc.endpoint.Expect(tc.contentType); got != tc.want {
			t.Errorf("a %v endpoint's answer labelled %q is checked as %v; want %v", tc.endpoint, tc.contentType, got, tc.want)
		}
	}
	page := []byte("<!DOCTYPE html><html></html>")
	if err := JSON.Check(page); err == nil || CutShort(err) {
		t.Errorf("a page of HTML checked as JSON: %v; want an error that is not a cut", err)
	}
	if err := JSON.Check(imageAnswer(64)[:40]); !CutShort(err) {
		t.Errorf("half a JSON answer: %v; want a cut", err)
	}
}

func TestBudgetBoundsEachAnswerAndAllTogether(t *testing.T) {
	b := NewBudget(64<<10, 160<<10)
	if _, err := b.Hold(64<<10 + 1); err != ErrTooLarge {
		t.Fatalf("an answer larger than an answer may be: %v", err)
	}
	first, err1 := b.Hold(64 << 10)
	second, err2 := b.Hold(60 << 10) // in 64 KiB
	if err1 != nil || err2 != nil {
		t.Fatalf("two answers of 64 KiB within a budget of 160: %v, %v", err1, err2)
	}
	if _, err := b.Hold(40 << 10); err != ErrNoRoom {
		t.Fatalf("a third answer of 64 KiB, 192 KiB in a budget of 160: %v", err)
	}
	small, err := b.Hold(20 << 10) // in 32 KiB
	if err != nil {
		t.Fatalf("an answer of 20 KiB with 32 KiB left: %v", err)
	}
	first.Release()
	if _, err := b.Hold(64 << 10); err != nil {
		t.Fatalf("room released was not given back: %v", err)
	}
	second.Release()
	small.Release()
	if _, err := NewBudget(0, 1<<20).Hold(-1); err != ErrTooLarge {
		t.Fatalf("a budget holding no answer, an answer of undeclared length: %v", err)
	}
}

func TestHeldOfUndeclaredLengthGrowsWithinTheBudget(t *testing.T) {
	b := NewBudget(100<<10, 150<<10)
	h, err := b.Hold(-1)
	if err != nil {
		t.Fatal(err)
	}
	piece := bytes.Repeat([]byte("x"), 10<<10)
	for i := range 10 {
		if err := h.Add(piece); err != nil {
			t.Fatalf("refused at %d bytes, within 100 KiB: %v", len(h.Body()), err)
		}
		if !bytes.Equal(h.Body(), bytes.Repeat(piece, i+1)) {
			t.Fatalf("after %d pieces the body is %d bytes, not what was added", i+1, len(h.Body()))
		}
	}
	if err := h.Add([]byte("y")); err != ErrTooLarge {
		t.Fatalf("grew past the largest answer held: %v", err)
	}
	if len(h.Body()) != 100<<10 {
		t.Fatalf("a refused piece changed the body: %d bytes", len(h.Body()))
	}
	other, err := b.Hold(-1) // 100 KiB held in 128 KiB
	if err != nil || other.Add(piece[:1]) != nil {
		t.Fatal("another answer found no room")
	}
	if err := other.Add(bytes.Repeat([]byte("x"), 60<<10)); err != ErrNoRoom {
		t.Fatalf("grew past the budget, 128 KiB held and 64 more in a budget of 150: %v", err)
	}
	h.Release()
	other.Release()
	if b.room.Load() != 150<<10 {
		t.Fatalf("room %d after every answer released; want the budget, %d", b.room.Load(), 150<<10)
	}
}

// TestHeldGrowsPastThePooledSizes adds an answer of undeclared length in
// the pieces reverse_proxy copies, past the largest buffer the pools keep.
func TestHeldGrowsPastThePooledSizes(t *testing.T) {
	b := NewBudget(10<<20, 16<<20)
	h, err := b.Hold(-1)
	if err != nil {
		t.Fatal(err)
	}
	body := rolloutAnswer(t, 9<<20)
	for rest := body; len(rest) > 0; rest = rest[min(32<<10, len(rest)):] {
		if err := h.Add(rest[:min(32<<10, len(rest))]); err != nil {
			t.Fatalf("refused at %d of %d bytes: %v", len(h.Body()), len(body), err)
		}
	}
	if !bytes.Equal(h.Body(), body) || Msgpack.Check(h.Body()) != nil {
		t.Fatal("the answer held is not the answer added")
	}
	if held := 16<<20 - b.room.Load(); held < int64(len(body)) || held > 10<<20 {
		t.Fatalf("the budget counts %d bytes for an answer of %d", held, len(body))
	}
	h.Release()
	if b.room.Load() != 16<<20 {
		t.Fatalf("room %d after the answer was released; want the budget, %d", b.room.Load(), 16<<20)
	}
}

// TestBudgetUnderContention holds and releases answers from many
// goroutines: the budget ends whole, and never was exceeded.
func TestBudgetUnderContention(t *testing.T) {
	b := NewBudget(4<<10, 14<<10)
	var wg sync.WaitGroup
	var held atomic.Int64
	for range 8 {
		wg.Go(func() {
			for range 1000 {
				if h, err := b.Hold(4 << 10); err == nil {
					if held.Add(1) > 3 {
						t.Error("over budget: four answers of 4 KiB in 14 KiB")
					}
					held.Add(-1)
					h.Release()
				}
			}
		})
	}
	wg.Wait()
	if b.room.Load() != 14<<10 {
		t.Fatalf("room %d after every answer released; want 14 KiB", b.room.Load())
	}
}

// pass streams body through a Stream in pieces of n bytes, declaring
// length (-1: none), and returns what the client got before Finish and the
// error of Finish.
func pass(t *testing.T, f Format, body []byte, length int64, n int) (sent []byte, finished []byte, err error) {
	t.Helper()
	var client bytes.Buffer
	s := NewStream(f, length)
	for rest := body; len(rest) > 0; rest = rest[min(n, len(rest)):] {
		piece := rest[:min(n, len(rest))]
		if k, err := s.Pass(&client, piece); k != len(piece) || err != nil {
			t.Fatalf("Pass wrote %d of %d: %v", k, len(piece), err)
		}
	}
	sent = bytes.Clone(client.Bytes())
	err = s.Finish(&client)
	return sent, client.Bytes(), err
}

func TestStreamWithholdsTheLastByteUntilTheCheck(t *testing.T) {
	for name, tc := range map[string]struct {
		f    Format
		body []byte
	}{
		"json": {JSON, imageAnswer(100 << 10)}, "msgpack": {Msgpack, rolloutAnswer(t, 100<<10)},
	} {
		for _, n := range []int{1 << 10, 32 << 10, len(tc.body)} {
			t.Run(fmt.Sprintf("%s/pieces of %d", name, n), func(t *testing.T) {
				whole := tc.body
				sent, got, err := pass(t, tc.f, whole, int64(len(whole)), n)
				if err != nil || !bytes.Equal(got, whole) || !bytes.Equal(sent, whole[:len(whole)-1]) {
					t.Fatalf("a whole answer: %d of %d bytes before the check, %d after, %v", len(sent), len(whole), len(got), err)
				}
				cut := whole[:len(whole)/2] // a complete HTTP answer, its body cut
				sent, got, err = pass(t, tc.f, cut, int64(len(cut)), n)
				if err == nil || len(got) != len(cut)-1 || len(sent) != len(cut)-1 {
					t.Fatalf("a cut answer: %v, %d of its %d bytes reached the client", err, len(got), len(cut))
				}
				sent, got, err = pass(t, tc.f, whole, -1, n)
				if err != nil || !bytes.Equal(sent, whole) || !bytes.Equal(got, whole) {
					t.Fatalf("undeclared length: %d then %d bytes, %v; all pass, the handler's end completes them", len(sent), len(got), err)
				}
				if _, _, err = pass(t, tc.f, cut, -1, n); err == nil {
					t.Fatal("a cut answer of undeclared length passed the check")
				}
			})
		}
	}
	if NewStream(Opaque, 10) != nil {
		t.Fatal("a stream to check an opaque body")
	}
}

// The costs of holding an answer and of checking it, per job and per MB:
// the figures in docs/benchmarks.md. Each op is one answer: held from its
// header, added in the 32 KiB pieces reverse_proxy copies in, checked and
// released; or, too large to hold, passed and checked as it streams.

func BenchmarkHold(b *testing.B) {
	for _, size := range []int{1 << 10, 2 << 20, 22 << 20} {
		for _, f := range []Format{JSON, Msgpack} {
			body := imageAnswer(size)
			if f == Msgpack {
				body = rolloutAnswer(b, size)
			}
			b.Run(fmt.Sprintf("%s/%s", formatName[f], sizeName(size)), func(b *testing.B) {
				budget := NewBudget(32<<20, 256<<20)
				b.SetBytes(int64(len(body)))
				b.ReportAllocs()
				for b.Loop() {
					h, _ := budget.Hold(int64(len(body)))
					for rest := body; len(rest) > 0; rest = rest[min(32<<10, len(rest)):] {
						h.Add(rest[:min(32<<10, len(rest))])
					}
					if err := f.Check(h.Body()); err != nil {
						b.Fatal(err)
					}
					h.Release()
				}
			})
		}
	}
}

func BenchmarkStream(b *testing.B) {
	for _, f := range []Format{JSON, Msgpack} {
		body := imageAnswer(200 << 20)
		if f == Msgpack {
			body = rolloutAnswer(b, 200<<20)
		}
		b.Run(formatName[f]+"/200MiB", func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				s := NewStream(f, int64(len(body)))
				for rest := body; len(rest) > 0; rest = rest[min(32<<10, len(rest)):] {
					s.Pass(nopWriter{}, rest[:min(32<<10, len(rest))])
				}
				if err := s.Finish(nopWriter{}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

var formatName = map[Format]string{JSON: "json", Msgpack: "msgpack"}

func sizeName(n int) string {
	if n < 1<<20 {
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dMiB", n>>20)
}

// nopWriter is a client that takes everything at once.
type nopWriter struct{}

func (nopWriter) Write(p []byte) (int, error) { return len(p), nil }
