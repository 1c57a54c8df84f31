package jobkinds

import (
	"encoding/json"
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
