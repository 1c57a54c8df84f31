package strictjson

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

// rolloutJSON is a rollout answer in the older JSON form: a list of
// RolloutResponse objects, tensors as base64 strings.
func rolloutJSON(outputs, dataBytes int) []byte {
	data := strings.Repeat("QUJD", dataBytes/4)
	sample := `{"request_id":"0b9d","prompt":"a \"cat\" \\","seed":7,` +
		`"generated_output":{"__tensor__":true,"data":"` + data + `","shape":[4,2],"dtype":"torch.float32"},` +
		`"rollout_log_probs":null,"rollout_debug_tensors":null,"denoising_env":{},"dit_trajectory":[],` +
		`"inference_time_s":0.25,"peak_memory_mb":-1.5e3}`
	return []byte("[" + strings.Repeat(sample+",", outputs-1) + sample + "]\n")
}

func TestWholeRefusesEveryCut(t *testing.T) {
	body := rolloutJSON(2, 64)
	if err := Whole(body); err != nil {
		t.Fatal(err)
	}
	end := len(bytes.TrimRight(body, " \n"))
	for k := range end {
		if err := Whole(body[:k]); !errors.Is(err, ErrIncomplete) {
			t.Fatalf("prefix of %d of %d bytes (%q): %v", k, len(body), body[max(0, k-10):k], err)
		}
	}
}

func TestWholeStructure(t *testing.T) {
	for body, want := range map[string]error{
		`{}`: nil, ` [ ] `: nil, `"x"`: nil, `true`: nil, `null`: nil, `12`: nil,
		`{"a":[1,{"b":"]}"}]}`: nil, `"\\"`: nil, `"\""`: nil,
		`{"a":1}{}`: ErrTrailing, `[1] x`: ErrTrailing,
		`{"a" 1}`: ErrStructure, `{a:1}`: ErrStructure, `[1,]`: ErrStructure, `{"a":1,}`: ErrStructure,
		`[1}`: ErrStructure, `{"a":1]`: ErrStructure, `[tru]`: ErrStructure, `nul`: ErrIncomplete,
		`[`: ErrIncomplete, `"\"`: ErrIncomplete, `{"a":`: ErrIncomplete, ``: ErrIncomplete, `  `: ErrIncomplete,
		strings.Repeat("[", MaxDepth+1) + strings.Repeat("]", MaxDepth+1): ErrTooDeep,
	} {
		if err := Whole([]byte(body)); !errors.Is(err, want) && !(err == nil && want == nil) {
			t.Errorf("Whole(%.40q) = %v; want %v", body, err, want)
		}
	}
}

// FuzzWhole checks Whole against encoding/json: valid JSON is whole, and
// no strict prefix of valid JSON (its trailing whitespace aside) is,
// unless the value is a bare number.
func FuzzWhole(f *testing.F) {
	for _, s := range []string{`{}`, `[1,"a",{"b":null}]`, `"a\"b"`, `true`, `{"a":[[],{}]}`} {
		f.Add([]byte(s))
	}
	f.Add(rolloutJSON(2, 8))
	f.Fuzz(func(t *testing.T, body []byte) {
		err := Whole(body)
		for k := range len(body) {
			if got := inPieces(body, k, 1); kind(got) != kind(err) {
				t.Fatalf("%q fed as %q and the rest a byte at a time: %v; at once: %v", body, body[:k], got, err)
			}
		}
		if !json.Valid(body) {
			return
		}
		if err != nil {
			t.Fatalf("valid JSON is not whole: %v", err)
		}
		trimmed := bytes.TrimRight(body, " \t\r\n")
		if top := bytes.TrimLeft(trimmed, " \t\r\n"); top[0] == '-' || '0' <= top[0] && top[0] <= '9' {
			return // a bare number
		}
		for k := range len(trimmed) {
			if Whole(body[:k]) == nil {
				t.Fatalf("prefix %q of %q is whole", body[:k], body)
			}
		}

	})
}

// inPieces checks body through a Stream: its first k bytes, then pieces of
// n bytes.
func inPieces(body []byte, k, n int) error {
	var s Stream
	s.Feed(body[:k])
	for rest := body[k:]; len(rest) > 0; rest = rest[min(n, len(rest)):] {
		s.Feed(rest[:min(n, len(rest))])
	}
	return s.End()
}

// TestStreamAgreesWithWhole cuts bodies into pieces at every offset, and
// into pieces of every size: a Stream finds what Whole finds, however an
// escape, a literal, a number or a key falls across the pieces.
func TestStreamAgreesWithWhole(t *testing.T) {
	bodies := []string{
		string(rolloutJSON(2, 16)), `"a\\\"b\\"`, `["\\\\", "\\\"\\"]`, `{"k\"":true, "n": -1.5e3}`,
		`[null,false,true]`, `12`, `[12`, `{"a":1}{}`, `[tru]`, `{"a" 1}`, `["\\"`, ` {} `,
	}
	for _, body := range bodies {
		want := Whole([]byte(body))
		for k := range len(body) + 1 {
			for n := 1; n <= len(body); n++ {
				if got := inPieces([]byte(body), k, n); kind(got) != kind(want) {
					t.Fatalf("%q: first %d bytes, then pieces of %d: %v; Whole says %v", body, k, n, got, want)
				}
			}
		}
	}
}

// kind is which of the package's errors err is.
func kind(err error) error {
	for _, k := range []error{ErrIncomplete, ErrTrailing, ErrStructure, ErrTooDeep} {
		if errors.Is(err, k) {
			return k
		}
	}
	return err
}

// BenchmarkStream checks the answer of BenchmarkWhole fed in the 32 KiB
// pieces reverse_proxy copies an answer in.
func BenchmarkStream(b *testing.B) {
	body := rolloutJSON(4, 8<<20)
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if err := inPieces(body, 0, 32<<10); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkWhole and BenchmarkValid compare the structural check with
// json.Valid on a 4-output rollout answer of 8 MiB of base64 each.
func BenchmarkWhole(b *testing.B) {
	body := rolloutJSON(4, 8<<20)
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if err := Whole(body); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkValid(b *testing.B) {
	body := rolloutJSON(4, 8<<20)
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if !json.Valid(body) {
			b.Fatal("invalid")
		}
	}
}

// BenchmarkWholeSmallValues is the worst case for Whole: no long strings
// to skip, one step per short value.
func BenchmarkWholeSmallValues(b *testing.B) {
	body := []byte("[" + strings.Repeat(`{"a":1,"b":[true,null,"x"]},`, 1<<15) + "0]")
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if err := Whole(body); err != nil {
			b.Fatal(err)
		}
	}
}
