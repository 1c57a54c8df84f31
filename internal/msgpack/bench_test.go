package msgpack

import (
	"strings"
	"testing"
)

// BenchmarkWhole checks a rollout answer of 8 outputs with a 16 MiB base64
// tensor each (128 MiB), the size trajectories bring answers to. Whole
// steps over each tensor in one move, so its MB/s is the body's size over
// the time of a few dozen steps.
func BenchmarkWhole(b *testing.B) {
	body := trajectoryAnswer(b)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if err := Whole(body); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkStream checks the answer of BenchmarkWhole fed in the 32 KiB
// pieces reverse_proxy copies an answer in: a step per piece on top of
// Whole's.
func BenchmarkStream(b *testing.B) {
	body := trajectoryAnswer(b)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if err := inPieces(body, 0, 32<<10); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkWholeSmallValues is the worst case for a framing walk: one step
// per byte, a 1 MiB array of small integers.
func BenchmarkWholeSmallValues(b *testing.B) {
	ints := make([]int, 1<<20)
	for i := range ints {
		ints[i] = i % 100
	}
	body, _ := Marshal(ints)
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if err := Whole(body); err != nil {
			b.Fatal(err)
		}
	}
}

// trajectoryAnswer is a rollout answer of 8 outputs with a 16 MiB base64
// tensor each (128 MiB).
func trajectoryAnswer(b *testing.B) []byte {
	data := strings.Repeat("QUJD", 4<<20)
	list := make([]any, 8)
	for i := range list {
		list[i] = rolloutLike(data)[0]
	}
	body, err := Marshal(list)
	if err != nil {
		b.Fatal(err)
	}
	return body
}
