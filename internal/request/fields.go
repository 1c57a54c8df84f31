package request

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"mime"
	"mime/multipart"
	"slices"
	"strconv"
	"strings"

	"github.com/miles-rollout/miles-diffusion-router/internal/strictjson"
)

// Fields are a generation request's parameters by name, as its body gives
// them: JSON values (numbers as json.Number) or form strings. The objects
// a worker may merge over the top level (overrideNames) are kept apart,
// each as Fields of its own (or as the string or other value the body gave
// instead): whether one counts, and over what, is the endpoint's cost rule,
// as each sglang-diffusion endpoint merges its own.
type Fields map[string]any

// cleared is the value of a member an override object sets to null. It
// takes the field back to its default: the update puts None there, and
// sglang drops None values before SamplingParams fills in its own.
type cleared struct{}

// formMark is set in the Fields of a multipart form, which some workers
// read differently from JSON; no body field has the name.
const formMark = "(multipart form)"

// FieldError is a request field whose value a worker would refuse.
type FieldError struct {
	Field, Problem string
}

func (e *FieldError) Error() string { return e.Field + ": " + e.Problem }

// costFieldNames are the Fields the cost model reads, a rollout's seed and
// the OpenAI model field (which names a LoRA policy where adapters are
// declared); the rest of a body (the prompt, inline images) is left where
// it is.
var costFieldNames = [...]string{
	"size", "width", "height", "num_inference_steps", "n", "num_outputs_per_prompt",
	"num_frames", "fps", "seconds", "guidance_scale", "true_cfg_scale", "seed", "model",
}

// overrideNames are the objects some sglang endpoints merge over a
// request's top level: extra_body and extra_json (the OpenAI client's name
// for it) on /v1/videos, extra_sampling_params on /rollout/generate.
var overrideNames = [...]string{"extra_body", "extra_json", "extra_sampling_params"}

// bodyNames are the members of a JSON body the router reads: the cost
// fields, then the override objects.
var bodyNames = slices.Concat(costFieldNames[:], overrideNames[:])

// bodyValues holds the values of bodyNames in one body.
type bodyValues [len(costFieldNames) + len(overrideNames)]json.RawMessage

// maxFieldBytes bounds a plain form field the router keeps; extra_body,
// JSON text that must be read whole, is read whole.
const maxFieldBytes = 4 << 10

// ReadFields reads a generation's parameters from its body.
func ReadFields(body []byte, contentType string) (Fields, error) {
	if contentType == "application/json" { // most bodies: no need to parse it
		return jsonFields(body)
	}
	if mt, _, _ := mime.ParseMediaType(contentType); strings.HasPrefix(mt, "multipart/") {
		return formFields(body, contentType)
	}
	// The workers read every other body as JSON, whatever the client called
	// it (curl -d says x-www-form-urlencoded), so the router does too: a
	// body it let pass unread as msgpack would be costed by defaults and
	// checked by nobody.
	return jsonFields(body)
}

// jsonFields reads a JSON object body by exact key, as the workers do: its
// cost fields, and its override objects.
func jsonFields(body []byte) (Fields, error) {
	var values bodyValues
	if err := strictjson.Pick(body, bodyNames, values[:]); err != nil {
		return nil, err
	}
	f := costFields(values[:len(costFieldNames)], false)
	for i, name := range overrideNames {
		switch raw := values[len(costFieldNames)+i]; {
		case raw == nil || string(raw) == "null": // None: nothing to merge
		case raw[0] == '{':
			var object bodyValues
			_ = strictjson.Pick(raw, costFieldNames[:], object[:]) // checked with the body
			f[name] = costFields(object[:], true)
		default:
			f[name] = strictjson.Value(raw)
		}
	}
	return f, nil
}

// costFields are the cost fields of an object, whose members values gives
// in the order of costFieldNames (nil: absent). A null is no value at the
// top level (pydantic's None, the default); in an override object it is
// cleared, which undoes the top level's value.
func costFields(values []json.RawMessage, keepNulls bool) Fields {
	f := Fields{}
	for i, name := range costFieldNames {
		switch raw := values[i]; {
		case raw == nil:
		case string(raw) == "null":
			if keepNulls {
				f[name] = cleared{}
			}
		default:
			f[name] = strictjson.Value(raw)
		}
	}
	return f
}

// formFields reads the plain Fields of a multipart body; file parts are
// skipped, not copied.
func formFields(body []byte, contentType string) (Fields, error) {
	_, params, err := mime.ParseMediaType(contentType)
	if err != nil || params["boundary"] == "" {
		return nil, errors.New("multipart body without a boundary")
	}
	mr := multipart.NewReader(bytes.NewReader(body), params["boundary"])
	f := Fields{formMark: true}
	for {
		part, err := mr.NextPart()
		if err == io.EOF {
			return f, nil
		}
		if err != nil {
			return nil, fmt.Errorf("malformed multipart body: %v", err)
		}
		name, file, err := formPart(part)
		if err != nil {
			return nil, err
		}
		if file {
			continue
		}
		if _, dup := f[name]; dup && (slices.Contains(costFieldNames[:], name) || slices.Contains(overrideNames[:], name)) {
			return nil, &FieldError{name, "form field given twice; give it once"}
		}
		limit := int64(maxFieldBytes)
		if slices.Contains(overrideNames[:], name) {
			limit = math.MaxInt64 // JSON text, cut short it would not parse; max_body bounds it
		}
		value, err := io.ReadAll(io.LimitReader(part, limit))
		if err != nil {
			return nil, fmt.Errorf("malformed multipart body: %v", err)
		}
		f[name] = string(value)
	}
}

// formPart tells a file part (skipped) from a field and names the field.
// Multipart parsers differ on unusual Content-Disposition headers (escapes,
// RFC 2231 name*= and filename*=, a second header, one Go cannot parse):
// the worker's could read a field the router took for a file, or by another
// name. So a part must say form-data; name="..." plainly, as every client
// writes it.
func formPart(part *multipart.Part) (name string, file bool, err error) {
	cds := part.Header.Values("Content-Disposition")
	name = part.FormName()
	switch {
	case len(cds) != 1 || name == "":
		return "", false, errors.New(`malformed multipart body: each part needs one Content-Disposition: form-data; name="..."`)
	case strings.Contains(cds[0], "*="):
		return "", false, fmt.Errorf("malformed multipart body: part %q has an RFC 2231 parameter (name*= or filename*=), which parsers read differently", name)
	case part.FileName() != "":
		return name, true, nil
	case strings.ContainsAny(name, `"\`) || !strings.Contains(cds[0], `name="`+name+`"`):
		return "", false, fmt.Errorf(`malformed multipart body: form field %q is not named plainly, as name="..."`, name)
	}
	return name, false, nil
}

// Model is the request's OpenAI model field; "" when absent or not a
// string.
func (f Fields) Model() string {
	s, _ := f["model"].(string)
	return s
}

// isForm reports whether f was read from a multipart form.
func (f Fields) isForm() bool { return f[formMark] == true }

// over is f with o's members over its own, as Python's dict.update puts
// them.
func (f Fields) over(o Fields) Fields {
	if len(o) == 0 {
		return f
	}
	merged := maps.Clone(f)
	maps.Copy(merged, o)
	return merged
}

// object reads the override object name: Fields for an object, or for a
// string holding one in JSON (a form's extra_body; sglang's video API also
// reads a JSON string so); nil for anything else, which sglang's
// isinstance(extra, dict) passes over. A string that is not JSON is
// refused: the worker's json.loads fails it (400).
func (f Fields) object(name string) (Fields, error) {
	switch v := f[name].(type) {
	case Fields:
		return v, nil
	case string:
		var values bodyValues
		err := strictjson.Pick([]byte(v), costFieldNames[:], values[:])
		switch {
		case errors.Is(err, strictjson.ErrNotObject):
			return nil, nil
		case err != nil:
			return nil, &FieldError{name, "is not valid JSON: " + err.Error()}
		}
		return costFields(values[:len(costFieldNames)], true), nil
	}
	return nil, nil
}

// has reports whether name has a value: given, and not null.
func (f Fields) has(name string) bool {
	switch f[name].(type) {
	case nil, cleared:
		return false
	}
	return true
}

// number reads a numeric field as pydantic's lax float does: a JSON number,
// a string holding one (forms, and the OpenAI video API's "seconds": "4"),
// or a boolean (1 or 0). Missing or null gives def.
func (f Fields) number(name string, def float64) (float64, error) {
	var s string
	switch v := f[name].(type) {
	case nil, cleared:
		return def, nil
	case bool:
		if v {
			return 1, nil
		}
		return 0, nil
	case json.Number:
		s = v.String()
	case string:
		s = strings.TrimSpace(v)
	default:
		return 0, &FieldError{name, fmt.Sprintf("%v is not a number", v)}
	}
	n, err := strconv.ParseFloat(s, 64)
	if err != nil || math.IsNaN(n) || math.IsInf(n, 0) {
		return 0, &FieldError{name, fmt.Sprintf("%q is not a number", s)}
	}
	return n, nil
}

// integer reads a field pydantic reads as an int: a number without a
// fraction (2.0 is 2), given as number, numeric string or boolean. The
// value stays a float64, so that no count overflows before the cost
// bounds it.
func (f Fields) integer(name string, def float64) (float64, error) {
	n, err := f.number(name, def)
	if err == nil && n != math.Trunc(n) {
		err = &FieldError{name, fmt.Sprintf("must be a whole number, got %v", n)}
	}
	return n, err
}

// positiveInt reads a count the worker refuses below 1: SamplingParams'
// _validate refuses num_inference_steps, num_frames, fps and
// num_outputs_per_prompt that are not positive ints.
func (f Fields) positiveInt(name string, def float64) (float64, error) {
	n, err := f.integer(name, def)
	if err == nil && n <= 0 {
		err = &FieldError{name, fmt.Sprintf("must be positive, got %v", n)}
	}
	return n, err
}
