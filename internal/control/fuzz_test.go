package control

import (
	"bytes"
	"encoding/json"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/fleet"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/strictjson/strictjsontest"
)

// Fuzz targets for the bodies of control calls. Each checks a property
// against an independent reading (encoding/json's maps, which are
// exact-case), not just the absence of a panic. Seeds live in
// testdata/fuzz/<Name>/; CI runs each for a few seconds.

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
	a := &API{Weights: &fleet.Config{Mode: scheduler.ModeDrain, PathPrefixes: fuzzPrefixes}}
	f.Fuzz(func(t *testing.T, body []byte) {
		req, status, msg := a.readWeightsRequest(httptest.NewRequest("POST", "/update_weights_from_disk", bytes.NewReader(body)))
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
		case strings.ContainsRune(mp, 0) || slices.Contains(strings.FieldsFunc(mp, func(r rune) bool { return r == '/' || r == '\\' }), ".."):
			t.Fatalf("accepted model_path %q", mp)
		case !underFuzzPrefixes(mp):
			t.Fatalf("accepted model_path %q, outside %v", mp, fuzzPrefixes)
		case len(req.Version) > 512 || strings.ContainsFunc(req.Version, func(c rune) bool { return c < 0x20 || c > 0x7e }):
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
