package msgpack

import (
	"bytes"
	"encoding/hex"
	"errors"
	"math"
	"reflect"
	"strings"
	"testing"
)

// The encodings msgspec writes (msgspec/_core.c, mpack_encode_*): the
// shortest integer form, float64 for every float, str8 from 32 bytes.
func TestEncodingsAreMsgspecs(t *testing.T) {
	for _, c := range []struct {
		v    any
		want string
	}{
		{nil, "c0"}, {true, "c3"}, {false, "c2"},
		{0, "00"}, {127, "7f"}, {128, "cc80"}, {255, "ccff"}, {256, "cd0100"},
		{65536, "ce00010000"}, {int64(1) << 32, "cf0000000100000000"},
		{-1, "ff"}, {-32, "e0"}, {-33, "d0df"}, {-128, "d080"}, {-129, "d1ff7f"},
		{-32769, "d2ffff7fff"}, {int64(math.MinInt64), "d38000000000000000"},
		{uint64(math.MaxUint64), "cfffffffffffffffff"},
		{1.5, "cb3ff8000000000000"}, {float32(1.5), "ca3fc00000"},
		{"", "a0"}, {"a", "a161"}, {strings.Repeat("x", 31), "bf" + strings.Repeat("78", 31)},
		{strings.Repeat("x", 32), "d920" + strings.Repeat("78", 32)},
		{strings.Repeat("x", 256), "da0100" + strings.Repeat("78", 256)},
		{[]byte{1, 2}, "c4020102"},
		{[]any{}, "90"}, {[]int{1, 2}, "920102"}, {Map{}, "80"},
		{Map{{"b", 1}, {"a", nil}}, "82a16201a161c0"},
		{map[string]any{"b": 1, "a": nil}, "82a161c0a16201"},
		{Ext{Type: 5, Data: []byte{9}}, "d40509"},
		{Ext{Type: -1, Data: []byte{1, 2, 3}}, "c703ff010203"},
	} {
		got, err := Marshal(c.v)
		if err != nil || hex.EncodeToString(got) != c.want {
			t.Errorf("Marshal(%#v) = %x, %v; want %s", c.v, got, err, c.want)
		}
		if err := Whole(got); err != nil {
			t.Errorf("Whole(%x): %v", got, err)
		}
	}
	long := make([]any, 16)
	for i := range long {
		long[i] = i
	}
	if b, _ := Marshal(long); !bytes.HasPrefix(b, []byte{0xdc, 0, 16}) {
		t.Errorf("16 entries: %x; want array16", b[:3])
	}
	if _, err := Marshal(struct{}{}); err == nil {
		t.Error("a struct was encoded")
	}
}

// rolloutLike is a RolloutResponse list as sglang sends it, its tensor data
// a base64 str.
func rolloutLike(data string) []any {
	tensor := Map{{"__tensor__", true}, {"data", data}, {"shape", []int{4, 2}}, {"dtype", "torch.float32"}}
	return []any{Map{
		{"request_id", "0b9d"}, {"prompt", "a cat"}, {"seed", 7},
		{"generated_output", tensor}, {"rollout_log_probs", tensor},
		{"rollout_debug_tensors", nil}, {"denoising_env", nil}, {"dit_trajectory", nil},
		{"inference_time_s", 0.25}, {"peak_memory_mb", nil},
	}}
}

func TestRoundTripKeepsOrderAndTypes(t *testing.T) {
	v := rolloutLike(strings.Repeat("QUJD", 100))
	b, err := Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	got, err := UnmarshalOrdered(b)
	if err != nil {
		t.Fatal(err)
	}
	sample := got.([]any)[0].(Map)
	want := []string{"request_id", "prompt", "seed", "generated_output", "rollout_log_probs",
		"rollout_debug_tensors", "denoising_env", "dit_trajectory", "inference_time_s", "peak_memory_mb"}
	if !reflect.DeepEqual(sample.Keys(), want) {
		t.Fatalf("keys %v", sample.Keys())
	}
	if seed, _ := sample.Get("seed"); seed != int64(7) {
		t.Fatalf("seed %#v", seed)
	}
	plain, err := Unmarshal(b)
	if err != nil {
		t.Fatal(err)
	}
	out := plain.([]any)[0].(map[string]any)["generated_output"].(map[string]any)
	if out["__tensor__"] != true || out["dtype"] != "torch.float32" || !reflect.DeepEqual(out["shape"], []any{int64(4), int64(2)}) {
		t.Fatalf("tensor %v", out)
	}
	again, _ := Marshal(got)
	if !bytes.Equal(again, b) {
		t.Fatal("decoding and encoding again changed the bytes")
	}
}

func TestWholeRefusesEveryCut(t *testing.T) {
	b, _ := Marshal(rolloutLike(strings.Repeat("QUJD", 300)))
	for k := range len(b) {
		if err := Whole(b[:k]); !errors.Is(err, ErrIncomplete) {
			t.Fatalf("prefix of %d of %d bytes: %v", k, len(b), err)
		}
		if _, err := Unmarshal(b[:k]); !errors.Is(err, ErrIncomplete) {
			t.Fatalf("decoded a prefix of %d bytes: %v", k, err)
		}
	}
	if err := Whole(append(b, 0)); !errors.Is(err, ErrTrailing) {
		t.Fatalf("trailing byte: %v", err)
	}
	if err := Whole([]byte{0x91, 0xc1}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("0xc1: %v", err)
	}
	// A count no body could meet is refused at once, not walked.
	if err := Whole([]byte{0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0}); !errors.Is(err, ErrIncomplete) {
		t.Fatalf("array32 of 4G nils in 6 bytes: %v", err)
	}
	if _, err := Unmarshal([]byte{0xdf, 0xff, 0xff, 0xff, 0xff}); !errors.Is(err, ErrIncomplete) {
		t.Fatalf("map32 of 4G entries in 5 bytes: %v", err)
	}
}

// inPieces checks data through a Stream: its first k bytes, then pieces of
// n bytes.
func inPieces(data []byte, k, n int) error {
	var s Stream
	s.Feed(data[:k])
	for rest := data[k:]; len(rest) > 0; rest = rest[min(n, len(rest)):] {
		s.Feed(rest[:min(n, len(rest))])
	}
	return s.End()
}

// kind is which of Whole's errors err is.
func kind(err error) error {
	for _, k := range []error{ErrIncomplete, ErrTrailing, ErrInvalid} {
		if errors.Is(err, k) {
			return k
		}
	}
	return err
}

// TestStreamAgreesWithWhole cuts bodies into pieces at every offset, and
// into pieces of every size: a Stream finds what Whole finds, however a
// length field or a payload falls across the pieces.
func TestStreamAgreesWithWhole(t *testing.T) {
	rollout, _ := Marshal(rolloutLike(strings.Repeat("QUJD", 20)))
	bodies := [][]byte{
		rollout, rollout[:len(rollout)-3], append(rollout, 0xc0), {0x91, 0xc1},
		{0xdd, 0, 0, 0, 2, 0xcb, 1, 2, 3, 4, 5, 6, 7, 8, 0xc7, 1, 5, 9},
		{0xda, 0, 3, 'a', 'b', 'c'}, {0xda, 0, 3, 'a'}, {0xc0}, {},
	}
	for _, body := range bodies {
		want := Whole(body)
		for k := range len(body) + 1 {
			for n := 1; n <= max(1, len(body)); n++ {
				if got := inPieces(body, k, n); kind(got) != kind(want) {
					t.Fatalf("%x: first %d bytes, then pieces of %d: %v; Whole says %v", body, k, n, got, want)
				}
			}
		}
	}
}

func TestDecoderLimitsDepthButWholeDoesNot(t *testing.T) {
	deep := append(bytes.Repeat([]byte{0x91}, MaxDepth+1), 0xc0)
	if err := Whole(deep); err != nil {
		t.Fatalf("Whole: %v", err)
	}
	if _, err := Unmarshal(deep); !errors.Is(err, ErrTooDeep) {
		t.Fatalf("Unmarshal: %v", err)
	}
}

func TestDecoderRefusesNonStringKeys(t *testing.T) {
	if _, err := Unmarshal([]byte{0x81, 0x01, 0x02}); err == nil || !strings.Contains(err.Error(), "map key") {
		t.Fatalf("int key: %v", err)
	}
}
