// Package strictjson reads client JSON bodies as the workers read them:
// by exact key, refusing any key given twice, in any case, at any depth.
package strictjson

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Bodies are read as the workers read them. The workers are Python
// (FastAPI, pydantic, json.loads): JSON keys are case-sensitive, and of a
// repeated key the last value counts. Go's encoding/json matches struct
// fields case-insensitively, even under Unicode folding ("ſize" is "size"
// to it). A body that gives "model_path" twice, or "model_path" and
// "Model_Path", could thus mean one thing to the router, which checks and
// costs it, and another to the worker, which acts on it. Such bodies are
// refused, at every depth; the others are read by exact key, never through
// struct tags.

// The body errors; ErrInvalid's text is the Python router's.
var (
	// ErrInvalid is a body that is not JSON.
	ErrInvalid = errors.New("Invalid JSON body")
	// ErrNotObject is JSON that is not an object where one must be.
	ErrNotObject = errors.New("request body must be a JSON object")
)

// MaxDepth is encoding/json's own nesting limit; the scan keeps its
// own stack, so a deep body costs no Go stack, only this much memory.
const MaxDepth = 10000

// ErrTooDeep is a body nested beyond MaxDepth.
var ErrTooDeep = fmt.Errorf("JSON body is nested deeper than %d levels", MaxDepth)

// KeyError is a key the router refuses: a repeated key, or one that
// differs from an earlier key of its object only in case.
type KeyError struct {
	Key   string // where, as "extra_body.num_frames" or "loras[2].scale"
	Other string // the earlier key as written; equal to Name for a repeat
	Name  string // the key's own name
}

func (e *KeyError) Error() string {
	if e.Other == e.Name {
		return fmt.Sprintf("JSON key %q appears twice; give each key once", e.Key)
	}
	return fmt.Sprintf("JSON key %q differs from %q only in case; keys are case-sensitive, give each once", e.Key, e.Other)
}

// Object reads body as one JSON object that names no key twice, not
// even in different case, at any depth. It returns the object's members by
// exact key, as slices of body.
func Object(body []byte) (map[string]json.RawMessage, error) {
	members, err := Scan(body)
	if err == nil && members == nil {
		err = ErrNotObject
	}
	return members, err
}

// Scan checks that body is one JSON value that names no key twice, not
// even in different case, in any object. When the value is an object it
// returns its members by exact key, as slices of body; otherwise nil.
// encoding/json checks the syntax first, so the walk over the keys that
// follows can take the body to be well formed: it runs on every
// generation, and allocates only for the keys it keeps.
func Scan(body []byte) (map[string]json.RawMessage, error) {
	if !json.Valid(body) {
		if nestedBeyond(body, MaxDepth) {
			return nil, ErrTooDeep
		}
		return nil, ErrInvalid
	}
	s := keyScan{body: body}
	s.space()
	if s.body[s.i] != '{' {
		return nil, s.value()
	}
	members := map[string]json.RawMessage{}
	return members, s.object(members)
}

// keyScan walks well-formed JSON, checking the keys of every object.
type keyScan struct {
	body []byte
	i    int
	path []jsonFrame // the objects and arrays the walk is in, for messages
}

// jsonFrame is where in its parent an object or array is: a member's key,
// or an element's index (key "" and index >= 0).
type jsonFrame struct {
	key   string
	index int
}

func (s *keyScan) space() {
	for s.i < len(s.body) && (s.body[s.i] == ' ' || s.body[s.i] == '\t' || s.body[s.i] == '\r' || s.body[s.i] == '\n') {
		s.i++
	}
}

// value walks the value at s.i.
func (s *keyScan) value() error {
	s.space()
	switch s.body[s.i] {
	case '{':
		return s.object(nil)
	case '[':
		return s.array()
	case '"':
		s.skipString()
	default: // a number, true, false or null
		for s.i < len(s.body) && !strings.ContainsRune(",}] \t\r\n", rune(s.body[s.i])) {
			s.i++
		}
	}
	return nil
}

// skipString moves past the string at s.i.
func (s *keyScan) skipString() (hasEscape bool) {
	s.i++ // the opening quote
	for s.body[s.i] != '"' {
		if s.body[s.i] == '\\' {
			hasEscape = true
			s.i++
		}
		s.i++
	}
	s.i++
	return hasEscape
}

// object walks the object at s.i; its members go to members when that is
// not nil.
func (s *keyScan) object(members map[string]json.RawMessage) error {
	s.i++                       // {
	seen := map[string]string{} // folded key -> key as written
	for {
		s.space()
		switch s.body[s.i] {
		case '}':
			s.i++
			return nil
		case ',':
			s.i++
			s.space()
		}
		key := s.key()
		folded := foldKey(key)
		if other, dup := seen[folded]; dup {
			return &KeyError{Key: keyPath(s.path, key), Other: other, Name: key}
		}
		seen[folded] = key
		s.space()
		s.i++ // :
		s.space()
		start := s.i
		s.path = append(s.path, jsonFrame{key: key, index: -1})
		if err := s.value(); err != nil {
			return err
		}
		s.path = s.path[:len(s.path)-1]
		if members != nil {
			members[key] = s.body[start:s.i]
		}
	}
}

// key reads the key at s.i.
func (s *keyScan) key() string {
	start := s.i
	escaped := s.skipString()
	if raw := s.body[start+1 : s.i-1]; !escaped && utf8.Valid(raw) {
		return string(raw)
	}
	var key string
	_ = json.Unmarshal(s.body[start:s.i], &key) // well formed: it decodes, as encoding/json reads it
	return key
}

// array walks the array at s.i.
func (s *keyScan) array() error {
	s.i++ // [
	for index := 0; ; index++ {
		s.space()
		switch s.body[s.i] {
		case ']':
			s.i++
			return nil
		case ',':
			s.i++
		}
		s.path = append(s.path, jsonFrame{index: index})
		if err := s.value(); err != nil {
			return err
		}
		s.path = s.path[:len(s.path)-1]
	}
}

// nestedBeyond reports whether body opens more than depth objects and
// arrays inside one another, outside strings.
func nestedBeyond(body []byte, depth int) bool {
	open, inString := 0, false
	for i := 0; i < len(body); i++ {
		switch c := body[i]; {
		case inString && c == '\\':
			i++
		case c == '"':
			inString = !inString
		case inString:
		case c == '{' || c == '[':
			if open++; open > depth {
				return true
			}
		case c == '}' || c == ']':
			open--
		}
	}
	return false
}

// keyPath names key for a message, with the objects and arrays it is in.
func keyPath(path []jsonFrame, key string) string {
	var b strings.Builder
	for _, f := range path {
		if f.index >= 0 {
			b.WriteString("[" + strconv.Itoa(f.index) + "]")
			continue
		}
		if b.Len() > 0 {
			b.WriteByte('.')
		}
		b.WriteString(f.key)
	}
	if b.Len() > 0 {
		b.WriteByte('.')
	}
	b.WriteString(key)
	return b.String()
}

// foldKey maps key to one representative of its case-folding class: two
// keys fold alike exactly when strings.EqualFold holds for them. Most keys
// are lower-case ASCII and come back unchanged, without an allocation.
func foldKey(key string) string {
	return strings.Map(foldRune, key)
}

// foldRune is the lower-case ASCII letter of r's folding orbit if it has
// one, else the orbit's smallest rune. So "K", "k" and the Kelvin sign "K"
// all fold to "k", and "S", "s" and the long "ſ" to "s".
func foldRune(r rune) rune {
	if r < utf8.RuneSelf {
		if 'A' <= r && r <= 'Z' {
			r += 'a' - 'A'
		}
		return r
	}
	least := r
	for f := unicode.SimpleFold(r); f != r; f = unicode.SimpleFold(f) {
		least = min(least, f)
	}
	if 'A' <= least && least <= 'Z' {
		least += 'a' - 'A'
	}
	return least
}

// Member decodes the member name of an object read by Object:
// nil when absent or null, numbers as json.Number.
func Member(members map[string]json.RawMessage, name string) any {
	raw, ok := members[name]
	if !ok {
		return nil
	}
	// The scalars the router reads most, read without a decoder: raw is
	// one well-formed JSON value.
	switch c := raw[0]; {
	case string(raw) == "null":
		return nil
	case string(raw) == "true", string(raw) == "false":
		return string(raw) == "true"
	case c == '-' || '0' <= c && c <= '9':
		return json.Number(raw)
	case c == '"' && !bytes.ContainsRune(raw, '\\') && utf8.Valid(raw):
		return string(raw[1 : len(raw)-1])
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var v any
	_ = dec.Decode(&v) // raw was checked whole; it decodes
	return v
}
