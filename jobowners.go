package diffusionrouter

import (
	"container/list"
	"sync"
	"time"
)

// Only the worker that created a video or image job knows its id, so the
// router remembers which worker made each job. The memory is bounded in
// both size and age: a rollout that never polls its videos or fetches its
// images must not grow the router.
const (
	defaultJobOwnerLimit = 100_000
	defaultJobOwnerTTL   = 24 * time.Hour
)

// jobOwners maps job ids to the URL of the worker that made them,
// forgetting the oldest entries first.
type jobOwners struct {
	limit int
	ttl   time.Duration
	now   func() time.Time

	mu    sync.Mutex
	byID  map[string]*list.Element
	order *list.List // of *ownedJob, newest at the front
}

type ownedJob struct {
	id      string
	worker  string
	expires time.Time
}

func newJobOwners(limit int, ttl time.Duration) *jobOwners {
	return &jobOwners{
		limit: limit,
		ttl:   ttl,
		now:   time.Now,
		byID:  make(map[string]*list.Element),
		order: list.New(),
	}
}

// remember records that worker made the job id.
func (o *jobOwners) remember(id, worker string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	now := o.now()
	if e, ok := o.byID[id]; ok {
		o.order.Remove(e)
	}
	o.byID[id] = o.order.PushFront(&ownedJob{id: id, worker: worker, expires: now.Add(o.ttl)})
	for o.order.Len() > o.limit || o.expired(o.order.Back(), now) {
		o.removeLocked(o.order.Back())
	}
}

// worker returns the URL of the worker that made job id.
func (o *jobOwners) worker(id string) (string, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	e, ok := o.byID[id]
	if !ok {
		return "", false
	}
	if o.expired(e, o.now()) {
		o.removeLocked(e)
		return "", false
	}
	return e.Value.(*ownedJob).worker, true
}

// forget drops job id, after it was deleted on its worker.
func (o *jobOwners) forget(id string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if e, ok := o.byID[id]; ok {
		o.removeLocked(e)
	}
}

// forgetWorker drops every job of a worker that left the pool.
func (o *jobOwners) forgetWorker(worker string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for e := o.order.Front(); e != nil; {
		next := e.Next()
		if e.Value.(*ownedJob).worker == worker {
			o.removeLocked(e)
		}
		e = next
	}
}

func (o *jobOwners) expired(e *list.Element, now time.Time) bool {
	return e != nil && !now.Before(e.Value.(*ownedJob).expires)
}

func (o *jobOwners) removeLocked(e *list.Element) {
	delete(o.byID, e.Value.(*ownedJob).id)
	o.order.Remove(e)
}
