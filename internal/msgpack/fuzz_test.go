package msgpack

// CI runs the targets for a few seconds:
//
//	go test -run XXX -fuzz '^FuzzDecode$' -fuzztime 30s ./internal/msgpack

import (
	"bytes"
	"errors"
	"testing"
)

// FuzzDecode checks the decoder and Whole against each other and against
// the encoder, and a Stream fed in pieces against Whole: what decodes is
// whole; its encoding decodes to a value that
// encodes the same again; and no strict prefix of an encoding is whole.
func FuzzDecode(f *testing.F) {
	for _, seed := range [][]byte{
		{0xc0}, {0x92, 0x01, 0xa1, 'a'}, {0x81, 0xa1, 'k', 0xcb, 0, 0, 0, 0, 0, 0, 0, 0},
		{0xd9, 0x01, 'x'}, {0xc4, 0x00}, {0xd4, 0x01, 0x02}, {0xdd, 0, 0, 0, 1, 0xc3},
	} {
		f.Add(seed)
	}
	b, _ := Marshal(rolloutLike("QUJD"))
	f.Add(b)
	f.Fuzz(func(t *testing.T, data []byte) {
		whole := Whole(data)
		for k := range len(data) {
			if got := inPieces(data, k, 1); kind(got) != kind(whole) {
				t.Fatalf("%x fed as %x and the rest a byte at a time: %v; at once: %v", data, data[:k], got, whole)
			}
		}
		v, err := UnmarshalOrdered(data)
		if err != nil {
			if whole == nil && (errors.Is(err, ErrIncomplete) || errors.Is(err, ErrTrailing)) {
				t.Fatalf("Whole accepts what the decoder finds cut: %v", err)
			}
			return
		}
		if whole != nil {
			t.Fatalf("decoded, but Whole says %v", whole)
		}
		enc, err := Marshal(v)
		if err != nil {
			t.Fatalf("cannot encode what was decoded: %v", err)
		}
		v2, err := UnmarshalOrdered(enc)
		if err != nil {
			t.Fatalf("cannot decode its own encoding %x: %v", enc, err)
		}
		if enc2, _ := Marshal(v2); !bytes.Equal(enc, enc2) {
			t.Fatalf("encoding is not stable: %x then %x", enc, enc2)
		}
		for k := range len(enc) {
			if Whole(enc[:k]) == nil {
				t.Fatalf("prefix %x of %x is whole", enc[:k], enc)
			}
		}
	})
}
