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
	if err := checkSyntax(body); err != nil {
		return nil, err
	}
	s := keyScan{body: body}
	s.space()
	if s.body[s.i] != '{' {
		return nil, s.value()
	}
	members := map[string]json.RawMessage{}
	return members, s.object(members, nil)
}

// Pick reads body as Object does, and puts the members named in names
// in picked, in their order: nil where body has none. Unlike Object, it
// keeps nothing else of the body and allocates nothing for its keys, nor
// for picked, which the caller gives, as long as names.
func Pick(body []byte, names []string, picked []json.RawMessage) error {
	if err := checkSyntax(body); err != nil {
		return err
	}
	clear(picked)
	s := keyScan{body: body}
	s.space()
	if s.body[s.i] != '{' {
		if err := s.value(); err != nil {
			return err
		}
		return ErrNotObject
	}
	return s.object(nil, &picks{names, picked[:len(names)]})
}

// picks are the members of an object that Pick keeps: those named in
// names go to values, by their index in names. They are no part of
// keyScan so that the compiler can keep the caller's values on its stack.
type picks struct {
	names  []string
	values []json.RawMessage
}

// keep puts value in values when key is one of names.
func (p *picks) keep(key []byte, value json.RawMessage) {
	for i, name := range p.names {
		if name == string(key) {
			p.values[i] = value
		}
	}
}

// checkSyntax checks that body is one well-formed JSON value, with
// encoding/json, before the walk over its keys.
func checkSyntax(body []byte) error {
	if json.Valid(body) {
		return nil
	}
	if nestedBeyond(body, MaxDepth) {
		return ErrTooDeep
	}
	return ErrInvalid
}

// keyScan walks well-formed JSON, checking the keys of every object.
type keyScan struct {
	body []byte
	i    int
	path []jsonFrame // the objects and arrays the walk is in, for messages
}

// jsonFrame is where in its parent an object or array is: a member's key,
// or an element's index (key nil and index >= 0).
type jsonFrame struct {
	key   []byte
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
		return s.object(nil, nil)
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

// object walks the object at s.i; its members go to members, and those
// named in p to p, when they are not nil.
func (s *keyScan) object(members map[string]json.RawMessage, p *picks) error {
	s.i++ // {
	var seen keySet
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
		if other, dup := seen.add(key); dup {
			return &KeyError{Key: keyPath(s.path, key), Other: other, Name: string(key)}
		}
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
			members[string(key)] = s.body[start:s.i]
		}
		if p != nil {
			p.keep(key, s.body[start:s.i])
		}
	}
}

// key reads the key at s.i: a slice of the body, unless it has escapes
// or invalid UTF-8 to decode.
func (s *keyScan) key() []byte {
	start := s.i
	escaped := s.skipString()
	if raw := s.body[start+1 : s.i-1]; !escaped && utf8.Valid(raw) {
		return raw
	}
	var key string
	_ = json.Unmarshal(s.body[start:s.i], &key) // well formed: it decodes, as encoding/json reads it
	return []byte(key)
}

// fewKeys is how many keys an object may have before keySet folds them
// into a map: request bodies have a dozen at most.
const fewKeys = 16

// keySet is the keys of one object read so far, to find a key given
// twice, in any case. The first few are compared one by one, with no
// copy nor allocation; beyond them, folded into a map.
type keySet struct {
	few  [fewKeys][]byte
	n    int
	many map[string]string // folded key -> key as written
}

// add adds key, unless the set has it already in some case: then it
// returns that key as written.
func (ks *keySet) add(key []byte) (other string, dup bool) {
	if ks.many == nil {
		for _, k := range ks.few[:ks.n] {
			if bytes.EqualFold(k, key) {
				return string(k), true
			}
		}
		if ks.n < fewKeys {
			ks.few[ks.n] = key
			ks.n++
			return "", false
		}
		ks.many = make(map[string]string)
		for _, k := range ks.few {
			ks.many[foldKey(string(k))] = string(k)
		}
	}
	folded := foldKey(string(key))
	if other, dup := ks.many[folded]; dup {
		return other, true
	}
	ks.many[folded] = string(key)
	return "", false
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
func keyPath(path []jsonFrame, key []byte) string {
	var b strings.Builder
	for _, f := range path {
		if f.index >= 0 {
			b.WriteString("[" + strconv.Itoa(f.index) + "]")
			continue
		}
		if b.Len() > 0 {
			b.WriteByte('.')
		}
		b.Write(f.key)
	}
	if b.Len() > 0 {
		b.WriteByte('.')
	}
	b.Write(key)
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
	return Value(raw)
}

// Value decodes raw, a member read by Object or Pick: nil when null,
// numbers as json.Number.
func Value(raw json.RawMessage) any {
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
