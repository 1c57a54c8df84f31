package diffusionrouter

import (
	"encoding/json"
	"errors"
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
		_, err := scanJSON([]byte(body))
		if _, ok := errors.AsType[*keyError](err); !ok || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: error %v; want a key error containing %s", body, err, want)
		}
	}
}

func TestStrictObjectReadsExactKeys(t *testing.T) {
	body := ` { "size" : "64x64" ,"Width":5, "extra_body": {"n": 2} , "p":[1, {"q":null}],"z":null} `
	m, err := strictObject([]byte(body))
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
	if jsonMember(m, "width") != nil || jsonMember(m, "Width") != json.Number("5") || jsonMember(m, "z") != nil {
		t.Error("members are not read by exact key")
	}
	// Keys that differ in more than case are different keys.
	if _, err := strictObject([]byte(`{"size":1,"sizes":2,"siz":3,"a":{"size":4}}`)); err != nil {
		t.Errorf("distinct keys refused: %v", err)
	}
}

func TestStrictObjectRefusesWhatIsNotAnObject(t *testing.T) {
	for body, want := range map[string]error{
		`{"prompt":`: errInvalidJSON,
		`{} {}`:      errInvalidJSON,
		`{"a":1,}`:   errInvalidJSON,
		`{1:2}`:      errInvalidJSON,
		`{"a":1]`:    errInvalidJSON,
		`{"a" 1}`:    errInvalidJSON,
		``:           errInvalidJSON,
		`NaN`:        errInvalidJSON,
		"\ufeff{}":   errInvalidJSON,
		`[1,2]`:      errNotObject,
		`"x"`:        errNotObject,
		`null`:       errNotObject,
		`1e999`:      errNotObject,
	} {
		if _, err := strictObject([]byte(body)); err != want {
			t.Errorf("%q: error %v; want %v", body, err, want)
		}
	}
}

func TestStrictObjectDepthMatchesEncodingJSON(t *testing.T) {
	for _, depth := range []int{maxJSONDepth, maxJSONDepth + 1, 1 << 20} {
		body := strings.Repeat(`{"a":`, depth) + "1" + strings.Repeat("}", depth)
		_, err := strictObject([]byte(body))
		if valid := json.Valid([]byte(body)); (err == nil) != valid {
			t.Errorf("depth %d: error %v; encoding/json finds it valid: %v", depth, err, valid)
		}
		if depth > maxJSONDepth && err != errTooDeep {
			t.Errorf("depth %d: error %v; want %v", depth, err, errTooDeep)
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

func TestUnderPrefixComparesSegments(t *testing.T) {
	for _, tc := range []struct {
		path, prefix string
		want         bool
	}{
		{"/ckpt/x", "/ckpt", true},
		{"/ckpt/x", "/ckpt/", true},
		{"/ckpt", "/ckpt/", true},
		{"/ckpt//x/./y", "/ckpt", true},
		{"/ckpt-evil/x", "/ckpt", false},
		{"/ckpt-evil/x", "/ckpt/", false},
		{"/ckptx", "/ckpt", false},
		{`/ckpt\x`, "/ckpt", false},
		{"ckpt/x", "/ckpt", false},
		{"/other/ckpt/x", "/ckpt", false},
		{"/anything", "/", true},
		{"s3://bucket/x", "s3://bucket/", true},
		{"s3://bucket", "s3://bucket/", true},
		{"s3://bucket-evil/x", "s3://bucket/", false},
		{"s3://bucket-evil/x", "s3://bucket", false},
		{"s3://bucket@evil/x", "s3://bucket/", false},
		{"S3://bucket/x", "s3://bucket/", false},
		{"gs://bucket/x", "s3://bucket/", false},
		{"s3://bucket/x", "/ckpt", false},
		{"/ckpt/x", "s3://bucket/", false},
		{"/ckpt/a://b", "/ckpt", true}, // a path with "://" in it, not a URL
		{"hf://org/model/sub", "hf://org/model", true},
		{"hf://org/model-2", "hf://org/model", false},
	} {
		if got := underPrefix(tc.path, tc.prefix); got != tc.want {
			t.Errorf("underPrefix(%q, %q) = %v; want %v", tc.path, tc.prefix, got, tc.want)
		}
	}
}

func TestCostReadsExactKeys(t *testing.T) {
	// Python ignores a key it does not know, whatever its likeness to one
	// it knows; so does the cost model.
	f, err := jsonFields([]byte(`{"Num_Inference_Steps":1,"SIZE":"1x1","extra_body":{"N":9}}`))
	if err != nil || len(f) != 0 {
		t.Fatalf("fields %v, %v; want none", f, err)
	}
	if _, err := jsonFields([]byte(`{"extra_body":[1]}`)); err == nil || !strings.HasPrefix(err.Error(), "extra_body") {
		t.Errorf("extra_body that is not an object: %v", err)
	}
	if _, err := jsonFields([]byte(`{"extra_body":null,"size":"8x8"}`)); err != nil {
		t.Errorf("extra_body null: %v", err)
	}
}

func TestCostRefusesAmbiguousFormParts(t *testing.T) {
	part := func(header, value string) string {
		return "--b\r\nContent-Disposition: " + header + "\r\n\r\n" + value + "\r\n"
	}
	for name, body := range map[string]string{
		"steps twice":      part(`form-data; name="num_inference_steps"`, "1") + part(`form-data; name="num_inference_steps"`, "50"),
		"escaped name":     part(`form-data; name="num\_inference_steps"`, "1"),
		"RFC 2231 name":    part(`form-data; name*=utf-8''num_inference_steps`, "1"),
		"unquoted name":    part(`form-data; name=num_inference_steps`, "1"),
		"no name":          part(`form-data`, "1"),
		"unparsable":       part(`form-data; name="a"; name="num_inference_steps"`, "1"),
		"RFC 2231 file":    part(`form-data; name="num_inference_steps"; filename*=utf-8''x.png`, "50"),
		"two dispositions": "--b\r\nContent-Disposition: form-data; name=\"a\"\r\nContent-Disposition: form-data; name=\"num_inference_steps\"\r\n\r\n50\r\n",
	} {
		if _, err := formFields([]byte(body+"--b--\r\n"), "multipart/form-data; boundary=b"); err == nil {
			t.Errorf("%s: form read", name)
		}
	}
	ok := part(`form-data; name="image"; filename="in.png"`, "png") + part(`form-data; name="num_inference_steps"`, "4") +
		part(`form-data; name="image"; filename="second.png"`, "png") + part(`form-data; name="tag"`, "a") + part(`form-data; name="tag"`, "b") +
		part(`form-data; name="n"; filename=x.png`, "9") // a file to every parser, quoted or not
	f, err := formFields([]byte(ok+"--b--\r\n"), "multipart/form-data; boundary=b")
	if _, n := f["n"]; err != nil || f["num_inference_steps"] != "4" || n {
		t.Fatalf("plain form: %v, %v", f, err)
	}
}

func TestCostRefusesFramesBeyondCounting(t *testing.T) {
	f, err := jsonFields([]byte(`{"fps":1e10,"seconds":1e10}`))
	if err != nil {
		t.Fatal(err)
	}
	if c, err := testCosts.cost("/v1/videos", f); err == nil {
		t.Fatalf("1e20 frames cost %v", c)
	}
}
