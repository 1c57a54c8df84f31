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
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/strictjson/strictjsontest"
)

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
	h := &Handler{weights: scheduler.WeightsConfig{Mode: scheduler.ModeDrain, PathPrefixes: fuzzPrefixes}}
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
		case !exact || strictjsontest.FoldCollision(t, body):
			t.Fatal("accepted a body an exact-case reader reads otherwise")
		case req.ModelPath != mp || !bytes.Equal(req.Body, body):
			t.Fatalf("model_path read as %q; the workers read %q", req.ModelPath, mp)
		case strings.ContainsRune(mp, 0) || slices.Contains(strings.FieldsFunc(mp, isPathSeparator), ".."):
			t.Fatalf("accepted model_path %q", mp)
		case !underFuzzPrefixes(mp):
			t.Fatalf("accepted model_path %q, outside %v", mp, fuzzPrefixes)
		case len(req.Version) > maxWeightVersion || strings.ContainsFunc(req.Version, func(c rune) bool { return c < 0x20 || c > 0x7e }):
			t.Fatalf("accepted weight version %q, which cannot go out as a header", req.Version)
		case req.Mode != scheduler.ModeDrain && req.Mode != scheduler.ModeRolling:
			t.Fatalf("accepted mode %q", req.Mode)
		}
		if v, ok := ref["weight_version"].(string); ok && req.Version != v {
			t.Fatalf("weight_version read as %q; the workers read %q", req.Version, v)
		}
	})
}

func FuzzControlBody(f *testing.F) {
	f.Fuzz(func(t *testing.T, body []byte) {
		members, err := decodeJSONBody(httptest.NewRequest("PUT", "/workers/x", bytes.NewReader(body)))
		strictjsontest.CheckKeyError(t, err)
		if err != nil {
			return
		}
		var ref map[string]any
		if len(bytes.TrimSpace(body)) > 0 && (json.Unmarshal(body, &ref) != nil || strictjsontest.FoldCollision(t, body)) {
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

// FuzzLeadingString checks the read of an id from the start of an answer
// against encoding/json's reading of the whole answer: where it finds a
// member in any prefix of an object, it is that object's member.
func FuzzLeadingString(f *testing.F) {
	for _, seed := range []string{`{"id":"x","data":[{"b64_json":"AAAA"}]}`, `{"type": "accepted", "ts": 1.5, "id": "x"}`, `{"a":{"id":"inner"},"id":"outer"}`, `{"id":7}`, `[{"id":"x"}]`} {
		f.Add([]byte(seed), 20)
	}
	f.Fuzz(func(t *testing.T, answer []byte, cut int) {
		var whole map[string]any
		if json.Unmarshal(answer, &whole) != nil || whole == nil || strictjsontest.FoldCollision(t, answer) {
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
