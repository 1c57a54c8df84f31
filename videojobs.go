package diffusionrouter

import (
	"container/list"
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"time"
)

// Only the worker that created a video job knows its id, so the router
// remembers which worker made each job. The memory is bounded in both size
// and age: a rollout that never polls its videos must not grow the router.
const (
	defaultVideoJobLimit = 100_000
	defaultVideoJobTTL   = 24 * time.Hour
)

// videoJobs maps video job ids to the URL of the worker that made them,
// forgetting the oldest entries first.
type videoJobs struct {
	limit int
	ttl   time.Duration
	now   func() time.Time

	mu    sync.Mutex
	byID  map[string]*list.Element
	order *list.List // of *videoJob, newest at the front
}

type videoJob struct {
	id      string
	worker  string
	expires time.Time
}

func newVideoJobs(limit int, ttl time.Duration) *videoJobs {
	return &videoJobs{
		limit: limit,
		ttl:   ttl,
		now:   time.Now,
		byID:  make(map[string]*list.Element),
		order: list.New(),
	}
}

// remember records that worker made the job id.
func (v *videoJobs) remember(id, worker string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	now := v.now()
	if e, ok := v.byID[id]; ok {
		v.order.Remove(e)
	}
	v.byID[id] = v.order.PushFront(&videoJob{id: id, worker: worker, expires: now.Add(v.ttl)})
	for v.order.Len() > v.limit || v.expired(v.order.Back(), now) {
		v.removeLocked(v.order.Back())
	}
}

// worker returns the URL of the worker that made job id.
func (v *videoJobs) worker(id string) (string, bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	e, ok := v.byID[id]
	if !ok {
		return "", false
	}
	if v.expired(e, v.now()) {
		v.removeLocked(e)
		return "", false
	}
	return e.Value.(*videoJob).worker, true
}

// forget drops job id, after it was deleted on its worker.
func (v *videoJobs) forget(id string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if e, ok := v.byID[id]; ok {
		v.removeLocked(e)
	}
}

// forgetWorker drops every job of a worker that left the pool.
func (v *videoJobs) forgetWorker(worker string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	for e := v.order.Front(); e != nil; {
		next := e.Next()
		if e.Value.(*videoJob).worker == worker {
			v.removeLocked(e)
		}
		e = next
	}
}

func (v *videoJobs) expired(e *list.Element, now time.Time) bool {
	return e != nil && !now.Before(e.Value.(*videoJob).expires)
}

func (v *videoJobs) removeLocked(e *list.Element) {
	delete(v.byID, e.Value.(*videoJob).id)
	v.order.Remove(e)
}

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

// readsVideoJob reports whether r's answer is a video job object the router
// must read: a new job, or a job's status.
func readsVideoJob(r *http.Request) bool {
	if r.URL.Path == "/v1/videos" {
		return r.Method == http.MethodPost || r.Method == http.MethodGet && r.URL.Query().Has("video_id")
	}
	rest, ok := strings.CutPrefix(r.URL.Path, "/v1/videos/")
	return ok && r.Method == http.MethodGet && rest != "" && !strings.Contains(rest, "/")
}

// trackVideoJob keeps the router's view of video jobs: which worker made a
// new job (whose ticket it then holds, reporting true), and when a job
// ended or was deleted (releasing its worker).
func (h *Handler) trackVideoJob(r *http.Request, t *ticket, rec *recorder, err error) bool {
	if err != nil || rec.status < 200 || rec.status > 299 {
		return false
	}
	var job videoJobStatus
	if rec.peekLimit > 0 && json.Unmarshal(rec.peek, &job) != nil {
		return false
	}
	switch {
	case r.Method == http.MethodPost && t.job && job.ID != "":
		h.pool.videos.remember(job.ID, t.servedBy)
		return h.pool.holdVideo(t, job.ID)
	case r.Method == http.MethodDelete && t.pin != "":
		id, _ := videoJobID(r.URL.Path)
		h.pool.videos.forget(id)
		h.pool.endVideo(id, abandoned)
	case job.Status == "completed":
		h.pool.endVideo(job.ID, succeeded)
	case job.Status == "failed" || job.Status == "cancelled":
		h.pool.endVideo(job.ID, failed)
	}
	return false
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
	hv, ok := p.held[id]
	if !ok {
		return
	}
	delete(p.held, id)
	hv.timer.Stop()
	p.releaseLocked(hv.t, o)
}
