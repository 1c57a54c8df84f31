package diffusionrouter

import (
	"encoding/json"
	"net/http"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/request"
)

// maxVideoResponsePeek bounds how much of a video job's answer the router
// keeps to read its id and status; the answer is a small JSON object.
const maxVideoResponsePeek = 64 << 10

// A video job is answered at once and then runs on its worker for minutes,
// so its ticket keeps the worker's slot and predicted work until a status
// poll or a DELETE shows the job has ended, or, for a job nobody polls,
// until it is predicted to end.

// heldVideo is a video job's claim on its worker after the creating
// request has been answered.
type heldVideo struct {
	t     *ticket
	timer *time.Timer
}

// videoJobStatus is the part of a video job object the router reads.
type videoJobStatus struct {
	ID     string `json:"id"`
	Status string `json:"status"`
}

// readsVideoJob reports whether r's answer, on route, is a video job
// object the router must read: a new job, or a job's status.
func readsVideoJob(r *http.Request, route request.Route) bool {
	switch route.Kind {
	case request.Video:
		return r.Method == http.MethodPost || r.Method == http.MethodGet && route.Poll
	case request.VideoPoll:
		return r.Method == http.MethodGet && r.URL.Path == route.Path+route.JobID // not its content
	}
	return false
}

// trackVideoJob keeps the router's view of video jobs: which worker made a
// new job (whose ticket it then holds, reporting true), and when a job
// ended or was deleted (releasing its worker).
func (h *Handler) trackVideoJob(r *http.Request, t *ticket, rec *recorder, err error) bool {
	if t.route.Kind != request.Video && t.route.Kind != request.VideoPoll {
		return false
	}
	// A status poll answered 404 is a job its worker no longer has; a
	// content poll's 404 may only mean the video is not done yet.
	denied := err == nil && heldStatus(rec) == http.StatusNotFound && readsVideoJob(r, t.route)
	if t.route.Poll && r.Context().Err() == nil && (err != nil || denied) {
		h.loseVideo(t.route.JobID, denied)
		return false
	}
	if err != nil || rec.status < 200 || rec.status > 299 {
		return false
	}
	var job videoJobStatus
	if rec.peekLimit > 0 && json.Unmarshal(rec.peek, &job) != nil {
		return false
	}
	switch {
	case r.Method == http.MethodPost && t.job && job.ID != "":
		h.pool.videos.Remember(job.ID, t.servedBy)
		return h.pool.holdVideo(t, job.ID)
	case r.Method == http.MethodDelete && t.pin != "":
		id := t.route.JobID
		h.pool.videos.Forget(id)
		h.pool.endVideo(id, abandoned)
	case job.Status == "completed":
		h.pool.endVideo(job.ID, succeeded)
	case job.Status == "failed" || job.Status == "cancelled":
		h.pool.endVideo(job.ID, failed)
	}
	return false
}

// loseVideo gives back the slot of a video job whose worker did not
// answer a poll of it, or answered that it has no such job (a worker that
// restarted): the job failed. A worker that denies the job is no longer
// asked about it.
func (h *Handler) loseVideo(id string, denied bool) {
	h.pool.endVideo(id, failed)
	if denied {
		h.pool.videos.Forget(id)
	}
}

// holdVideo keeps t's worker claimed by the video job id.
func (p *pool) holdVideo(t *ticket, id string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if t.worker == nil {
		return false
	}
	t.held = true
	hv := &heldVideo{t: t}
	// Unpolled, the job gives its worker back when it is predicted to end.
	ends := time.Duration(t.worker.load.endsAt - p.now().UnixNano())
	hv.timer = time.AfterFunc(max(ends, 0), func() { p.endVideo(id, abandoned) })
	p.held[id] = hv
	return true
}

// endVideo releases the worker of a held video job that has ended.
func (p *pool) endVideo(id string, o outcome) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.endVideoLocked(id, o)
}

func (p *pool) endVideoLocked(id string, o outcome) {
	hv, ok := p.held[id]
	if !ok {
		return
	}
	delete(p.held, id)
	hv.timer.Stop()
	p.releaseLocked(hv.t, o)
}

// endVideosOfLocked releases the video jobs w holds, which it lost: they
// say nothing more of it than what lost them.
func (p *pool) endVideosOfLocked(w *worker) {
	for id, hv := range p.held {
		if hv.t.worker == w {
			p.endVideoLocked(id, abandoned)
		}
	}
}
