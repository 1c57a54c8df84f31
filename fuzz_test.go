package diffusionrouter

// The fuzz target for what the root package reads: the Caddyfile
// directive (the bodies' and answers' targets live with their readers
// under internal/). It checks a property against an independent reading,
// not just the absence of a panic. Seeds live in testdata/fuzz/<Name>/ or
// in the target; CI runs it for a few seconds:
//
//	go test -run XXX -fuzz '^FuzzCaddyfile$' -fuzztime 30s .

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
)

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
