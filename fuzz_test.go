package diffusionrouter

// Fuzz targets for what clients and operators send, and workers answer:
// JSON and multipart bodies, control bodies, video and image job paths, the
// start of image answers, the Caddyfile directive. Each checks a property
// against an independent reading (encoding/json's maps, which are
// exact-case; mime/multipart's ReadForm), not just the absence of a panic.
// Seeds live in testdata/fuzz/<Name>/ or in the target; CI runs each for a
// few seconds:
//
//	go test -run XXX -fuzz '^FuzzCost$' -fuzztime 30s .

import (
	"bytes"
	"encoding/json"
	"errors"
	"math"
	"mime"
	"mime/multipart"
	"net/http/httptest"
	"net/url"
	"reflect"
	"slices"
	"strings"
	"testing"
)

// foldCollision is the reference for the strict reader: whether any object
// in a valid JSON body has two keys equal under strings.EqualFold.
func foldCollision(t *testing.T, body []byte) bool {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var walk func() bool
	walk = func() bool {
		tok, err := dec.Token()
		if err != nil {
			t.Fatalf("reference walk of valid JSON: %v", err)
		}
		collide := false
		switch tok {
		case json.Delim('{'):
			var keys []string
			for dec.More() {
				k, _ := dec.Token()
				for _, prev := range keys {
					collide = collide || strings.EqualFold(prev, k.(string))
				}
				keys = append(keys, k.(string))
				collide = walk() || collide
			}
			dec.Token()
		case json.Delim('['):
			for dec.More() {
				collide = walk() || collide
			}
			dec.Token()
		}
		return collide
	}
	return walk()
}

// checkKeyError checks that a refusal for a key names two keys that are
// equal under case folding.
func checkKeyError(t *testing.T, err error) {
	if ke, ok := errors.AsType[*keyError](err); ok {
		if !strings.EqualFold(ke.name, ke.other) || !strings.HasSuffix(ke.key, ke.name) {
			t.Fatalf("key error %q names keys that do not collide", err)
		}
	}
}

func FuzzStrictJSON(f *testing.F) {
	f.Fuzz(func(t *testing.T, body []byte) {
		members, err := scanJSON(body)
		checkKeyError(t, err)
		valid := json.Valid(body)
		_, isKeyError := errors.AsType[*keyError](err)
		switch {
		case err == nil && !valid:
			t.Fatal("accepted JSON that encoding/json finds invalid")
		case err == nil && foldCollision(t, body):
			t.Fatal("accepted a body with two keys equal under case folding")
		case err != nil && !isKeyError && valid:
			t.Fatalf("refused valid JSON: %v", err)
		case isKeyError && valid && !foldCollision(t, body):
			t.Fatalf("refused a key the reference finds no twin of: %v", err)
		case err != nil:
			return
		}
		var ref map[string]json.RawMessage
		if json.Unmarshal(body, &ref) != nil {
			if members != nil {
				t.Fatalf("members %v of a body that is not an object", members)
			}
			return
		}
		if len(members) != len(ref) {
			t.Fatalf("%d members; encoding/json reads %d", len(members), len(ref))
		}
		for k, v := range ref {
			if !bytes.Equal(members[k], v) {
				t.Fatalf("member %q = %s; encoding/json reads %s", k, members[k], v)
			}
		}
	})
}

func FuzzCost(f *testing.F) {
	f.Fuzz(func(t *testing.T, body []byte, contentType string, video bool) {
		endpoint := "/v1/images/generations"
		if video {
			endpoint = "/v1/videos"
		}
		fs, err := requestFields(body, contentType)
		checkKeyError(t, err)
		if err != nil {
			return
		}
		if c, err := testCosts.cost(endpoint, fs); err == nil && !(c > 0 && c <= math.MaxFloat64) {
			t.Fatalf("cost %v accepted", c)
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
// reader reads: the top-level field, else extra_body's.
func checkJSONFields(t *testing.T, body []byte, fs fields) {
	if foldCollision(t, body) {
		t.Fatal("accepted a body with two keys equal under case folding")
	}
	var top, extra map[string]any
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	if dec.Decode(&top) != nil {
		t.Fatalf("fields %v read from a body that is not an object", fs)
	}
	if raw, err := json.Marshal(top["extra_body"]); err == nil {
		dec := json.NewDecoder(bytes.NewReader(raw))
		dec.UseNumber()
		_ = dec.Decode(&extra)
	}
	for _, name := range costFieldNames {
		want := top[name]
		if want == nil {
			want = extra[name]
		}
		if got, ok := fs[name]; !reflect.DeepEqual(got, want) || ok != (want != nil) {
			t.Fatalf("field %s read as %#v; an exact-case reader reads %#v", name, got, want)
		}
	}
}

// checkFormFields checks that the cost model read the plain fields
// mime/multipart's own form reader reads, each cost field once.
func checkFormFields(t *testing.T, body []byte, contentType string, fs fields) {
	_, params, _ := mime.ParseMediaType(contentType)
	form, err := multipart.NewReader(bytes.NewReader(body), params["boundary"]).ReadForm(1 << 20)
	if err != nil {
		return // a limit of ReadForm's own
	}
	for _, name := range costFieldNames {
		values := form.Value[name]
		if len(values) > 1 {
			t.Fatalf("form field %s given %d times was read", name, len(values))
		}
		if len(values) == 1 && fs[name] != values[0][:min(len(values[0]), maxFieldBytes)] {
			t.Fatalf("form field %s read as %q; ReadForm reads %q", name, fs[name], values[0])
		}
		if _, ok := fs[name]; ok && len(values) == 0 {
			t.Fatalf("form field %s read from a part ReadForm calls a file", name)
		}
	}
}

// fuzzPrefixes are the weights_path_prefix of FuzzWeightsRequest.
var fuzzPrefixes = []string{"/ckpt", "s3://bucket/"}

// underFuzzPrefixes is the reference for them: the first segment that
// is not empty or "." is the prefix's.
func underFuzzPrefixes(p string) bool {
	firstSegment := func(s string) string {
		for seg := range strings.SplitSeq(s, "/") {
			if seg != "" && seg != "." {
				return seg
			}
		}
		return ""
	}
	if rest, ok := strings.CutPrefix(p, "s3://"); ok {
		return firstSegment(rest) == "bucket"
	}
	return strings.HasPrefix(p, "/") && firstSegment(p) == "ckpt"
}

func FuzzWeightsRequest(f *testing.F) {
	h := &Handler{weights: weightsConfig{mode: modeDrain, pathPrefixes: fuzzPrefixes}}
	f.Fuzz(func(t *testing.T, body []byte) {
		req, status, msg := h.readWeightsRequest(httptest.NewRequest("POST", "/update_weights_from_disk", bytes.NewReader(body)))
		var ref map[string]any
		exact := json.Unmarshal(body, &ref) == nil
		mp, _ := ref["model_path"].(string)
		switch {
		case status != 0 && msg == "":
			t.Fatalf("refused with %d and no message", status)
		case status == 403 && underFuzzPrefixes(mp):
			t.Fatalf("refused %q, which lies under %v", mp, fuzzPrefixes)
		case status != 0:
			return
		case !exact || foldCollision(t, body):
			t.Fatal("accepted a body an exact-case reader reads otherwise")
		case req.modelPath != mp || !bytes.Equal(req.body, body):
			t.Fatalf("model_path read as %q; the workers read %q", req.modelPath, mp)
		case strings.ContainsRune(mp, 0) || slices.Contains(strings.FieldsFunc(mp, isPathSeparator), ".."):
			t.Fatalf("accepted model_path %q", mp)
		case !underFuzzPrefixes(mp):
			t.Fatalf("accepted model_path %q, outside %v", mp, fuzzPrefixes)
		case req.mode != modeDrain && req.mode != modeRolling:
			t.Fatalf("accepted mode %q", req.mode)
		}
		if v, ok := ref["weight_version"].(string); ok && req.version != v {
			t.Fatalf("weight_version read as %q; the workers read %q", req.version, v)
		}
	})
}

func FuzzControlBody(f *testing.F) {
	f.Fuzz(func(t *testing.T, body []byte) {
		members, err := decodeJSONBody(httptest.NewRequest("PUT", "/workers/x", bytes.NewReader(body)))
		checkKeyError(t, err)
		if err != nil {
			return
		}
		var ref map[string]any
		if len(bytes.TrimSpace(body)) > 0 && (json.Unmarshal(body, &ref) != nil || foldCollision(t, body)) {
			t.Fatal("accepted a body an exact-case reader reads otherwise")
		}
		isDead, refresh, err := parseWorkerUpdate(members)
		if err == nil {
			checkWorkerUpdate(t, ref, isDead, refresh)
		}
		u, err := rawWorkerURL(httptest.NewRequest("POST", "/workers", bytes.NewReader(body)))
		if want, _ := ref["url"].(string); err == nil && u != want {
			if want, _ = ref["worker_url"].(string); u != want {
				t.Fatalf("worker URL read as %q; the body says %v", u, ref)
			}
		}
	})
}

// checkWorkerUpdate checks an accepted PUT /workers/{id} body against the
// exact-case reading ref: only the two known fields, each a JSON boolean,
// read as given.
func checkWorkerUpdate(t *testing.T, ref map[string]any, isDead *bool, refresh bool) {
	if len(ref) == 0 {
		t.Fatal("accepted an update with no field")
	}
	for k, v := range ref {
		if _, isBool := v.(bool); !isBool || k != "is_dead" && k != "refresh_video_support" {
			t.Fatalf("update accepted %q: %#v", k, v)
		}
	}
	dead, hasDead := ref["is_dead"].(bool)
	if hasDead != (isDead != nil) || hasDead && dead != *isDead || refresh != (ref["refresh_video_support"] == true) {
		t.Fatalf("update read as is_dead=%v refresh=%v; the body says %v", isDead, refresh, ref)
	}
}

func FuzzVideoJobID(f *testing.F) {
	f.Fuzz(func(t *testing.T, p string) {
		const prefix = "/v1/videos/"
		id, ok := videoJobID(p)
		if ok && (id == "" || strings.Contains(id, "/") || !slices.Contains([]string{prefix + id, prefix + id + "/", prefix + id + "/content"}, p)) {
			t.Fatalf("videoJobID(%q) = %q", p, id)
		}
		// Read as an id, p makes job paths that give it back.
		if p != "" && !strings.Contains(p, "/") {
			for _, jobPath := range []string{prefix + p, prefix + p + "/content"} {
				if got, ok := videoJobID(jobPath); !ok || got != p {
					t.Fatalf("videoJobID(%q) = %q, %v; want %q", jobPath, got, ok, p)
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
		id, err := imageJobID("/v1/images/" + rest)
		if err != nil {
			return
		}
		// An id read from a path is one the router could have learned, and
		// the path is that id's, escaped or not, with or without /content.
		segment, _ := strings.CutSuffix(rest, "/content")
		if unescaped, uerr := url.PathUnescape(segment); !validJobID(id) || uerr != nil || unescaped != id || strings.Contains(segment, "/") {
			t.Fatalf("imageJobID(/v1/images/%s) = %q", rest, id)
		}
		for _, p := range []string{"/v1/images/" + id, "/v1/images/" + id + "/content"} {
			if got, err := imageJobID(p); err != nil || got != id {
				t.Fatalf("imageJobID(%q) = %q, %v; want %q", p, got, err, id)
			}
		}
	})
}

// FuzzLeadingString checks the read of an id from the start of an answer
// against encoding/json's reading of the whole answer: where it finds a
// member in any prefix of an object, it is that object's member.
func FuzzLeadingString(f *testing.F) {
	for _, seed := range []string{`{"id":"x","data":[{"b64_json":"AAAA"}]}`, `{"type": "accepted", "ts": 1.5, "id": "x"}`, `{"a":{"id":"inner"},"id":"outer"}`, `{"id":7}`, `[{"id":"x"}]`} {
		f.Add([]byte(seed), 20)
	}
	f.Fuzz(func(t *testing.T, answer []byte, cut int) {
		var whole map[string]any
		if json.Unmarshal(answer, &whole) != nil || whole == nil || foldCollision(t, answer) {
			return
		}
		want, isString := whole["id"].(string)
		if got, ok := leadingString(answer, "id"); ok != isString || got != want {
			t.Fatalf("leadingString(%s) = %q, %v; want %q, %v", answer, got, ok, want, isString)
		}
		cut = min(max(cut, 0), len(answer))
		if got, ok := leadingString(answer[:cut], "id"); ok && got != want {
			t.Fatalf("leadingString of the prefix %s = %q; the whole says %q", answer[:cut], got, want)
		}
	})
}

func FuzzCaddyfile(f *testing.F) {
	f.Fuzz(func(t *testing.T, directive string) {
		if strings.Contains(directive, "import") {
			t.Skip("import reads files")
		}
		cfg, err := adapt(t, "diffusion_router "+directive)
		if err != nil {
			return
		}
		raw := findHandler(t, cfg)
		if raw == nil {
			return // the input closed the directive and wrote other things
		}
		// What the adapter writes, the module must read: no field unknown.
		delete(raw, "handler")
		b, _ := json.Marshal(raw)
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.DisallowUnknownFields()
		var h Handler
		if err := dec.Decode(&h); err != nil {
			t.Fatalf("adapted handler %s does not decode: %v", b, err)
		}
		h.Workers = nil // provisioning them may look names up
		_ = h.provisionOptions()
	})
}

// findHandler digs the first diffusion_router handler out of an adapted
// config, wherever it is nested.
func findHandler(t *testing.T, cfg string) map[string]any {
	var v any
	if err := json.Unmarshal([]byte(cfg), &v); err != nil {
		t.Fatalf("adapted config is not JSON: %v", err)
	}
	var walk func(any) map[string]any
	walk = func(v any) map[string]any {
		switch v := v.(type) {
		case map[string]any:
			if v["handler"] == "diffusion_router" {
				return v
			}
			for _, e := range v {
				if h := walk(e); h != nil {
					return h
				}
			}
		case []any:
			for _, e := range v {
				if h := walk(e); h != nil {
					return h
				}
			}
		}
		return nil
	}
	return walk(v)
}
