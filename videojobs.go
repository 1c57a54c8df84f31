package diffusionrouter

import (
	"encoding/json"
	"net/http"

	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// maxVideoResponsePeek bounds how much of a video job's answer the router
// keeps to read its id and status; the answer is a small JSON object.
const maxVideoResponsePeek = 64 << 10

// A video job is answered at once and then runs on its worker for minutes,
// so its ticket keeps the worker's slot and predicted work until a status
// poll or a DELETE shows the job has ended, or, for a job nobody polls,
// until it is predicted to end.

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
func (h *Handler) trackVideoJob(r *http.Request, t *scheduler.Ticket, rec *recorder, err error) bool {
	if t.Route.Kind != request.Video && t.Route.Kind != request.VideoPoll {
		return false
	}
	// A status poll answered 404 is a job its worker no longer has; a
	// content poll's 404 may only mean the video is not done yet.
	denied := err == nil && heldStatus(rec) == http.StatusNotFound && readsVideoJob(r, t.Route)
	if t.Route.Poll && r.Context().Err() == nil && (err != nil || denied) {
		h.loseVideo(t.Route.JobID, denied)
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
	case r.Method == http.MethodPost && t.Job && request.ValidJobID(job.ID):
		h.pool.Videos().Remember(job.ID, t.ServedBy(), t.Tenant)
		return h.pool.HoldVideo(t, job.ID)
	case r.Method == http.MethodDelete && t.Pin != "":
		id := t.Route.JobID
		h.pool.Videos().Forget(id)
		h.pool.EndVideo(id, scheduler.Abandoned)
	case job.Status == "completed":
		h.pool.EndVideo(job.ID, scheduler.Succeeded)
	case job.Status == "failed" || job.Status == "cancelled":
		h.pool.EndVideo(job.ID, scheduler.Failed)
	}
	return false
}

// loseVideo gives back the slot of a video job whose worker did not
// answer a poll of it, or answered that it has no such job (a worker that
// restarted): the job failed. A worker that denies the job is no longer
// asked about it.
func (h *Handler) loseVideo(id string, denied bool) {
	h.pool.EndVideo(id, scheduler.Failed)
	if denied {
		h.pool.Videos().Forget(id)
	}
}
