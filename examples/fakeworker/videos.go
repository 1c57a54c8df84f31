package fakeworker

import (
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"
)

// videoJob is a video job as sglang's video API reports it, plus the weight
// version it ran with.
type videoJob struct {
	ID             string            `json:"id"`
	Object         string            `json:"object"`
	Model          string            `json:"model"`
	Status         string            `json:"status"` // queued, in_progress, completed, failed; deleted in a DELETE answer
	Progress       int               `json:"progress"`
	CreatedAt      int64             `json:"created_at"`
	Size           string            `json:"size"`
	Seconds        string            `json:"seconds"`
	Quality        string            `json:"quality"`
	CompletedAt    *int64            `json:"completed_at"`
	Error          map[string]string `json:"error"`
	InferenceTimeS *float64          `json:"inference_time_s"`
	WeightVersion  string            `json:"weight_version,omitempty"`

	seq      int           // creation order, for listing
	started  time.Time     // when the job got the worker
	duration time.Duration // planned service time; forever if hung
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

// videoRequest is sglang's VideoGenerationsRequest, as far as cost goes.
type videoRequest struct {
	Prompt  *string `json:"prompt"`
	Model   string  `json:"model"`
	Seconds *int    `json:"seconds"`
	FPS     *int    `json:"fps"`
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

// parseVideoRequest reads a JSON or multipart video request as sglang's
// create_video does.
func parseVideoRequest(r *http.Request) (videoRequest, error) {
	if strings.Contains(strings.ToLower(r.Header.Get("Content-Type")), "multipart/form-data") {
		return parseVideoForm(r)
	}
	return parseVideoJSON(r)
}

// parseVideoJSON merges an "extra_body" object into the top level and, like
// sglang, answers every problem with 400 "Invalid request body: ...";
// an unreadable body counts as {}, which lacks a prompt.
func parseVideoJSON(r *http.Request) (videoRequest, error) {
	var req videoRequest
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return req, badRequest("Invalid request body: %v", err)
	}
	var payload map[string]json.RawMessage
	if json.Unmarshal(body, &payload) != nil {
		payload = map[string]json.RawMessage{}
	}
	var extra map[string]json.RawMessage
	if json.Unmarshal(payload["extra_body"], &extra) == nil {
		maps.Copy(payload, extra)
	}
	delete(payload, "extra_body")
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

// parseVideoForm reads sglang's multipart fields: prompt and an
// input_reference file (both required), model, seconds, size, fps,
// num_frames, and extra_body, a JSON object whose fps and num_frames apply
// when the form fields are absent.
func parseVideoForm(r *http.Request) (videoRequest, error) {
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
	req.Size, req.NumFrames = f.str("size"), f.int("num_frames")
	if err := f.err(); err != nil {
		return req, err
	}
	if valueOr(req.Prompt, "") == "" {
		return req, badRequest("prompt is required")
	}
	if !f.hasFile("input_reference") {
		return req, badRequest("input_reference file is required")
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

// handleCreateVideo answers at once with a queued job, which then waits its
// turn in the worker's queue like any other job.
func (w *Worker) handleCreateVideo(rw http.ResponseWriter, r *http.Request) {
	if !w.isVideoTask() {
		w.fail(rw, badRequest("model %s has task type %s and cannot generate videos; video-capable task types are T2V, I2V and TI2V",
			w.cfg.ModelPath, w.cfg.TaskType))
		return
	}
	req, err := parseVideoRequest(r)
	if err != nil {
		w.fail(rw, err)
		return
	}
	s, err := req.shape()
	if err != nil {
		w.fail(rw, err)
		return
	}
	job := w.addVideo(req, s)
	go w.runVideo(job.ID, s.cost())
	writeJSON(rw, http.StatusOK, job)
}

func (w *Worker) addVideo(req videoRequest, s shape) videoJob {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.videoSeq++
	job := &videoJob{
		ID:        "video_" + newID(),
		Object:    "video",
		Model:     cmp.Or(req.Model, "sora-2"), // sglang's default
		Status:    "queued",
		CreatedAt: time.Now().Unix(),
		Size:      fmt.Sprintf("%dx%d", s.width, s.height),
		Seconds:   strconv.Itoa(int(math.Round(float64(s.frames) / float64(req.fps())))),
		Quality:   "standard",
		seq:       w.videoSeq,
	}
	w.videos[job.ID] = job
	return *job
}

// runVideo runs a video job in the background; it outlives the request that
// made it and ends only with the worker.
func (w *Worker) runVideo(id string, cost float64) {
	res, err := w.runJob(w.life, cost, func(d time.Duration) {
		w.updateVideo(id, func(j *videoJob) {
			j.Status, j.started, j.duration = "in_progress", time.Now(), d
		})
	})
	w.updateVideo(id, func(j *videoJob) {
		if err != nil {
			j.Status, j.Error = "failed", map[string]string{"message": err.Error()}
			return
		}
		completed, seconds := time.Now().Unix(), res.elapsed.Seconds()
		j.Status, j.Progress, j.WeightVersion = "completed", 100, res.version
		j.CompletedAt, j.InferenceTimeS = &completed, &seconds
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

func writeVideo(rw http.ResponseWriter, job videoJob) {
	if job.WeightVersion != "" {
		writeVersioned(rw, job.WeightVersion, job)
		return
	}
	writeJSON(rw, http.StatusOK, job)
}

func (w *Worker) handleGetVideo(rw http.ResponseWriter, r *http.Request) {
	job, err := w.video(r.PathValue("id"))
	if err != nil {
		w.fail(rw, err)
		return
	}
	writeVideo(rw, job)
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
	writeVideo(rw, job)
}

func (w *Worker) handleVideoContent(rw http.ResponseWriter, r *http.Request) {
	job, err := w.video(r.PathValue("id"))
	if err == nil && job.Status != "completed" {
		err = errVideoInProgress // sglang answers this for failed jobs too
	}
	if err != nil {
		w.fail(rw, err)
		return
	}
	rw.Header().Set("Content-Type", "video/mp4")
	rw.Header().Set("Content-Length", strconv.Itoa(len(w.output)))
	rw.Header().Set("X-Weight-Version", job.WeightVersion)
	rw.Write(w.output) // a write error means the client left; nothing to do
}

// handleListVideos takes sglang's query parameters: after (a job id), limit
// (1..100) and order (desc by default, or asc).
func (w *Worker) handleListVideos(rw http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	limit := 0
	if s := q.Get("limit"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > 100 {
			w.fail(rw, invalid(fieldError{Type: "value_error", Loc: []any{"query", "limit"},
				Msg: "Input should be an integer from 1 to 100"}))
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
	if !strings.EqualFold(q.Get("order"), "asc") {
		slices.Reverse(jobs)
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
