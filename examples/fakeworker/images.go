package fakeworker

import (
	"cmp"
	"crypto/rand"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Request defaults, as sglang's OpenAI-compatible API and typical models use.
const (
	defaultImageSize   = "1024x1024"
	defaultVideoSize   = "720x1280" // sglang's video API default
	defaultSteps       = 20         // model defaults range from 20 to 50
	defaultFPS         = 24
	defaultSeconds     = 4
	defaultSeed        = 1024
	maxImagesPerPrompt = 10
)

// genParams are the request fields that decide a job's cost, shared by the
// generation endpoints. The guidance scales only get their types checked:
// Cost ignores classifier-free guidance.
type genParams struct {
	Size              *string  `json:"size"`
	Width             *int     `json:"width"`
	Height            *int     `json:"height"`
	NumInferenceSteps *int     `json:"num_inference_steps"`
	NumFrames         *int     `json:"num_frames"`
	GuidanceScale     *float64 `json:"guidance_scale"`
	TrueCFGScale      *float64 `json:"true_cfg_scale"`
	Seed              *int     `json:"seed"`
}

// shape is the work a generation request asks for.
type shape struct {
	width, height, steps, frames, outputs int
}

func (s shape) cost() float64 {
	return Cost(s.width, s.height, s.steps, s.frames, s.outputs)
}

// shape resolves the request's size, explicit width and height winning over
// "size", with defaultSize when neither is given.
func (p genParams) shape(defaultSize string, frames, outputs int) (shape, error) {
	width, height, err := parseSize(valueOr(p.Size, ""), defaultSize)
	if err != nil {
		return shape{}, err
	}
	s := shape{
		width:   valueOr(p.Width, width),
		height:  valueOr(p.Height, height),
		steps:   valueOr(p.NumInferenceSteps, defaultSteps),
		frames:  frames,
		outputs: outputs,
	}
	if s.width <= 0 || s.height <= 0 || s.steps <= 0 || s.frames <= 0 {
		return shape{}, badRequest("width, height, num_inference_steps and num_frames must be positive, got %dx%d, %d steps, %d frames",
			s.width, s.height, s.steps, s.frames)
	}
	return s, nil
}

func parseSize(size, defaultSize string) (width, height int, err error) {
	w, h, ok := strings.Cut(strings.ToLower(cmp.Or(size, defaultSize)), "x")
	width, errW := strconv.Atoi(w)
	height, errH := strconv.Atoi(h)
	if !ok || errW != nil || errH != nil {
		return 0, 0, badRequest("invalid size %q: expected WIDTHxHEIGHT, e.g. 1024x1024", size)
	}
	return width, height, nil
}

// frames is the frame count of an RL request: 1 on image models, which
// ignore num_frames, and a 4-second 24 fps clip by default on video models.
func (w *Worker) frames(numFrames *int) int {
	if !w.isVideoTask() {
		return 1
	}
	return valueOr(numFrames, defaultFPS*defaultSeconds)
}

// defaultSize is the output size of a request that names none.
func (w *Worker) defaultSize() string {
	if w.isVideoTask() {
		return defaultVideoSize
	}
	return defaultImageSize
}

func valueOr[T any](p *T, def T) T {
	if p == nil {
		return def
	}
	return *p
}

// outputsPerPrompt clamps a requested output count as sglang does.
func outputsPerPrompt(n *int, limit int) int {
	return max(1, min(valueOr(n, 1), limit))
}

// newID returns a random request or job id.
func newID() string { return strings.ToLower(rand.Text()) }

// requireImageModel refuses image requests on a video model.
func (w *Worker) requireImageModel(rw http.ResponseWriter) bool {
	if w.isVideoTask() {
		w.fail(rw, badRequest("model %s has task type %s and cannot generate images; use /v1/videos",
			w.cfg.ModelPath, w.cfg.TaskType))
		return false
	}
	return true
}

// promptField is the prompt every generation request requires.
type promptField struct {
	Prompt *string `json:"prompt"`
}

func (p promptField) hasPrompt() bool { return p.Prompt != nil }

// decodePrompted decodes a JSON generation request, whose schema requires a
// prompt, and reports problems as FastAPI does.
func decodePrompted(r *http.Request, req interface{ hasPrompt() bool }) error {
	if err := decodeJSON(r, req); err != nil {
		return err
	}
	if !req.hasPrompt() {
		return invalid(missing("body", "prompt"))
	}
	return nil
}

// imageGenerationRequest is sglang's ImageGenerationsRequest, as far as the
// fake needs.
type imageGenerationRequest struct {
	promptField
	N              *int   `json:"n"`
	ResponseFormat string `json:"response_format"`
	genParams
}

func (w *Worker) handleImageGenerations(rw http.ResponseWriter, r *http.Request) {
	if !w.requireImageModel(rw) {
		return
	}
	var req imageGenerationRequest
	if err := decodePrompted(r, &req); err != nil {
		w.fail(rw, err)
		return
	}
	s, err := req.shape(defaultImageSize, 1, outputsPerPrompt(req.N, maxImagesPerPrompt))
	if err != nil {
		w.fail(rw, err)
		return
	}
	w.serveImages(rw, r, s, *req.Prompt, req.ResponseFormat)
}

// handleImageEdits takes sglang's multipart form: image or image[] files (or
// url / url[] values), prompt, size, n, num_inference_steps, num_frames,
// guidance_scale, true_cfg_scale, seed and response_format.
func (w *Worker) handleImageEdits(rw http.ResponseWriter, r *http.Request) {
	if !w.requireImageModel(rw) {
		return
	}
	f, err := readForm(r)
	if err != nil {
		w.fail(rw, err)
		return
	}
	prompt := f.str("prompt")
	p := genParams{
		Size:              f.str("size"),
		NumInferenceSteps: f.int("num_inference_steps"),
		GuidanceScale:     f.float("guidance_scale"),
		TrueCFGScale:      f.float("true_cfg_scale"),
		Seed:              f.int("seed"),
	}
	n, frames := f.int("n"), f.int("num_frames")
	if prompt == nil {
		f.errs = append(f.errs, missing("body", "prompt"))
	}
	if err := f.err(); err != nil {
		w.fail(rw, err)
		return
	}
	if !f.hasFile("image", "image[]") && f.str("url") == nil && f.str("url[]") == nil {
		w.fail(rw, &httpError{http.StatusUnprocessableEntity, "Field 'image' or 'url' is required"})
		return
	}
	s, err := p.shape(defaultImageSize, valueOr(frames, 1), outputsPerPrompt(n, maxImagesPerPrompt))
	if err != nil {
		w.fail(rw, err)
		return
	}
	w.serveImages(rw, r, s, *prompt, valueOr(f.str("response_format"), ""))
}

// serveImages runs an image job and answers in the OpenAI images shape. Like
// sglang it checks response_format only once the images exist, so a request
// with a bad format still costs a job.
func (w *Worker) serveImages(rw http.ResponseWriter, r *http.Request, s shape, prompt, format string) {
	res, err := w.runJob(r.Context(), s.cost(), nil)
	if err != nil {
		w.fail(rw, err)
		return
	}
	switch format = strings.ToLower(cmp.Or(format, "b64_json")); format {
	case "b64_json":
	case "url":
		w.fail(rw, badRequest("response_format='url' requires cloud storage to be configured."))
		return
	default:
		w.fail(rw, badRequest("response_format=%s is not supported", format))
		return
	}
	data := make([]map[string]any, s.outputs)
	for i := range data {
		data[i] = map[string]any{"b64_json": w.mediaToken, "revised_prompt": prompt}
	}
	w.writeMedia(rw, res.version, map[string]any{
		"id":               newID(),
		"created":          time.Now().Unix(),
		"data":             data,
		"inference_time_s": res.elapsed.Seconds(),
		"weight_version":   res.version,
	})
}
