// Package request reads what a client asks of the router: which endpoint a
// request goes to and what the router does with it (the endpoint table),
// what its body says, read as the workers read it, and what its job will
// cost a worker.
package request

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"mime"
	"mime/multipart"
	"slices"
	"strconv"
	"strings"

	"github.com/miles-rollout/miles-diffusion-router/internal/strictjson"
)

// A job's cost is measured in units of one 1024×1024 image denoised for one
// step: pixels/1024² × steps × frames × outputs × (cfg_factor when
// classifier-free guidance is on). Jobs in one rollout span two to three
// orders of magnitude of it, which is why routing counts cost, not requests.

// Model holds a pool's defaults for what a request leaves out.
type Model struct {
	Steps         int     // num_inference_steps
	Width, Height int     // size
	Frames        int     // frames of a video
	CFGFactor     float64 // work multiplier when guidance is on
}

// Defaults of the cost model options.
const (
	DefaultSteps     = 20
	DefaultSize      = "1024x1024"
	DefaultFrames    = 96 // sglang's 24 fps × 4 s
	DefaultCFGFactor = 2
	maxFieldBytes    = 4 << 10 // a form field the cost model reads

	// maxJobCost is beyond any job a GPU runs (a 1024x1024 image step takes
	// a tenth of a second or more: this is months), so that a prediction is
	// always a finite, positive time; minJobCost keeps a 1x1 job from
	// costing nothing.
	maxJobCost = 1e8
	minJobCost = 1e-6
)

// FieldError is a request field whose value cannot be right.
type FieldError struct {
	Field, Problem string
}

func (e *FieldError) Error() string { return e.Field + ": " + e.Problem }

// Fields are a generation request's parameters by name: JSON values
// (numbers decoded as json.Number) or form strings.
type Fields map[string]any

// A CostRule prices a job from its fields, in cost units; each generation
// endpoint of the table has one.
type CostRule func(m Model, f Fields) (float64, error)

// imageCost prices images, and the outputs of RL generations: one frame
// each unless num_frames says otherwise.
func imageCost(m Model, f Fields) (float64, error) {
	return m.price(f, imageFrames)
}

// videoCost prices a video: its frames are num_frames, else fps × seconds,
// else the model's default.
func videoCost(m Model, f Fields) (float64, error) {
	return m.price(f, videoFrames)
}

// rolloutCost prices a rollout as images, and requires its seed.
func rolloutCost(m Model, f Fields) (float64, error) {
	c, err := imageCost(m, f)
	if err == nil {
		err = f.rolloutSeed()
	}
	if err != nil {
		return 0, err
	}
	return c, nil
}

// price is pixels/1024² × steps × frames × outputs × the guidance factor,
// with the frames counted by the endpoint's rule.
func (m Model) price(f Fields, frameCount func(Model, Fields) (int, error)) (float64, error) {
	w, h, err := m.size(f)
	if err != nil {
		return 0, err
	}
	steps, err := f.positiveInt("num_inference_steps", m.Steps)
	if err != nil {
		return 0, err
	}
	frames, err := frameCount(m, f)
	if err != nil {
		return 0, err
	}
	outputs, err := f.positiveInt("n", 1)
	if err != nil {
		return 0, err
	}
	if outputs, err = f.positiveInt("num_outputs_per_prompt", outputs); err != nil {
		return 0, err
	}
	cfg, err := m.guidance(f)
	if err != nil {
		return 0, err
	}
	c := float64(w) * float64(h) / (1024 * 1024) * float64(steps) * float64(frames) * float64(outputs) * cfg
	if c > maxJobCost {
		return 0, &FieldError{"size, num_inference_steps, num_frames and n", fmt.Sprintf(
			"together ask for %.3g cost units, more than any GPU could run (the limit is %g, a 1024x1024 image step being 1)", c, float64(maxJobCost))}
	}
	return max(c, minJobCost), nil
}

// rolloutSeed checks that a rollout names its seed. sglang-diffusion's
// rollout request may leave it out but its answer requires it: a worker
// runs such a job to the end, then fails it (500), which would count
// against a worker that did nothing wrong.
func (f Fields) rolloutSeed() error {
	seed, err := f.number("seed", math.NaN())
	switch {
	case err != nil:
		return err
	case math.IsNaN(seed):
		return &FieldError{"seed", "is required: sglang-diffusion's rollout answer names the seed of its samples"}
	case seed != math.Trunc(seed):
		return &FieldError{"seed", fmt.Sprintf("must be a whole number, got %v", seed)}
	}
	return nil
}

// size reads width and height, which override size ("WxH").
func (m Model) size(f Fields) (int, int, error) {
	w, h := m.Width, m.Height
	if s, ok := f["size"]; ok && s != nil {
		str, _ := s.(string)
		var err error
		if w, h, err = ParseSize(str); err != nil {
			return 0, 0, &FieldError{"size", fmt.Sprintf("%q is not WIDTHxHEIGHT with positive numbers", fmt.Sprint(s))}
		}
	}
	w, err := f.positiveInt("width", w)
	if err != nil {
		return 0, 0, err
	}
	h, err = f.positiveInt("height", h)
	return w, h, err
}

// sizeSeparators turns the other ways of writing "1024x768" into that one.
var sizeSeparators = strings.NewReplacer("X", "x", "*", "x")

// ParseSize reads "1024x768" (also with X or *).
func ParseSize(s string) (int, int, error) {
	ws, hs, ok := strings.Cut(sizeSeparators.Replace(strings.TrimSpace(s)), "x")
	if !ok {
		return 0, 0, errors.New("no x")
	}
	w, err1 := strconv.Atoi(strings.TrimSpace(ws))
	h, err2 := strconv.Atoi(strings.TrimSpace(hs))
	if err1 != nil || err2 != nil || w <= 0 || h <= 0 {
		return 0, 0, errors.New("not positive numbers")
	}
	return w, h, nil
}

// imageFrames is num_frames, else one.
func imageFrames(_ Model, f Fields) (int, error) {
	return f.positiveInt("num_frames", 1)
}

// videoFrames is num_frames, else fps × seconds, else the model's default.
func videoFrames(m Model, f Fields) (int, error) {
	if _, ok := f["num_frames"]; ok {
		return f.positiveInt("num_frames", m.Frames)
	}
	_, hasFPS := f["fps"]
	_, hasSeconds := f["seconds"]
	if !hasFPS && !hasSeconds {
		return m.Frames, nil
	}
	fps, err := f.positiveNumber("fps", 24)
	if err != nil {
		return 0, err
	}
	seconds, err := f.positiveNumber("seconds", 4)
	if err != nil {
		return 0, err
	}
	frames := math.Round(fps * seconds)
	if frames > math.MaxInt32 { // int() of more is undefined: the cost could come out tiny
		return 0, &FieldError{"fps", fmt.Sprintf("fps × seconds is %g frames; too many", frames)}
	}
	return max(1, int(frames)), nil
}

// guidance is the work multiplier of classifier-free guidance, which runs
// the model twice per step when a guidance scale above 1 asks for it.
func (m Model) guidance(f Fields) (float64, error) {
	for _, name := range []string{"true_cfg_scale", "guidance_scale"} {
		scale, err := f.number(name, 0)
		if err != nil {
			return 0, err
		}
		if scale < 0 {
			return 0, &FieldError{name, "must not be negative"}
		}
		if scale > 1 {
			return m.CFGFactor, nil
		}
	}
	return 1, nil
}

// number reads a numeric field, given as a JSON number or a numeric string
// (forms, and the OpenAI video API's "seconds": "4"). Missing or null gives def.
func (f Fields) number(name string, def float64) (float64, error) {
	v, ok := f[name]
	if !ok || v == nil {
		return def, nil
	}
	var s string
	switch v := v.(type) {
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

func (f Fields) positiveNumber(name string, def float64) (float64, error) {
	n, err := f.number(name, def)
	if err == nil && n <= 0 {
		err = &FieldError{name, fmt.Sprintf("must be positive, got %v", n)}
	}
	return n, err
}

func (f Fields) positiveInt(name string, def int) (int, error) {
	n, err := f.positiveNumber(name, float64(def))
	if err != nil {
		return 0, err
	}
	if n != math.Trunc(n) || n > math.MaxInt32 {
		return 0, &FieldError{name, fmt.Sprintf("must be a whole number, got %v", n)}
	}
	return int(n), nil
}

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

// jsonFields reads a JSON object body, by exact key as the workers do. The
// OpenAI video API's extra_body object adds Fields, as sglang merges it.
func jsonFields(body []byte) (Fields, error) {
	members, err := strictjson.Object(body)
	if err != nil {
		return nil, err
	}
	f := Fields{}
	addCostFields(f, members)
	if raw, ok := members["extra_body"]; ok && string(raw) != "null" {
		extra, err := strictjson.Object(raw)
		if err != nil {
			return nil, &FieldError{"extra_body", "must be a JSON object"}
		}
		addCostFields(f, extra)
	}
	return f, nil
}

// costFieldNames are the Fields the cost model reads, and a rollout's seed;
// the rest of a body (the prompt, inline images) is left where it is.
var costFieldNames = [...]string{
	"size", "width", "height", "num_inference_steps", "n", "num_outputs_per_prompt",
	"num_frames", "fps", "seconds", "guidance_scale", "true_cfg_scale", "seed",
}

// addCostFields adds the cost Fields members has to f, leaving those f has
// alone; a null is no value.
func addCostFields(f Fields, members map[string]json.RawMessage) {
	for _, name := range costFieldNames {
		if _, set := f[name]; set {
			continue
		}
		if v := strictjson.Member(members, name); v != nil {
			f[name] = v
		}
	}
}

// formFields reads the plain Fields of a multipart body; file parts are
// skipped, not copied.
func formFields(body []byte, contentType string) (Fields, error) {
	_, params, err := mime.ParseMediaType(contentType)
	if err != nil || params["boundary"] == "" {
		return nil, errors.New("multipart body without a boundary")
	}
	mr := multipart.NewReader(bytes.NewReader(body), params["boundary"])
	f := Fields{}
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
		if _, dup := f[name]; dup && slices.Contains(costFieldNames[:], name) {
			return nil, &FieldError{name, "form field given twice; give it once"}
		}
		value, err := io.ReadAll(io.LimitReader(part, maxFieldBytes))
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
