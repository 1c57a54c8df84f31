package diffusionrouter

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
	"time"
)

// A job's cost is measured in units of one 1024×1024 image denoised for one
// step: pixels/1024² × steps × frames × outputs × (cfg_factor when
// classifier-free guidance is on). Jobs in one rollout span two to three
// orders of magnitude of it, which is why routing counts cost, not requests.

// costModel holds a pool's defaults for what a request leaves out.
type costModel struct {
	steps         int     // num_inference_steps
	width, height int     // size
	frames        int     // frames of a video
	cfgFactor     float64 // work multiplier when guidance is on
}

// Defaults of the cost model options.
const (
	defaultSteps     = 20
	defaultSize      = "1024x1024"
	defaultFrames    = 96 // sglang's 24 fps × 4 s
	defaultCFGFactor = 2
	maxFieldBytes    = 4 << 10 // a form field the cost model reads

	// maxJobCost is beyond any job a GPU runs (a 1024x1024 image step takes
	// a tenth of a second or more: this is months), so that a prediction is
	// always a finite, positive time; minJobCost keeps a 1x1 job from
	// costing nothing.
	maxJobCost = 1e8
	minJobCost = 1e-6
)

// fieldError is a request field whose value cannot be right.
type fieldError struct {
	field, problem string
}

func (e *fieldError) Error() string { return e.field + ": " + e.problem }

// fields are a generation request's parameters by name: JSON values
// (numbers decoded as json.Number) or form strings.
type fields map[string]any

// cost is what the request costs, for the endpoint at path.
func (m costModel) cost(path string, f fields) (float64, error) {
	w, h, err := m.size(f)
	if err != nil {
		return 0, err
	}
	steps, err := f.positiveInt("num_inference_steps", m.steps)
	if err != nil {
		return 0, err
	}
	frames, err := m.frameCount(path, f)
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
		return 0, &fieldError{"size, num_inference_steps, num_frames and n", fmt.Sprintf(
			"together ask for %.3g cost units, more than any GPU could run (the limit is %g, a 1024x1024 image step being 1)", c, float64(maxJobCost))}
	}
	if path == "/rollout/generate" {
		if err := f.rolloutSeed(); err != nil {
			return 0, err
		}
	}
	return max(c, minJobCost), nil
}

// rolloutSeed checks that a rollout names its seed. sglang-diffusion's
// rollout request may leave it out but its answer requires it: a worker
// runs such a job to the end, then fails it (500), which would count
// against a worker that did nothing wrong.
func (f fields) rolloutSeed() error {
	seed, err := f.number("seed", math.NaN())
	switch {
	case err != nil:
		return err
	case math.IsNaN(seed):
		return &fieldError{"seed", "is required: sglang-diffusion's rollout answer names the seed of its samples"}
	case seed != math.Trunc(seed):
		return &fieldError{"seed", fmt.Sprintf("must be a whole number, got %v", seed)}
	}
	return nil
}

// size reads width and height, which override size ("WxH").
func (m costModel) size(f fields) (int, int, error) {
	w, h := m.width, m.height
	if s, ok := f["size"]; ok && s != nil {
		str, _ := s.(string)
		var err error
		if w, h, err = parseSize(str); err != nil {
			return 0, 0, &fieldError{"size", fmt.Sprintf("%q is not WIDTHxHEIGHT with positive numbers", fmt.Sprint(s))}
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

// parseSize reads "1024x768" (also with X or *).
func parseSize(s string) (int, int, error) {
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

// frameCount is num_frames, else fps × seconds, for videos; images have one.
func (m costModel) frameCount(path string, f fields) (int, error) {
	if path != "/v1/videos" {
		return f.positiveInt("num_frames", 1)
	}
	if _, ok := f["num_frames"]; ok {
		return f.positiveInt("num_frames", m.frames)
	}
	_, hasFPS := f["fps"]
	_, hasSeconds := f["seconds"]
	if !hasFPS && !hasSeconds {
		return m.frames, nil
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
		return 0, &fieldError{"fps", fmt.Sprintf("fps × seconds is %g frames; too many", frames)}
	}
	return max(1, int(frames)), nil
}

// guidance is the work multiplier of classifier-free guidance, which runs
// the model twice per step when a guidance scale above 1 asks for it.
func (m costModel) guidance(f fields) (float64, error) {
	for _, name := range []string{"true_cfg_scale", "guidance_scale"} {
		scale, err := f.number(name, 0)
		if err != nil {
			return 0, err
		}
		if scale < 0 {
			return 0, &fieldError{name, "must not be negative"}
		}
		if scale > 1 {
			return m.cfgFactor, nil
		}
	}
	return 1, nil
}

// number reads a numeric field, given as a JSON number or a numeric string
// (forms, and the OpenAI video API's "seconds": "4"). Missing or null gives def.
func (f fields) number(name string, def float64) (float64, error) {
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
		return 0, &fieldError{name, fmt.Sprintf("%v is not a number", v)}
	}
	n, err := strconv.ParseFloat(s, 64)
	if err != nil || math.IsNaN(n) || math.IsInf(n, 0) {
		return 0, &fieldError{name, fmt.Sprintf("%q is not a number", s)}
	}
	return n, nil
}

func (f fields) positiveNumber(name string, def float64) (float64, error) {
	n, err := f.number(name, def)
	if err == nil && n <= 0 {
		err = &fieldError{name, fmt.Sprintf("must be positive, got %v", n)}
	}
	return n, err
}

func (f fields) positiveInt(name string, def int) (int, error) {
	n, err := f.positiveNumber(name, float64(def))
	if err != nil {
		return 0, err
	}
	if n != math.Trunc(n) || n > math.MaxInt32 {
		return 0, &fieldError{name, fmt.Sprintf("must be a whole number, got %v", n)}
	}
	return int(n), nil
}

// jsonFields reads a JSON object body, by exact key as the workers do. The
// OpenAI video API's extra_body object adds fields, as sglang merges it.
func jsonFields(body []byte) (fields, error) {
	members, err := strictObject(body)
	if err != nil {
		return nil, err
	}
	f := fields{}
	addCostFields(f, members)
	if raw, ok := members["extra_body"]; ok && string(raw) != "null" {
		extra, err := strictObject(raw)
		if err != nil {
			return nil, &fieldError{"extra_body", "must be a JSON object"}
		}
		addCostFields(f, extra)
	}
	return f, nil
}

// costFieldNames are the fields the cost model reads, and a rollout's seed;
// the rest of a body (the prompt, inline images) is left where it is.
var costFieldNames = [...]string{
	"size", "width", "height", "num_inference_steps", "n", "num_outputs_per_prompt",
	"num_frames", "fps", "seconds", "guidance_scale", "true_cfg_scale", "seed",
}

// addCostFields adds the cost fields members has to f, leaving those f has
// alone; a null is no value.
func addCostFields(f fields, members map[string]json.RawMessage) {
	for _, name := range costFieldNames {
		if _, set := f[name]; set {
			continue
		}
		if v := jsonMember(members, name); v != nil {
			f[name] = v
		}
	}
}

// formFields reads the plain fields of a multipart body; file parts are
// skipped, not copied.
func formFields(body []byte, contentType string) (fields, error) {
	_, params, err := mime.ParseMediaType(contentType)
	if err != nil || params["boundary"] == "" {
		return nil, errors.New("multipart body without a boundary")
	}
	mr := multipart.NewReader(bytes.NewReader(body), params["boundary"])
	f := fields{}
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
			return nil, &fieldError{name, "form field given twice; give it once"}
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

// speedWindow is how many recent jobs a worker's speed is the median of: a
// stalled job or two moves the median hardly at all.
const speedWindow = 31

// A learned speed stays within these bounds, in cost units per second: far
// beyond any GPU (a 1024x1024 image step takes a GPU tens of milliseconds
// at the least) and far below one that works at all.
const (
	minSpeed = 1e-4
	maxSpeed = 1e6
)

// speedEstimate learns how fast a worker turns cost into time, in cost
// units per second, from the jobs it completes.
type speedEstimate struct {
	value   float64 // median of the samples; 0 until the first
	relErr  float64 // moving average of |predicted - actual| / actual
	errSeen bool
	n       int // samples taken, up to speedWindow
	next    int
	samples *[speedWindow]float64 // apart, to keep a worker's hot fields small
}

// observe learns from a job of cost that ran for elapsed, having been
// predicted to take predicted.
func (s *speedEstimate) observe(cost float64, elapsed, predicted time.Duration) {
	if cost <= 0 || elapsed <= 0 {
		return
	}
	if predicted > 0 {
		e := math.Abs(float64(predicted-elapsed)) / float64(elapsed)
		if s.errSeen {
			s.relErr += (e - s.relErr) / 8
		} else {
			s.relErr, s.errSeen = e, true
		}
	}
	if s.samples == nil {
		s.samples = new([speedWindow]float64)
	}
	s.samples[s.next] = min(max(cost/elapsed.Seconds(), minSpeed), maxSpeed)
	s.next = (s.next + 1) % speedWindow
	s.n = min(s.n+1, speedWindow)
	var sorted [speedWindow]float64
	copy(sorted[:], s.samples[:s.n])
	slices.Sort(sorted[:s.n])
	s.value = sorted[s.n/2]
}
