package diffusionrouter

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Client bodies are read as the workers read them. The workers are Python
// (FastAPI, pydantic, json.loads): JSON keys are case-sensitive, and of a
// repeated key the last value counts. Go's encoding/json matches struct
// fields case-insensitively, even under Unicode folding ("ſize" is "size"
// to it). A body that gives "model_path" twice, or "model_path" and
// "Model_Path", could thus mean one thing to the router, which checks and
// costs it, and another to the worker, which acts on it. Such bodies are
// refused, at every depth; the others are read by exact key, never through
// struct tags.

var (
	errInvalidJSON = errors.New("Invalid JSON body")
	errNotObject   = errors.New("request body must be a JSON object")
)

// maxJSONDepth is encoding/json's own nesting limit; the scan keeps its
// own stack, so a deep body costs no Go stack, only this much memory.
const maxJSONDepth = 10000

var errTooDeep = fmt.Errorf("JSON body is nested deeper than %d levels", maxJSONDepth)

// keyError is a key the router refuses: a repeated key, or one that
// differs from an earlier key of its object only in case.
type keyError struct {
	key   string // where, as "extra_body.num_frames" or "loras[2].scale"
	other string // the earlier key as written; equal to key's own name for a repeat
	name  string // the key's own name
}

func (e *keyError) Error() string {
	if e.other == e.name {
		return fmt.Sprintf("JSON key %q appears twice; give each key once", e.key)
	}
	return fmt.Sprintf("JSON key %q differs from %q only in case; keys are case-sensitive, give each once", e.key, e.other)
}

// jsonFrame is an open object or array of the scan.
type jsonFrame struct {
	seen  map[string]string // an object's keys so far, folded → as written; nil in an array
	key   string            // the member this frame is the value of, in an object
	index int               // the element this frame is, in an array; -1 in an object
	next  int               // an array's next element
}

// strictObject reads body as one JSON object that names no key twice, not
// even in different case, at any depth. It returns the object's members by
// exact key, as slices of body.
func strictObject(body []byte) (map[string]json.RawMessage, error) {
	members, err := scanJSON(body)
	if err == nil && members == nil {
		err = errNotObject
	}
	return members, err
}

// scanJSON checks that body is one JSON value that names no key twice, not
// even in different case, in any object. When the value is an object it
// returns its members by exact key, as slices of body; otherwise nil.
func scanJSON(body []byte) (map[string]json.RawMessage, error) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber() // any number is valid JSON, however large
	tok, err := dec.Token()
	if err != nil {
		return nil, errInvalidJSON
	}
	var members map[string]json.RawMessage
	switch tok {
	case json.Delim('{'):
		members = map[string]json.RawMessage{}
		err = scanContainer(dec, body, jsonFrame{seen: map[string]string{}, index: -1}, members)
	case json.Delim('['):
		err = scanContainer(dec, body, jsonFrame{index: -1}, nil)
	}
	if err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errInvalidJSON // more after the value
	}
	return members, nil
}

// scanContainer walks the object or array just opened, checking the keys
// of every object in it. The members of the outermost object go to
// members (when it is not nil).
func scanContainer(dec *json.Decoder, body []byte, root jsonFrame, members map[string]json.RawMessage) error {
	stack := []jsonFrame{root}
	var start int64 // where the current member of the outermost object begins
	for len(stack) > 0 {
		top := &stack[len(stack)-1]
		if !dec.More() {
			if _, err := dec.Token(); err != nil { // the closing delimiter
				return errInvalidJSON
			}
			stack = stack[:len(stack)-1]
			if len(stack) == 1 && members != nil {
				members[stack[0].key] = memberValue(body, start, dec.InputOffset())
			}
			continue
		}
		child := jsonFrame{index: -1}
		if top.seen != nil {
			key, err := objectKey(dec, stack)
			if err != nil {
				return err
			}
			child.key = key
			if len(stack) == 1 {
				top.key, start = key, dec.InputOffset()
			}
		} else {
			child.index = top.next
			top.next++
		}
		tok, err := dec.Token()
		if err != nil {
			return errInvalidJSON
		}
		switch tok {
		case json.Delim('{'):
			child.seen = map[string]string{}
		case json.Delim('['):
		default: // a scalar
			if len(stack) == 1 && members != nil {
				members[top.key] = memberValue(body, start, dec.InputOffset())
			}
			continue
		}
		if len(stack) >= maxJSONDepth {
			return errTooDeep
		}
		stack = append(stack, child)
	}
	return nil
}

// objectKey reads the next key of the object on top of stack and refuses
// it if the object had it already, in any case.
func objectKey(dec *json.Decoder, stack []jsonFrame) (string, error) {
	tok, err := dec.Token()
	key, ok := tok.(string)
	if err != nil || !ok {
		return "", errInvalidJSON
	}
	seen := stack[len(stack)-1].seen
	folded := foldKey(key)
	if other, dup := seen[folded]; dup {
		return "", &keyError{key: keyPath(stack, key), other: other, name: key}
	}
	seen[folded] = key
	return key, nil
}

// memberValue is the value of a member, body[start:end] being what follows
// its key: the colon, the value and any white space.
func memberValue(body []byte, start, end int64) json.RawMessage {
	v := bytes.TrimLeft(body[start:end], " \t\r\n")
	return bytes.TrimLeft(v[1:], " \t\r\n") // past the colon
}

// keyPath names key for a message, with the objects and arrays it is in.
func keyPath(stack []jsonFrame, key string) string {
	var b strings.Builder
	for _, f := range stack[1:] {
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

// jsonMember decodes the member name of an object read by strictObject:
// nil when absent or null, numbers as json.Number.
func jsonMember(members map[string]json.RawMessage, name string) any {
	raw, ok := members[name]
	if !ok {
		return nil
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var v any
	_ = dec.Decode(&v) // raw was checked whole; it decodes
	return v
}
