// Package strictjsontest holds the independent readings that fuzz targets
// check the strict reader, and whatever reads bodies through it, against.
package strictjsontest

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/strictjson"
)

// FoldCollision reports whether any object in the valid JSON body has two
// keys equal under strings.EqualFold: the bodies the strict reader refuses.
func FoldCollision(t *testing.T, body []byte) bool {
	t.Helper()
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

// CheckKeyError checks that a refusal for a key names two keys that are
// equal under case folding.
func CheckKeyError(t *testing.T, err error) {
	t.Helper()
	if ke, ok := errors.AsType[*strictjson.KeyError](err); ok {
		if !strings.EqualFold(ke.Name, ke.Other) || !strings.HasSuffix(ke.Key, ke.Name) {
			t.Fatalf("key error %q names keys that do not collide", err)
		}
	}
}
