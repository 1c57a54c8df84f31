package strictjson

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
)

func TestStrictObjectRefusesKeysTwice(t *testing.T) {
	for body, want := range map[string]string{
		`{"model_path":"../../../../root/.ssh","Model_Path":"/ckpt/ok"}`: `JSON key "Model_Path" differs from "model_path" only in case`,
		`{"num_inference_steps":50,"Num_Inference_Steps":1}`:             `JSON key "Num_Inference_Steps" differs from "num_inference_steps"`,
		`{"model_path":"/ckpt/ok","model_path":"../x"}`:                  `JSON key "model_path" appears twice`,
		`{"model_path":"/ckpt/ok","model_p\u0061th":"../x"}`:             `JSON key "model_path" appears twice`,          // an escape is the same key
		`{"size":"64x64","ſize":"4096x4096"}`:                            `JSON key "ſize" differs from "size"`,          // long s folds to s
		`{"\u212aind":1,"Kind":2}`:                                       "JSON key \"Kind\" differs from \"\u212aind\"", // the Kelvin sign folds to k
		`{"extra_body":{"num_frames":1,"NUM_FRAMES":96}}`:                `JSON key "extra_body.NUM_FRAMES"`,
		`{"loras":[{"scale":1},{"scale":1,"Scale":2}]}`:                  `JSON key "loras[1].Scale"`,
		`[{"a":1},{"a":1,"a":2}]`:                                        `JSON key "[1].a" appears twice`,
		`{"a":{"b":{"c":[[{"d":1,"D":2}]]}}}`:                            `JSON key "a.b.c[0][0].D"`,
	} {
		_, err := Scan([]byte(body))
		if _, ok := errors.AsType[*KeyError](err); !ok || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: error %v; want a key error containing %s", body, err, want)
		}
	}
}

func TestStrictObjectReadsExactKeys(t *testing.T) {
	body := ` { "size" : "64x64" ,"Width":5, "extra_body": {"n": 2} , "p":[1, {"q":null}],"z":null} `
	m, err := Object([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"size": `"64x64"`, "Width": `5`, "extra_body": `{"n": 2}`, "p": `[1, {"q":null}]`, "z": `null`}
	if len(m) != len(want) {
		t.Fatalf("members %v; want %v", m, want)
	}
	for k, v := range want {
		if string(m[k]) != v {
			t.Errorf("member %s = %s; want %s", k, m[k], v)
		}
	}
	if Member(m, "width") != nil || Member(m, "Width") != json.Number("5") || Member(m, "z") != nil {
		t.Error("members are not read by exact key")
	}
	// Keys that differ in more than case are different keys.
	if _, err := Object([]byte(`{"size":1,"sizes":2,"siz":3,"a":{"size":4}}`)); err != nil {
		t.Errorf("distinct keys refused: %v", err)
	}
}

func TestStrictObjectRefusesWhatIsNotAnObject(t *testing.T) {
	for body, want := range map[string]error{
		`{"prompt":`: ErrInvalid,
		`{} {}`:      ErrInvalid,
		`{"a":1,}`:   ErrInvalid,
		`{1:2}`:      ErrInvalid,
		`{"a":1]`:    ErrInvalid,
		`{"a" 1}`:    ErrInvalid,
		``:           ErrInvalid,
		`NaN`:        ErrInvalid,
		"\ufeff{}":   ErrInvalid,
		`[1,2]`:      ErrNotObject,
		`"x"`:        ErrNotObject,
		`null`:       ErrNotObject,
		`1e999`:      ErrNotObject,
	} {
		if _, err := Object([]byte(body)); err != want {
			t.Errorf("%q: error %v; want %v", body, err, want)
		}
	}
}

func TestStrictObjectDepthMatchesEncodingJSON(t *testing.T) {
	for _, depth := range []int{MaxDepth, MaxDepth + 1, 1 << 20} {
		body := strings.Repeat(`{"a":`, depth) + "1" + strings.Repeat("}", depth)
		_, err := Object([]byte(body))
		if valid := json.Valid([]byte(body)); (err == nil) != valid {
			t.Errorf("depth %d: error %v; encoding/json finds it valid: %v", depth, err, valid)
		}
		if depth > MaxDepth && err != ErrTooDeep {
			t.Errorf("depth %d: error %v; want %v", depth, err, ErrTooDeep)
		}
	}
}

func TestFoldKeyIsEqualFold(t *testing.T) {
	keys := []string{"size", "SIZE", "Size", "ſize", "kind", "Kind", "ǅ", "ǆ", "Ǆ", "σ", "ς", "Σ", "ß", "ẞ", "ss", "é", "É", "ı", "i", "İ"}
	for _, a := range keys {
		for _, b := range keys {
			if (foldKey(a) == foldKey(b)) != strings.EqualFold(a, b) {
				t.Errorf("foldKey(%q)=%q, foldKey(%q)=%q; EqualFold says %v", a, foldKey(a), b, foldKey(b), strings.EqualFold(a, b))
			}
		}
	}
}

// An object with more keys than keySet compares one by one folds them into
// a map: a key given twice is found among the first keys or the last.
func TestStrictObjectRefusesKeysTwiceInLargeObjects(t *testing.T) {
	var keys []string
	for i := range 3 * fewKeys {
		keys = append(keys, fmt.Sprintf(`"k%d":%d`, i, i))
	}
	many := strings.Join(keys, ",")
	for body, want := range map[string]string{
		`{` + many + `,"K0":1}`:                  `JSON key "K0" differs from "k0" only in case`,
		`{` + many + `,"k47":1}`:                 `JSON key "k47" appears twice`,
		`{"\u212a1":0,` + many + `}`:             "JSON key \"k1\" differs from \"\u212a1\"",
		`{"a":{` + many + `,"\u212a` + `40":1}}`: "JSON key \"a.\u212a40\" differs from \"k40\"",
	} {
		_, err := Scan([]byte(body))
		if _, ok := errors.AsType[*KeyError](err); !ok || !strings.Contains(err.Error(), want) {
			t.Errorf("%.40s...: error %v; want a key error containing %s", body, err, want)
		}
	}
	if _, err := Scan([]byte(`{` + many + `}`)); err != nil {
		t.Errorf("distinct keys refused: %v", err)
	}
}

func TestPickReadsTheNamedMembersOfTheTopLevel(t *testing.T) {
	body := ` { "size" : "64x64" ,"Width":5, "extra_body": {"n": 2, "size":"8x8"} , "p\u0061th":"x","z":null} `
	got := make([]json.RawMessage, 6)
	got[0] = json.RawMessage("left from an earlier body")
	if err := Pick([]byte(body), []string{"n", "size", "width", "extra_body", "path", "z"}, got); err != nil {
		t.Fatal(err)
	}
	want := []string{"", `"64x64"`, "", `{"n": 2, "size":"8x8"}`, `"x"`, "null"}
	for i := range want {
		if string(got[i]) != want[i] || (want[i] == "") != (got[i] == nil) {
			t.Errorf("member %d = %q; want %q", i, got[i], want[i])
		}
	}
	one := make([]json.RawMessage, 1)
	if err := Pick([]byte(`[1]`), []string{"a"}, one); !errors.Is(err, ErrNotObject) {
		t.Errorf("an array: error %v; want %v", err, ErrNotObject)
	}
	if err := Pick([]byte(`{"a":`), []string{"a"}, one); !errors.Is(err, ErrInvalid) {
		t.Errorf("a body cut short: error %v; want %v", err, ErrInvalid)
	}
	if err := Pick([]byte(`{"a":1,"A":2}`), []string{"a"}, one); err == nil {
		t.Error("a key given twice: no error")
	}
}
