package diffusionrouter

// Fuzz targets for what the root package reads: the start of image
// answers and the Caddyfile directive (the bodies' targets live with
// their readers under internal/). Each checks a property against an
// independent reading, not just the absence of a panic. Seeds live in
// testdata/fuzz/<Name>/ or in the target; CI runs each for a few seconds:
//
//	go test -run XXX -fuzz '^FuzzCaddyfile$' -fuzztime 30s .

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/strictjson/strictjsontest"
)

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
