// Package request reads what a client asks of the router: which endpoint a
// request goes to and what the router does with it (the endpoint table),
// what its body says, read as the workers read it, and what its job will
// cost a worker.
package request

import (
	"cmp"
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"strconv"
	"strings"
	"unicode"
)

// A job's cost is measured in units of one 1024×1024 image denoised for one
// step: pixels/1024² × steps × frames × outputs × (cfg_factor when
// classifier-free guidance is on). Jobs in one rollout span two to three
// orders of magnitude of it, which is why routing counts cost, not requests.
//
// The cost is of the job the worker will run, so each endpoint's rule reads
// the fields its sglang-diffusion endpoint reads, merged in the order it
// merges them, with its clamps and defaults, and refuses the values the
// worker refuses, no others (docs/routing.md has the table), save two bounds
// of the router's own: sizes over Model.MaxPixels and costs over maxJobCost. The sources
// are sglang's python/sglang/multimodal_gen: runtime/entrypoints/openai/
// image_api.py, video_api.py, protocol.py and utils.py (build_sampling_params,
// _parse_size), runtime/entrypoints/diffusion_api.py,
// runtime/entrypoints/post_training/rollout_api.py and io_struct.py, and
// configs/sample/sampling_params.py (SamplingParams._validate and _adjust).

// Model holds a pool's defaults for what a request leaves out.
type Model struct {
	Steps         int     // num_inference_steps
	Width, Height int     // size
	Frames        int     // frames of a video
	CFGFactor     float64 // work multiplier when guidance is on
	MaxPixels     float64 // most width × height a job may ask for; 0: no bound
}

// Defaults of the cost model options.
const (
	DefaultSteps     = 20
	DefaultSize      = "1024x1024"
	DefaultFrames    = 96 // sglang's 24 fps × 4 s
	DefaultCFGFactor = 2
	// DefaultMaxPixels is 4096×4096. sglang-diffusion refuses no size
	// that is positive (save a pipeline's own list of resolutions, where
	// it has one): a size far beyond what its models make (FLUX about 2
	// megapixels, Qwen-Image 1328×1328, Wan 1280×720) holds a GPU for
	// minutes before it runs out of memory. This bound is the router's.
	DefaultMaxPixels = 4096 * 4096

	// maxJobCost is beyond any job a GPU runs (a 1024x1024 image step takes
	// a tenth of a second or more: this is months), so that a prediction is
	// always a finite, positive time; minJobCost keeps a 1x1 job from
	// costing nothing.
	maxJobCost = 1e8
	minJobCost = 1e-6

	// maxOutputs is the most outputs the OpenAI-style APIs make of one
	// request: they clamp n to 1..10.
	maxOutputs = 10
)

// A CostRule prices a job from its fields, in cost units; each generation
// endpoint of the table has one.
type CostRule func(m Model, f Fields) (float64, error)

// reading is how one worker endpoint turns fields into work.
type reading struct {
	widthHeight bool // width and height are read, each over size's
	frames      func(Model, Fields) (float64, error)
	outputs     func(Fields) (float64, error)
}

var (
	// image_api.py generations: size, width, height; num_frames=1 whatever
	// the body says; n clamped.
	imageReading = reading{widthHeight: true, frames: oneFrame, outputs: clampedN}
	// image_api.py edits: a form without width and height.
	editReading = reading{frames: editFrames, outputs: clampedN}
	// video_api.py _build_video_sampling_params.
	videoReading = reading{widthHeight: true, frames: videoFrames, outputs: videoOutputs}
	// diffusion_api.py generate and rollout_api.py: num_outputs_per_prompt
	// unclamped.
	rlReading = reading{widthHeight: true, frames: rlFrames, outputs: outputsPerPrompt}
)

// imageCost prices /v1/images/generations (and its stream), which reads
// the top level only: extra_body is one more unknown key to its
// ImageGenerationsRequest, unread.
func imageCost(m Model, f Fields) (float64, error) {
	return m.price(f, imageReading)
}

// imageEditCost prices /v1/images/edits.
func imageEditCost(m Model, f Fields) (float64, error) {
	return m.price(f, editReading)
}

// diffusionCost prices /v1/diffusion/generate, whose
// DiffusionGenerateRequest has no n and merges nothing.
func diffusionCost(m Model, f Fields) (float64, error) {
	return m.price(f, rlReading)
}

// videoCost prices a video from the fields create_video builds its
// request of.
func videoCost(m Model, f Fields) (float64, error) {
	f, err := videoFields(f)
	if err != nil {
		return 0, err
	}
	r := videoReading
	if f.isForm() {
		// create_video passes a form's fields one by one, and width and
		// height are not among them.
		r.widthHeight = false
	}
	return m.price(f, r)
}

// rolloutCost prices a rollout from the fields it runs with, and requires
// its seed.
func rolloutCost(m Model, f Fields) (float64, error) {
	g, err := rolloutFields(f)
	if err != nil {
		return 0, err
	}
	c, err := m.price(g, rlReading)
	if err == nil {
		err = f.rolloutSeed()
	}
	if err != nil {
		return 0, err
	}
	return c, nil
}

// price is pixels/1024² × steps × frames × outputs × the guidance factor,
// each read as r says.
func (m Model) price(f Fields, r reading) (float64, error) {
	w, h, err := m.size(f, r.widthHeight)
	if err != nil {
		return 0, err
	}
	steps, err := f.positiveInt("num_inference_steps", float64(m.Steps))
	if err != nil {
		return 0, err
	}
	frames, err := r.frames(m, f)
	if err != nil {
		return 0, err
	}
	outputs, err := r.outputs(f)
	if err != nil {
		return 0, err
	}
	cfg, err := m.guidance(f)
	if err != nil {
		return 0, err
	}
	c := w * h / (1024 * 1024) * steps * frames * outputs * cfg
	if !(c <= maxJobCost) { // +Inf too
		return 0, &FieldError{"size, num_inference_steps, num_frames and n", fmt.Sprintf(
			"together ask for %.3g cost units, more than any GPU could run (the limit is %g, a 1024x1024 image step being 1)", c, float64(maxJobCost))}
	}
	return max(c, minJobCost), nil
}

// videoFields are the fields video_api.py's create_video runs a job with.
// A JSON body: the top level, extra_body's members over it, then
// extra_json's (the OpenAI client's name for extra_body), as its
// payload.update calls merge them. A form: its own fields, and extra_body's
// for those it lacks, but never n, whose form default is 1; a seconds of 0
// is 4 there ("or 4").
func videoFields(f Fields) (Fields, error) {
	if !f.isForm() {
		for _, name := range [...]string{"extra_body", "extra_json"} {
			o, err := f.object(name)
			if err != nil {
				return nil, err
			}
			f = f.over(o)
		}
		return f, nil
	}
	var extra Fields
	if f["extra_body"] != "" { // create_video's "if extra_body:"
		var err error
		if extra, err = f.object("extra_body"); err != nil {
			return nil, err
		}
	}
	f = maps.Clone(f)
	for name, v := range extra {
		if name != "n" && !f.has(name) {
			f[name] = v
		}
	}
	if s, err := f.integer("seconds", 4); err == nil && s == 0 {
		delete(f, "seconds")
	}
	return f, nil
}

// rolloutFields are the fields a rollout runs with: RolloutRequest's own,
// with extra_sampling_params over them, as rollout_api.py's
// _build_sampling_kwargs merges them (sampling_kwargs.update); a null
// there undoes the field, as the None values it then drops do.
// RolloutRequest has no size, so only extra_sampling_params can give one.
func rolloutFields(f Fields) (Fields, error) {
	params, err := f.samplingParams()
	if err != nil {
		return nil, err
	}
	if f.has("size") {
		f = maps.Clone(f)
		delete(f, "size")
	}
	return f.over(params), nil
}

// samplingParams reads extra_sampling_params. RolloutRequest types it
// dict[str, Any], so its values reach SamplingParams unconverted, where
// pydantic would have made "8" or 8.0 an int: _validate then refuses a
// count that is not a Python int (a bool is one) and a guidance scale that
// is not a number, with 400 "Invalid sampling params"; and
// build_sampling_params passes over a size that is not a string.
func (f Fields) samplingParams() (Fields, error) {
	v, given := f["extra_sampling_params"]
	if !given {
		return nil, nil
	}
	params, ok := v.(Fields)
	if !ok {
		return nil, &FieldError{"extra_sampling_params", "must be a JSON object"}
	}
	out := Fields{}
	for name, v := range params {
		if _, isString := v.(string); name == "size" && !isString {
			continue
		}
		if err := rawValue(name, v); err != nil {
			return nil, err
		}
		out[name] = v
	}
	return out, nil
}

// rawValue checks a value of extra_sampling_params as
// SamplingParams._validate checks it: counts must be ints, guidance scales
// numbers.
func rawValue(name string, v any) error {
	n, isNumber := v.(json.Number)
	_, isBool := v.(bool)
	_, isCleared := v.(cleared)
	switch name {
	case "num_inference_steps", "num_outputs_per_prompt", "num_frames", "fps":
		if !isCleared && !isBool && (!isNumber || strings.ContainsAny(string(n), ".eE")) {
			return &FieldError{"extra_sampling_params." + name, fmt.Sprintf(
				"must be a JSON integer, got %v; sglang-diffusion takes these values as they are, and refuses a count that is not an int", v)}
		}
	case "guidance_scale", "true_cfg_scale":
		if !isCleared && !isNumber {
			return &FieldError{"extra_sampling_params." + name, fmt.Sprintf(
				"must be a JSON number, got %v; sglang-diffusion takes these values as they are, and refuses a scale that is not a number", v)}
		}
	}
	return nil
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

// size is the width and height a job runs at: size's, when it parses, else
// the model's, and with widthHeight each of width and height over them, as
// build_sampling_params fills a dimension from size only when the request
// leaves it out. A size must be a string (pydantic's str); one that does
// not parse is ignored, as _parse_size ignores it. Nothing refuses a width
// of 0 before the worker runs the job, but no worker can make it.
func (m Model) size(f Fields, widthHeight bool) (w, h float64, err error) {
	w, h = float64(m.Width), float64(m.Height)
	wFrom, hFrom := "size", "size"
	if f.has("size") {
		s, isString := f["size"].(string)
		if !isString {
			return 0, 0, &FieldError{"size", fmt.Sprintf("%v is not a string like \"1024x1024\"", f["size"])}
		}
		if sw, sh, ok := workerSize(s); ok {
			w, h = sw, sh
		}
	}
	if widthHeight && f.has("width") {
		if w, err = f.integer("width", 0); err != nil {
			return 0, 0, err
		}
		wFrom = "width"
	}
	if widthHeight && f.has("height") {
		if h, err = f.integer("height", 0); err != nil {
			return 0, 0, err
		}
		hFrom = "height"
	}
	switch {
	case w <= 0:
		return 0, 0, &FieldError{wFrom, fmt.Sprintf("must be positive, got a width of %v", w)}
	case h <= 0:
		return 0, 0, &FieldError{hFrom, fmt.Sprintf("must be positive, got a height of %v", h)}
	case m.MaxPixels > 0 && w*h > m.MaxPixels:
		return 0, 0, &FieldError{sizeFields(wFrom, hFrom), fmt.Sprintf(
			"%.0fx%.0f is %.4g pixels, more than the %.0f this router takes (max_pixels)", w, h, w*h, m.MaxPixels)}
	}
	return w, h, nil
}

// sizeFields names the fields a size was read from.
func sizeFields(wFrom, hFrom string) string {
	if wFrom == hFrom {
		return wFrom
	}
	return wFrom + " and " + hFrom
}

// workerSize reads "WIDTHxHEIGHT" as sglang's _parse_size does: lower
// case, spaces removed, split at "x" into exactly two Python ints.
func workerSize(s string) (w, h float64, ok bool) {
	width, height, ok := strings.Cut(strings.ReplaceAll(strings.ToLower(s), " ", ""), "x")
	if !ok || strings.Contains(height, "x") {
		return 0, 0, false
	}
	w, okW := pythonInt(width)
	h, okH := pythonInt(height)
	return w, h, okW && okH
}

// pythonInt reads a string as Python's int() does (ASCII digits): space
// around it, a sign, and single underscores between digits allowed. The
// value is a float64, infinite beyond its range, which the cost bound
// then refuses.
func pythonInt(s string) (float64, bool) {
	s = strings.TrimFunc(s, unicode.IsSpace)
	digits := strings.TrimLeft(s, "+-")
	sign := s[:len(s)-len(digits)]
	if len(sign) > 1 {
		return 0, false
	}
	// An empty group is a leading, trailing or doubled underscore.
	for group := range strings.SplitSeq(digits, "_") {
		if group == "" || strings.ContainsFunc(group, func(r rune) bool { return r < '0' || r > '9' }) {
			return 0, false
		}
	}
	n, _ := strconv.ParseFloat(sign+strings.ReplaceAll(digits, "_", ""), 64) // digits only: at worst out of range, ±Inf
	return n, true
}

// oneFrame is the frames of /v1/images/generations, which passes
// num_frames=1 whatever the request says.
func oneFrame(Model, Fields) (float64, error) { return 1, nil }

// editFrames is the frames of an edit: the form's num_frames must be a
// positive int (SamplingParams refuses others), then the image models that
// serve edits make one (SamplingParams._adjust).
func editFrames(_ Model, f Fields) (float64, error) {
	_, err := f.positiveInt("num_frames", 1)
	return 1, err
}

// rlFrames is num_frames, else one. fps only sets the saved file's rate,
// but SamplingParams refuses one below 1.
func rlFrames(_ Model, f Fields) (float64, error) {
	if _, err := f.positiveInt("fps", 24); err != nil {
		return 0, err
	}
	return f.positiveInt("num_frames", 1)
}

// videoFrames is num_frames, else fps × seconds (24 and 4 by default), as
// _build_video_sampling_params counts them; the model's default when the
// request gives none of them.
func videoFrames(m Model, f Fields) (float64, error) {
	fps, err := f.positiveInt("fps", 24)
	if err != nil {
		return 0, err
	}
	seconds, err := f.integer("seconds", 4)
	switch {
	case err != nil:
		return 0, err
	case f.has("num_frames"):
		return f.positiveInt("num_frames", 0)
	case !f.has("fps") && !f.has("seconds"):
		return float64(m.Frames), nil
	case seconds <= 0:
		return 0, &FieldError{"seconds", fmt.Sprintf("must be positive, got %v: fps × seconds is the frame count, and sglang-diffusion refuses fewer than 1", seconds)}
	}
	return fps * seconds, nil
}

// clampedN is the images API's output count, max(1, min(n or 1, 10)): n is
// clamped, never refused for its size.
func clampedN(f Fields) (float64, error) {
	n, err := f.integer("n", 1)
	return min(max(cmp.Or(n, 1), 1), maxOutputs), err
}

// videoOutputs is the video API's output count: num_outputs_per_prompt,
// else n or 1, clamped to 1..10.
func videoOutputs(f Fields) (float64, error) {
	n, err := f.integer("n", 1)
	if err != nil {
		return 0, err
	}
	outputs, err := f.integer("num_outputs_per_prompt", cmp.Or(n, 1))
	return min(max(outputs, 1), maxOutputs), err
}

// outputsPerPrompt is the RL APIs' output count, num_outputs_per_prompt,
// which they pass on unclamped.
func outputsPerPrompt(f Fields) (float64, error) {
	return f.positiveInt("num_outputs_per_prompt", 1)
}

// guidance is the work multiplier of classifier-free guidance, which runs
// the model twice per step when a guidance scale above 1 asks for it.
// SamplingParams._validate refuses a negative scale.
func (m Model) guidance(f Fields) (float64, error) {
	factor := 1.0
	for _, name := range [...]string{"true_cfg_scale", "guidance_scale"} {
		scale, err := f.number(name, 0)
		if err != nil {
			return 0, err
		}
		if scale < 0 {
			return 0, &FieldError{name, fmt.Sprintf("must not be negative, got %v", scale)}
		}
		if scale > 1 {
			factor = m.CFGFactor
		}
	}
	return factor, nil
}

// ParseSize reads a configured default size, "1024x768" (also with X or *).
func ParseSize(s string) (int, int, error) {
	ws, hs, ok := strings.Cut(sizeSeparators.Replace(strings.TrimSpace(s)), "x")
	if !ok {
		return 0, 0, fmt.Errorf("%q has no x", s)
	}
	w, err1 := strconv.Atoi(strings.TrimSpace(ws))
	h, err2 := strconv.Atoi(strings.TrimSpace(hs))
	if err1 != nil || err2 != nil || w <= 0 || h <= 0 {
		return 0, 0, fmt.Errorf("%q is not two positive numbers", s)
	}
	return w, h, nil
}

// sizeSeparators turns the other ways of writing "1024x768" into that one.
var sizeSeparators = strings.NewReplacer("X", "x", "*", "x")
