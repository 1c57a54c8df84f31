package diffusionrouter

import (
	"container/list"
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
