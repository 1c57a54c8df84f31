package fakeworker

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"net/http"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// videoJob is a video job as sglang's video API reports it (protocol.py's
// VideoResponse).
type videoJob struct {
	ID                 string            `json:"id"`
	Object             string            `json:"object"`
	Model              string            `json:"model"`
	Status             string            `json:"status"` // queued, in_progress, completed, failed; deleted in a DELETE answer
	Progress           int               `json:"progress"`
	CreatedAt          int64             `json:"created_at"`
	Size               string            `json:"size"`
	Seconds            string            `json:"seconds"`
	Quality            string            `json:"quality"`
	URL                *string           `json:"url"` // in cloud storage
	RemixedFromVideoID *string           `json:"remixed_from_video_id"`
	CompletedAt        *int64            `json:"completed_at"`
	ExpiresAt          *int64            `json:"expires_at"`
	Error              map[string]string `json:"error"`
	FilePath           *string           `json:"file_path"`
	PeakMemoryMB       *float64          `json:"peak_memory_mb"`
	InferenceTimeS     *float64          `json:"inference_time_s"`

	seq      uint64        // creation order, for listing
	started  time.Time     // when the job got the worker
	duration time.Duration // planned service time; forever if hung
	adapter  string        // the LoRA adapter it runs on, once it started; see AdapterHeader
}

// snapshot copies the job with its progress brought up to date.
func (j *videoJob) snapshot() videoJob {
	s := *j
	if s.Status == "in_progress" && s.duration > 0 {
		s.Progress = min(99, int(100*time.Since(s.started)/s.duration))
	}
	return s
}

var (
	errVideoNotFound   = &httpError{http.StatusNotFound, "Video not found"}
	errVideoInProgress = &httpError{http.StatusNotFound, "Generation is still in-progress"}
)

// videoRequest is sglang's VideoGenerationsRequest, as far as the fake
// needs.
type videoRequest struct {
	Prompt         *string `json:"prompt"`
	Model          string  `json:"model"`
	Seconds        *int    `json:"seconds"`
	FPS            *int    `json:"fps"`
	InputReference *string `json:"input_reference"`
	ReferenceURL   *string `json:"reference_url"`
	genParams
}

func (req videoRequest) fps() int {
	return cmp.Or(valueOr(req.FPS, 0), defaultFPS)
}

// shape takes num_frames, or else fps × seconds.
func (req videoRequest) shape() (shape, error) {
	frames := valueOr(req.NumFrames, req.fps()*valueOr(req.Seconds, defaultSeconds))
	return req.genParams.shape(defaultVideoSize, frames, 1)
}

// errNoReference is create_video's answer to a request without an image
// for a model that needs one.
var errNoReference = badRequest("input_reference or reference_url is required for image-to-video generation")

// parseVideoRequest reads a JSON or multipart video request as sglang's
// create_video does.
func (w *Worker) parseVideoRequest(r *http.Request) (videoRequest, error) {
	if strings.Contains(strings.ToLower(r.Header.Get("Content-Type")), "multipart/form-data") {
		return w.parseVideoForm(r)
	}
	return w.parseVideoJSON(r)
}

// parseVideoJSON merges an "extra_body" (or "extra_json") object into the
// top level and, like sglang, answers every problem with 400 "Invalid
// request body: ..."; an unreadable body counts as {}, which lacks a
// prompt.
func (w *Worker) parseVideoJSON(r *http.Request) (videoRequest, error) {
	var req videoRequest
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return req, badRequest("Invalid request body: %v", err)
	}
	var payload map[string]json.RawMessage
	if json.Unmarshal(body, &payload) != nil {
		payload = map[string]json.RawMessage{}
	}
	for _, key := range []string{"extra_body", "extra_json"} {
		var extra map[string]json.RawMessage
		json.Unmarshal(payload[key], &extra) // not an object: dropped
		delete(payload, key)
		maps.Copy(payload, extra)
	}
	if w.needsImage() && !truthy(payload["reference_url"]) && !truthy(payload["input_reference"]) {
		// raised inside create_video's try, so wrapped as any other error
		return videoRequest{}, badRequest("Invalid request body: 400: %v", errNoReference)
	}
	merged, err := json.Marshal(payload)
	if err == nil {
		err = json.Unmarshal(merged, &req)
	}
	if err != nil {
		return req, badRequest("Invalid request body: %v", err)
	}
	if req.Prompt == nil {
		return req, badRequest("Invalid request body: prompt: Field required")
	}
	return req, nil
}

// parseVideoForm reads sglang's multipart fields: prompt (required), an
// input_reference file or reference_url (required by image-to-video
// models), model, seconds, size, fps, num_frames, num_inference_steps, and
// extra_body, a JSON object whose fps and num_frames apply when the form
// fields are absent.
func (w *Worker) parseVideoForm(r *http.Request) (videoRequest, error) {
	f, err := readForm(r)
	if err != nil {
		return videoRequest{}, err
	}
	req := videoRequest{
		Prompt:  f.str("prompt"),
		Model:   valueOr(f.str("model"), ""),
		Seconds: f.int("seconds"),
		FPS:     f.int("fps"),
	}
	req.Size, req.NumFrames, req.NumInferenceSteps = f.str("size"), f.int("num_frames"), f.int("num_inference_steps")
	if err := f.err(); err != nil {
		return req, err
	}
	if valueOr(req.Prompt, "") == "" {
		return req, badRequest("prompt is required")
	}
	if w.needsImage() && !f.hasFile("input_reference") && valueOr(f.str("reference_url"), "") == "" {
		return req, errNoReference
	}
	var extra struct {
		FPS       *int `json:"fps"`
		NumFrames *int `json:"num_frames"`
	}
	if s := f.str("extra_body"); s != nil && json.Unmarshal([]byte(*s), &extra) == nil {
		req.FPS = cmp.Or(req.FPS, extra.FPS)
		req.NumFrames = cmp.Or(req.NumFrames, extra.NumFrames)
	}
	return req, nil
}

// needsImage reports whether the model generates only from an image
// (TaskType.requires_image_input).
func (w *Worker) needsImage() bool {
	return w.cfg.TaskType == "I2V" || w.cfg.TaskType == "I2I"
}

// handleCreateVideo answers at once with a queued job, which then waits its
// turn in the worker's queue like any other job. Like sglang it takes a
// video request on any model.
func (w *Worker) handleCreateVideo(rw http.ResponseWriter, r *http.Request) {
	req, err := w.parseVideoRequest(r)
	if err != nil {
		w.fail(rw, err)
		return
	}
	s, err := req.shape()
	if err != nil {
		w.fail(rw, badRequest("%v", err))
		return
	}
	job := w.addVideo(req, s)
	go w.runVideo(job.ID, s)
	writeJSON(rw, http.StatusOK, job)
}

func (w *Worker) addVideo(req videoRequest, s shape) videoJob {
	w.mu.Lock()
	defer w.mu.Unlock()
	id := "video_" + newID()
	file := filepath.Join(outputDir, id+".mp4")
	job := &videoJob{
		ID:        id,
		Object:    "video",
		Model:     cmp.Or(req.Model, "sora-2"), // sglang's default
		Status:    "queued",
		CreatedAt: w.clock().Unix(),
		Size:      fmt.Sprintf("%dx%d", s.width, s.height),
		Seconds:   strconv.Itoa(int(math.Round(float64(s.frames) / float64(req.fps())))),
		Quality:   "standard",
		FilePath:  &file,
		seq:       videoSeq.Add(1),
	}
	w.videos[job.ID] = job
	return *job
}

// videoSeq orders video jobs by creation.
var videoSeq atomic.Uint64

// runVideo runs a video job in the background; it outlives the request that
// made it and ends only with the worker.
func (w *Worker) runVideo(id string, s shape) {
	run, err := w.runJob(w.life, s, func(d time.Duration, adapter string) {
		w.updateVideo(id, func(j *videoJob) {
			j.Status, j.started, j.duration, j.adapter = "in_progress", time.Now(), d, adapter
		})
	})
	url := w.upload(id + ".mp4")
	w.updateVideo(id, func(j *videoJob) {
		var se schedulerError
		switch {
		case errors.As(err, &se):
			j.Status, j.Error = "failed", map[string]string{"message": noOutput(err)}
			return
		case err != nil:
			j.Status, j.Error = "failed", map[string]string{"message": err.Error()}
			return
		}
		completed, seconds := time.Now().Unix(), run.took.Seconds()
		j.Status, j.Progress = "completed", 100
		j.CompletedAt, j.InferenceTimeS = &completed, &seconds
		if url != "" {
			j.URL, j.FilePath = &url, nil
		}
	})
}

// updateVideo changes a job unless it was deleted meanwhile; sglang cannot
// abort a deleted job either, so it still runs.
func (w *Worker) updateVideo(id string, update func(*videoJob)) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if j, ok := w.videos[id]; ok {
		update(j)
	}
}

func (w *Worker) video(id string) (videoJob, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	j, ok := w.videos[id]
	if !ok {
		return videoJob{}, errVideoNotFound
	}
	return j.snapshot(), nil
}

func (w *Worker) handleGetVideo(rw http.ResponseWriter, r *http.Request) {
	job, err := w.video(r.PathValue("id"))
	if err != nil {
		w.fail(rw, err)
		return
	}
	setAdapter(rw, job.adapter)
	writeJSON(rw, http.StatusOK, job)
}

func (w *Worker) handleDeleteVideo(rw http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	w.mu.Lock()
	j, ok := w.videos[id]
	delete(w.videos, id)
	w.mu.Unlock()
	if !ok {
		w.fail(rw, errVideoNotFound)
		return
	}
	job := j.snapshot()
	job.Status = "deleted"
	writeJSON(rw, http.StatusOK, job)
}

func (w *Worker) handleVideoContent(rw http.ResponseWriter, r *http.Request) {
	job, err := w.video(r.PathValue("id"))
	switch {
	case err != nil:
	case job.URL != nil:
		err = badRequest("Video has been uploaded to cloud storage. Please use the cloud URL: %s", *job.URL)
	case job.Status != "completed":
		err = errVideoInProgress // sglang answers this for failed jobs too
	}
	if err != nil {
		w.fail(rw, err)
		return
	}
	media := w.media("mp4")
	setAdapter(rw, job.adapter)
	rw.Header().Set("Content-Type", "video/mp4")
	rw.Header().Set("Content-Length", strconv.Itoa(len(media.data)))
	rw.Header().Set("Content-Disposition", fmt.Sprintf(`attachment; filename="%s.mp4"`, job.ID))
	rw.Write(media.data) // a write error means the client left; nothing to do
}

// handleListVideos takes sglang's query parameters: after (a job id), limit
// (1..100) and order (desc by default, or asc); others, such as video_id,
// are ignored, so a poll by query gets the whole list. Jobs are ordered by
// created_at, in seconds, and those of the same second stay in creation
// order either way, as Python's stable sort leaves them.
func (w *Worker) handleListVideos(rw http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	limit := 0
	if s := q.Get("limit"); q.Has("limit") {
		n, err := strconv.Atoi(s)
		var fe *fieldError
		switch {
		case err != nil:
			fe = &fieldError{Type: "int_parsing", Msg: "Input should be a valid integer, unable to parse string as an integer"}
		case n < 1:
			fe = &fieldError{Type: "greater_than_equal", Msg: "Input should be greater than or equal to 1"}
		case n > 100:
			fe = &fieldError{Type: "less_than_equal", Msg: "Input should be less than or equal to 100"}
		}
		if fe != nil {
			fe.Loc = []any{"query", "limit"}
			w.fail(rw, invalid(*fe))
			return
		}
		limit = n
	}
	w.mu.Lock()
	jobs := make([]videoJob, 0, len(w.videos))
	for _, j := range w.videos {
		jobs = append(jobs, j.snapshot())
	}
	w.mu.Unlock()

	slices.SortFunc(jobs, func(a, b videoJob) int { return cmp.Compare(a.seq, b.seq) })
	if strings.ToLower(q.Get("order")) == "asc" {
		slices.SortStableFunc(jobs, func(a, b videoJob) int { return cmp.Compare(a.CreatedAt, b.CreatedAt) })
	} else {
		slices.SortStableFunc(jobs, func(a, b videoJob) int { return cmp.Compare(b.CreatedAt, a.CreatedAt) })
	}
	if after := q.Get("after"); q.Has("after") {
		if i := slices.IndexFunc(jobs, func(j videoJob) bool { return j.ID == after }); i >= 0 {
			jobs = jobs[i+1:]
		} else {
			jobs = jobs[:0]
		}
	}
	if limit > 0 && len(jobs) > limit {
		jobs = jobs[:limit]
	}
	writeJSON(rw, http.StatusOK, map[string]any{"data": jobs, "object": "list"})
}
