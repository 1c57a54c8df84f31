package strictjson_test

// Seeds live in testdata/fuzz/FuzzStrictJSON; CI runs the target for a few
// seconds:
//
//	go test -run XXX -fuzz '^FuzzStrictJSON$' -fuzztime 30s ./internal/strictjson

import (
	"bytes"
	"encoding/json"
	"errors"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/strictjson"
	"github.com/miles-rollout/miles-diffusion-router/internal/strictjson/strictjsontest"
)

func FuzzStrictJSON(f *testing.F) {
	f.Fuzz(func(t *testing.T, body []byte) {
		members, err := strictjson.Scan(body)
		strictjsontest.CheckKeyError(t, err)
		valid := json.Valid(body)
		_, isKeyError := errors.AsType[*strictjson.KeyError](err)
		switch {
		case err == nil && !valid:
			t.Fatal("accepted JSON that encoding/json finds invalid")
		case err == nil && strictjsontest.FoldCollision(t, body):
			t.Fatal("accepted a body with two keys equal under case folding")
		case err != nil && !isKeyError && valid:
			t.Fatalf("refused valid JSON: %v", err)
		case isKeyError && valid && !strictjsontest.FoldCollision(t, body):
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
