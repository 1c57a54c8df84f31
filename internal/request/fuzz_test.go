package request

// Fuzz targets for what clients send: JSON and multipart bodies, video and
// image job paths. Each checks a property against an independent reading
// (encoding/json's maps, which are exact-case; mime/multipart's ReadForm),
// not just the absence of a panic. Seeds live in testdata/fuzz/<Name>/ or
// in the target; CI runs each for a few seconds:
//
//	go test -run XXX -fuzz '^FuzzCost$' -fuzztime 30s ./internal/request

import (
	"bytes"
	"encoding/json"
	"mime"
	"mime/multipart"
	"net/url"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/strictjson/strictjsontest"
)

func FuzzCost(f *testing.F) {
	f.Fuzz(func(t *testing.T, body []byte, contentType string, video bool) {
		fs, err := ReadFields(body, contentType)
		strictjsontest.CheckKeyError(t, err)
		if err != nil {
			return
		}
		// video is kept for the seeds' sake: every generation endpoint's
		// rule costs every body.
		for _, e := range Endpoints {
			if e.Cost == nil {
				continue
			}
			if c, err := e.Cost(testCosts, fs); err == nil && !(c > 0 && c <= maxJobCost) {
				t.Fatalf("%s: cost %v accepted", e.Path, c)
			}
		}
		switch mt, _, _ := mime.ParseMediaType(contentType); {
		case strings.HasPrefix(mt, "multipart/"):
			checkFormFields(t, body, contentType, fs)
		case mt == "application/msgpack", mt == "application/x-msgpack", mt == "application/octet-stream":
			if len(fs) > 0 {
				t.Fatalf("fields %v read from a binary body", fs)
			}
		default:
			checkJSONFields(t, body, fs)
		}
	})
}

// checkJSONFields checks that the cost model read what an exact-case JSON
// reader reads: the top level's cost fields, and the override objects'
// (a null in them kept as cleared), each apart.
func checkJSONFields(t *testing.T, body []byte, fs Fields) {
	if strictjsontest.FoldCollision(t, body) {
		t.Fatal("accepted a body with two keys equal under case folding")
	}
	var top map[string]any
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	if dec.Decode(&top) != nil {
		t.Fatalf("fields %v read from a body that is not an object", fs)
	}
	checkCostFields(t, "", top, fs, false)
	for _, name := range overrideNames {
		switch want := top[name].(type) {
		case map[string]any:
			got, ok := fs[name].(Fields)
			if !ok {
				t.Fatalf("override %s read as %#v; an exact-case reader reads an object", name, fs[name])
			}
			checkCostFields(t, name+".", want, got, true)
		default:
			if got, ok := fs[name]; !reflect.DeepEqual(got, want) || ok != (want != nil) {
				t.Fatalf("override %s read as %#v; an exact-case reader reads %#v", name, got, want)
			}
		}
	}
}

// checkCostFields checks got's cost fields against an exact-case reading.
func checkCostFields(t *testing.T, where string, want map[string]any, got Fields, keepNulls bool) {
	for _, name := range costFieldNames {
		w, given := want[name]
		if w == nil && given && keepNulls {
			w = cleared{}
		}
		if g, ok := got[name]; !reflect.DeepEqual(g, w) || ok != (w != nil) {
			t.Fatalf("field %s%s read as %#v; an exact-case reader reads %#v", where, name, g, w)
		}
	}
}

// checkFormFields checks that the cost model read the plain fields
// mime/multipart's own form reader reads, each cost field and override
// once, an override whole.
func checkFormFields(t *testing.T, body []byte, contentType string, fs Fields) {
	_, params, _ := mime.ParseMediaType(contentType)
	form, err := multipart.NewReader(bytes.NewReader(body), params["boundary"]).ReadForm(1 << 20)
	if err != nil {
		return // a limit of ReadForm's own
	}
	for _, name := range slices.Concat(costFieldNames[:], overrideNames[:]) {
		values := form.Value[name]
		if len(values) > 1 {
			t.Fatalf("form field %s given %d times was read", name, len(values))
		}
		want := ""
		if len(values) == 1 {
			want = values[0]
		}
		if !slices.Contains(overrideNames[:], name) {
			want = want[:min(len(want), maxFieldBytes)]
		}
		if len(values) == 1 && fs[name] != want {
			t.Fatalf("form field %s read as %q; ReadForm reads %q", name, fs[name], values[0])
		}
		if _, ok := fs[name]; ok && len(values) == 0 {
			t.Fatalf("form field %s read from a part ReadForm calls a file", name)
		}
	}
}

func FuzzVideoJobID(f *testing.F) {
	f.Fuzz(func(t *testing.T, p string) {
		const prefix = "/v1/videos/"
		id, ok := VideoJobID(p)
		if ok && (id == "" || strings.Contains(id, "/") || !slices.Contains([]string{prefix + id, prefix + id + "/", prefix + id + "/content"}, p)) {
			t.Fatalf("VideoJobID(%q) = %q", p, id)
		}
		// Read as an id, p makes job paths that give it back.
		if p != "" && !strings.Contains(p, "/") {
			for _, jobPath := range []string{prefix + p, prefix + p + "/content"} {
				if got, ok := VideoJobID(jobPath); !ok || got != p {
					t.Fatalf("VideoJobID(%q) = %q, %v; want %q", jobPath, got, ok, p)
				}
			}
		}
	})
}

func FuzzImageJobID(f *testing.F) {
	for _, seed := range []string{"0b6d3a4e-9d8c-4f7a-8e1b-2c3d4e5f6a7b", "abc/content", "abc%2Fcontent", "a%2fb/content", "%2e%2e", "abc/", "/content", "a%00", "%zz"} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, rest string) {
		id, err := ImageJobID("/v1/images/" + rest)
		if err != nil {
			return
		}
		// An id read from a path is one the router could have learned, and
		// the path is that id's, escaped or not, with or without /content.
		segment, _ := strings.CutSuffix(rest, "/content")
		if unescaped, uerr := url.PathUnescape(segment); !ValidJobID(id) || uerr != nil || unescaped != id || strings.Contains(segment, "/") {
			t.Fatalf("ImageJobID(/v1/images/%s) = %q", rest, id)
		}
		for _, p := range []string{"/v1/images/" + id, "/v1/images/" + id + "/content"} {
			if got, err := ImageJobID(p); err != nil || got != id {
				t.Fatalf("ImageJobID(%q) = %q, %v; want %q", p, got, err, id)
			}
		}
	})
}
