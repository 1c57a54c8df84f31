package jobkinds

import (
	"encoding/json"
	"net/http"

	"github.com/miles-rollout/miles-diffusion-router/internal/attempt"
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

// Ended keeps the router's view of video jobs as t's attempt r ended:
// which worker made a new job (whose ticket it then holds, reporting
// true), and when a job ended or was deleted (releasing its worker).
func (k Kinds) Ended(r *http.Request, t *scheduler.Ticket, e attempt.Ending) bool {
	if t.Route.Kind != request.Video && t.Route.Kind != request.VideoPoll {
		return false
	}
	reads := readsVideoJob(r, t.Route)
	// A status poll answered 404 is a job its worker no longer has; a
	// content poll's 404 may only mean the video is not done yet.
	denied := e.Err == nil && e.Status == http.StatusNotFound && reads
	if t.Route.Poll && r.Context().Err() == nil && (e.Err != nil || denied) {
		k.loseVideo(t.Route.JobID, denied)
		return false
	}
	if e.Err != nil || e.Sent < 200 || e.Sent > 299 {
		return false
	}
	var job videoJobStatus
	if reads && json.Unmarshal(e.Peek, &job) != nil {
		return false
	}
	switch {
	case r.Method == http.MethodPost && t.Job && request.ValidJobID(job.ID):
		k.pool.Videos().Remember(job.ID, t.ServedBy(), t.Tenant)
		return k.pool.HoldVideo(t, job.ID)
	case r.Method == http.MethodDelete && t.Pin != "":
		id := t.Route.JobID
		k.pool.Videos().Forget(id)
		k.pool.EndVideo(id, scheduler.Abandoned)
	case job.Status == "completed":
		k.pool.EndVideo(job.ID, scheduler.Succeeded)
	case job.Status == "failed" || job.Status == "cancelled":
		k.pool.EndVideo(job.ID, scheduler.Failed)
	}
	return false
}

// loseVideo gives back the slot of a video job whose worker did not
// answer a poll of it, or answered that it has no such job (a worker that
// restarted): the job failed. A worker that denies the job is no longer
// asked about it.
func (k Kinds) loseVideo(id string, denied bool) {
	k.pool.EndVideo(id, scheduler.Failed)
	if denied {
		k.pool.Videos().Forget(id)
	}
}
