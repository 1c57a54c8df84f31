package fakeworker

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"path/filepath"
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
	maxImagesPerPrompt = 10
	// defaultSessionTTL is how long a streamed job's session lives unless
	// realtime_session_ttl_seconds says otherwise.
	defaultSessionTTL = 3600
	// maxStoredImages bounds the images the worker remembers for
	// /v1/images/{id}; the oldest are forgotten first.
	maxStoredImages = 100_000
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
// "size", with defaultSize when neither is given. Like sglang's _parse_size
// it ignores a size that does not parse.
func (p genParams) shape(defaultSize string, frames, outputs int) (shape, error) {
	width, height, ok := parseSize(valueOr(p.Size, ""))
	if !ok {
		width, height, _ = parseSize(defaultSize)
	}
	s := shape{
		width:   valueOr(p.Width, width),
		height:  valueOr(p.Height, height),
		steps:   valueOr(p.NumInferenceSteps, defaultSteps),
		frames:  frames,
		outputs: outputs,
	}
	if s.width <= 0 || s.height <= 0 || s.steps <= 0 || s.frames <= 0 {
		return shape{}, fmt.Errorf("width, height, num_inference_steps and num_frames must be positive, got %dx%d, %d steps, %d frames",
			s.width, s.height, s.steps, s.frames)
	}
	return s, nil
}

// parseSize reads "WIDTHxHEIGHT".
func parseSize(size string) (width, height int, ok bool) {
	w, h, ok := strings.Cut(strings.ReplaceAll(strings.ToLower(size), " ", ""), "x")
	width, errW := strconv.Atoi(w)
	height, errH := strconv.Atoi(h)
	return width, height, ok && errW == nil && errH == nil
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

// outputsPerPrompt clamps a requested output count as sglang does:
// max(1, min(n or 1, limit)).
func outputsPerPrompt(n *int, limit int) int {
	return max(1, min(cmp.Or(valueOr(n, 1), 1), limit))
}

// newID returns a random request or job id.
func newID() string { return strings.ToLower(rand.Text()) }

// newUUID returns a random id as sglang's generate_request_id makes them:
// str(uuid.uuid4()).
func newUUID() string {
	var b [16]byte
	rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40 // version 4
	b[8] = b[8]&0x3f | 0x80 // RFC 4122 variant
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
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
	N                  *int             `json:"n"`
	ResponseFormat     optional[string] `json:"response_format"` // default "url"
	OutputFormat       *string          `json:"output_format"`
	Background         *string          `json:"background"`
	Stream             *bool            `json:"stream"`
	SessionTTL         *int             `json:"realtime_session_ttl_seconds"`
	CancelOnDisconnect *bool            `json:"cancel_on_disconnect"`
	genParams
}

// responseFormat resolves response_format as image_api.py does:
// (request.response_format or "b64_json").lower(), with the request's
// default "url" when the field is absent.
func (req imageGenerationRequest) responseFormat() string {
	v, _ := req.ResponseFormat.or("url")
	return strings.ToLower(cmp.Or(v, "b64_json"))
}

// imageExt is the extension of the images a request makes, as
// choose_output_image_ext decides it.
func imageExt(outputFormat, background *string) string {
	switch f := strings.ToLower(valueOr(outputFormat, "")); f {
	case "png", "webp", "jpg":
		return f
	case "jpeg":
		return "jpg"
	}
	if strings.ToLower(valueOr(background, "auto")) == "transparent" {
		return "png"
	}
	return "jpg"
}

// imageFiles names the files a job of n outputs saves.
func imageFiles(id, ext string, n int) []string {
	if n == 1 {
		return []string{id + "." + ext}
	}
	files := make([]string, n)
	for i := range files {
		files[i] = fmt.Sprintf("%s_%d.%s", id, i, ext)
	}
	return files
}

// upload is the URL a file gets in cloud storage, or "" without storage.
func (w *Worker) upload(file string) string {
	if w.cfg.CloudStorage == "" {
		return ""
	}
	return w.cfg.CloudStorage + "/" + file
}

// imageEntry is what the worker remembers of a generated image job, as
// sglang's IMAGE_STORE and (for streamed jobs) REALTIME_STORE do.
type imageEntry struct {
	ext    string
	url    string // the cloud URL; then the local file is gone
	ready  bool   // the images exist (IMAGE_STORE has the job)
	stream *streamState
}

// streamState is a streamed job's session.
type streamState struct {
	status string // queued, completed, failed, cancelled or cancelling
	cancel context.CancelCauseFunc
}

func (s *streamState) terminal() bool {
	switch s.status {
	case "completed", "failed", "cancelled":
		return true
	}
	return false
}

// imageStore holds the image jobs, forgetting the oldest beyond
// maxStoredImages. Guarded by Worker.mu.
type imageStore struct {
	entries map[string]*imageEntry
	order   []string // ids, oldest first; may hold ids already deleted
}

func (s *imageStore) put(id string, e *imageEntry) {
	if _, ok := s.entries[id]; !ok {
		s.order = append(s.order, id)
	}
	s.entries[id] = e
	for len(s.entries) > maxStoredImages || len(s.order) > 2*maxStoredImages {
		delete(s.entries, s.order[0])
		s.order = s.order[1:]
	}
}

// storeImages records a finished job's images.
func (w *Worker) storeImages(id, ext, url string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	e := w.images.entries[id]
	if e == nil {
		e = &imageEntry{}
	}
	e.ext, e.url, e.ready = ext, url, true
	w.images.put(id, e)
}

// imageResponse is sglang's ImageResponse, its fields in the order pydantic
// writes them: the id first, ahead of megabytes of base64.
type imageResponse struct {
	ID             string              `json:"id"`
	Created        int64               `json:"created"`
	Data           []imageResponseData `json:"data"`
	PeakMemoryMB   *float64            `json:"peak_memory_mb"`
	InferenceTimeS float64             `json:"inference_time_s"`
}

// imageResponseData is sglang's ImageResponseData: one image, as base64 or
// as a URL.
type imageResponseData struct {
	B64JSON       *string `json:"b64_json"`
	URL           *string `json:"url"`
	RevisedPrompt string  `json:"revised_prompt"`
	FilePath      string  `json:"file_path"`
}

// imageResponse builds sglang's ImageResponse for a finished job, or the
// HTTPException image_api.py raises for its response_format.
// fallbackURL is what a "url" answer names without cloud storage ("" for
// none).
func (w *Worker) imageResponse(id, prompt, format string, files []string, cloudURL, fallbackURL string, took time.Duration) (*imageResponse, error) {
	var data []imageResponseData
	switch format {
	case "b64_json":
		for _, f := range files {
			data = append(data, imageResponseData{B64JSON: &w.mediaToken, RevisedPrompt: prompt, FilePath: filepath.Join(outputDir, f)})
		}
	case "url":
		url := cmp.Or(cloudURL, fallbackURL)
		if url == "" {
			return nil, badRequest("response_format='url' requires cloud storage to be configured.")
		}
		data = []imageResponseData{{URL: &url, RevisedPrompt: prompt, FilePath: filepath.Join(outputDir, files[0])}}
	default:
		return nil, badRequest("response_format=%s is not supported", format)
	}
	return &imageResponse{ID: id, Created: time.Now().Unix(), Data: data, InferenceTimeS: took.Seconds()}, nil
}

// imageJob is an image request ready to run.
type imageJob struct {
	shape
	prompt, format, ext string
	fallback            bool // a "url" answer may name /v1/images/{id}/content
}

// serveImages runs an image job and answers in the OpenAI images shape.
// Like sglang it checks response_format only once the images exist (and
// are stored), so a request with a format it cannot serve still costs a
// job.
func (w *Worker) serveImages(rw http.ResponseWriter, r *http.Request, job imageJob) {
	run, err := w.runJob(r.Context(), job.shape, nil)
	if err != nil {
		w.failGeneration(rw, err)
		return
	}
	run.tell(rw)
	id := newUUID()
	files := imageFiles(id, job.ext, job.outputs)
	cloudURL := w.upload(files[0])
	w.storeImages(id, job.ext, cloudURL)
	fallback := ""
	if job.fallback {
		fallback = "/v1/images/" + id + "/content"
	}
	body, err := w.imageResponse(id, job.prompt, job.format, files, cloudURL, fallback, run.took)
	if err != nil {
		w.fail(rw, err)
		return
	}
	w.writeMedia(rw, w.media(job.ext).b64, body)
}

// imageGenerationJob reads a /v1/images/generations request; a non-nil
// error has been answered.
func (w *Worker) imageGenerationJob(rw http.ResponseWriter, r *http.Request) (imageGenerationRequest, imageJob, bool) {
	var req imageGenerationRequest
	if err := decodePrompted(r, &req); err != nil {
		w.fail(rw, err)
		return req, imageJob{}, false
	}
	s, err := req.shape(defaultImageSize, 1, outputsPerPrompt(req.N, maxImagesPerPrompt))
	if err != nil {
		internalServerError(rw) // build_sampling_params raises, unhandled
		return req, imageJob{}, false
	}
	return req, imageJob{shape: s, prompt: *req.Prompt, format: req.responseFormat(), ext: imageExt(req.OutputFormat, req.Background)}, true
}

func (w *Worker) handleImageGenerations(rw http.ResponseWriter, r *http.Request) {
	req, job, ok := w.imageGenerationJob(rw, r)
	if !ok {
		return
	}
	if valueOr(req.Stream, false) {
		w.fail(rw, badRequest("Use /v1/images/generations/stream for realtime streaming responses."))
		return
	}
	w.serveImages(rw, r, job)
}

// handleImageEdits takes sglang's multipart form: image or image[] files (or
// url / url[] values), prompt, size, n, num_inference_steps, num_frames,
// guidance_scale, true_cfg_scale, seed, output_format, background and
// response_format (default b64_json; "url" without cloud storage names
// /v1/images/{id}/content).
func (w *Worker) handleImageEdits(rw http.ResponseWriter, r *http.Request) {
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
		internalServerError(rw)
		return
	}
	w.serveImages(rw, r, imageJob{
		shape:    s,
		prompt:   *prompt,
		format:   strings.ToLower(cmp.Or(valueOr(f.str("response_format"), ""), "b64_json")),
		ext:      imageExt(f.str("output_format"), f.str("background")),
		fallback: true,
	})
}

// streamEvent is one server-sent event of a streamed job, as sglang's
// realtime events file holds it.
type streamEvent struct {
	Type               string  `json:"type"`
	TS                 float64 `json:"ts"`
	ID                 string  `json:"id"`
	Kind               string  `json:"kind,omitempty"`
	CancelOnDisconnect *bool   `json:"cancel_on_disconnect,omitempty"`
	ExpiresAt          int64   `json:"expires_at,omitempty"`
	Result             any     `json:"result,omitempty"`
	Error              string  `json:"error,omitempty"`
	Seq                int     `json:"seq"`
}

func now() float64 { return float64(time.Now().UnixMicro()) / 1e6 }

// handleImageStream is image_api.py's /v1/images/generations/stream: an
// event stream that accepts the job at once, then ends with its result
// ("completed"), its failure ("error") or its cancellation, and "[DONE]".
// The job runs whether or not the client stays, unless the request set
// cancel_on_disconnect; DELETE /v1/images/{id} cancels it.
func (w *Worker) handleImageStream(rw http.ResponseWriter, r *http.Request) {
	req, job, ok := w.imageGenerationJob(rw, r)
	if !ok {
		return
	}
	ttl := cmp.Or(valueOr(req.SessionTTL, 0), defaultSessionTTL)
	if ttl <= 0 {
		w.fail(rw, badRequest("realtime_session_ttl_seconds must be a positive integer."))
		return
	}
	id := newUUID()
	cancelOnDisconnect := valueOr(req.CancelOnDisconnect, false)
	ctx, cancel := context.WithCancelCause(w.life)
	w.mu.Lock()
	w.images.put(id, &imageEntry{stream: &streamState{status: "queued", cancel: cancel}})
	w.mu.Unlock()
	done := make(chan streamEvent, 1)
	go func() { done <- w.runStream(ctx, id, job) }()

	rw.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
	rw.WriteHeader(http.StatusOK)
	w.writeEvent(rw, streamEvent{Type: "accepted", TS: now(), ID: id, Kind: "image",
		CancelOnDisconnect: &cancelOnDisconnect, ExpiresAt: time.Now().Unix() + int64(ttl), Seq: 1}, job.ext)
	select {
	case ev := <-done:
		if w.crashed.Load() {
			panic(http.ErrAbortHandler)
		}
		ev.Seq = 2
		w.writeEvent(rw, ev, job.ext)
		fmt.Fprint(rw, "data: [DONE]\n\n")
	case <-r.Context().Done():
		if cancelOnDisconnect {
			cancel(errCancelled)
		}
	}
}

// runStream runs a streamed job and returns its terminal event.
func (w *Worker) runStream(ctx context.Context, id string, job imageJob) streamEvent {
	run, err := w.runJob(ctx, job.shape, nil)
	status := "completed"
	ev := streamEvent{Type: "completed", ID: id}
	switch {
	case errors.Is(context.Cause(ctx), errCancelled):
		status, ev.Type = "cancelled", "cancelled"
	case err != nil:
		var se schedulerError
		if errors.As(err, &se) {
			ev.Error = noOutput(err)
		} else {
			ev.Error = err.Error()
		}
		status, ev.Type = "failed", "error"
	default:
		files := imageFiles(id, job.ext, job.outputs)
		cloudURL := w.upload(files[0])
		w.storeImages(id, job.ext, cloudURL)
		body, err := w.imageResponse(id, job.prompt, job.format, files, cloudURL, "", run.took)
		var he *httpError
		switch {
		case errors.As(err, &he): // str(HTTPException)
			status, ev.Type, ev.Error = "failed", "error", fmt.Sprintf("%d: %v", he.status, he.detail)
		case err != nil:
			status, ev.Type, ev.Error = "failed", "error", err.Error()
		default:
			ev.Result = body
		}
	}
	w.mu.Lock()
	if e := w.images.entries[id]; e != nil && e.stream != nil {
		e.stream.status = status
	}
	w.mu.Unlock()
	ev.TS = now()
	return ev
}

// writeEvent writes one server-sent event, splicing in the media of ext.
func (w *Worker) writeEvent(rw http.ResponseWriter, ev streamEvent, ext string) {
	b, err := json.Marshal(ev)
	if err != nil {
		panic(err) // events hold only strings, numbers and JSON maps
	}
	fmt.Fprintf(rw, "id: %d\ndata: ", ev.Seq)
	w.spliceMedia(rw, b, w.media(ext).b64)
	fmt.Fprint(rw, "\n\n")
	if f, ok := rw.(http.Flusher); ok {
		f.Flush()
	}
}

// handleImageContent is image_api.py's download_image_content.
func (w *Worker) handleImageContent(rw http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	w.mu.Lock()
	e := w.images.entries[id]
	var entry imageEntry
	if e != nil {
		entry = *e
	}
	w.mu.Unlock()
	switch {
	case e == nil || !entry.ready:
		w.fail(rw, &httpError{http.StatusNotFound, "Image not found"})
		return
	case entry.url != "":
		w.fail(rw, badRequest("Image has been uploaded to cloud storage. Please use the cloud URL: %s", entry.url))
		return
	}
	media := w.media(entry.ext)
	contentType := map[string]string{"png": "image/png", "webp": "image/webp"}[entry.ext]
	rw.Header().Set("Content-Type", cmp.Or(contentType, "image/jpeg"))
	rw.Header().Set("Content-Length", strconv.Itoa(len(media.data)))
	rw.Header().Set("Content-Disposition", fmt.Sprintf(`attachment; filename="%s.%s"`, id, entry.ext))
	rw.Write(media.data) // a write error means the client left; nothing to do
}

// handleDeleteImage is image_api.py's delete_image: a streamed job still
// running is cancelled ("cancelling"); any other job is forgotten.
func (w *Worker) handleDeleteImage(rw http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	w.mu.Lock()
	e := w.images.entries[id]
	status := "deleted"
	switch {
	case e == nil:
	case e.stream != nil && !e.stream.terminal():
		e.stream.status, status = "cancelling", "cancelling"
		e.stream.cancel(errCancelled)
	default:
		delete(w.images.entries, id)
	}
	w.mu.Unlock()
	if e == nil {
		w.fail(rw, &httpError{http.StatusNotFound, "Image not found"})
		return
	}
	writeJSON(rw, http.StatusOK, map[string]string{"id": id, "status": status})
}
