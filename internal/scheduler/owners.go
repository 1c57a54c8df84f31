// Package scheduler decides which worker runs each job and when: the
// workers' load and speed as the router learns them, the queue of waiting
// jobs and the order it hands them out in, the strategies that choose a
// worker, and which worker made each job a client will ask about again.
package scheduler

import (
	"container/list"
	"sync"
	"time"
)

// Only the worker that created a video or image job knows its id, so the
// router remembers which worker made each job. The memory is bounded in
// both size and age: a rollout that never polls its videos or fetches its
// images must not grow the router.
// The bounds of the router's own maps.
const (
	DefaultOwnerLimit = 100_000
	DefaultOwnerTTL   = 24 * time.Hour
)

// JobOwners maps job ids to the URL of the worker that made them,
// forgetting the oldest entries first.
type JobOwners struct {
	limit int
	ttl   time.Duration
	now   func() time.Time // the clock; tests set their own

	mu    sync.Mutex
	byID  map[string]*list.Element
	order *list.List // of *ownedJob, newest at the front
}

type ownedJob struct {
	id      string
	worker  string
	expires time.Time
}

// NewJobOwners remembers at most limit jobs, each for at most ttl.
func NewJobOwners(limit int, ttl time.Duration) *JobOwners {
	return &JobOwners{
		limit: limit,
		ttl:   ttl,
		now:   time.Now,
		byID:  make(map[string]*list.Element),
		order: list.New(),
	}
}

// Remember records that worker made the job id.
func (o *JobOwners) Remember(id, worker string) {
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

// Worker returns the URL of the worker that made job id.
func (o *JobOwners) Worker(id string) (string, bool) {
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

// Forget drops job id, after it was deleted on its worker.
func (o *JobOwners) Forget(id string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if e, ok := o.byID[id]; ok {
		o.removeLocked(e)
	}
}

// ForgetWorker drops every job of a worker that left the pool.
func (o *JobOwners) ForgetWorker(worker string) {
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

func (o *JobOwners) expired(e *list.Element, now time.Time) bool {
	return e != nil && !now.Before(e.Value.(*ownedJob).expires)
}

func (o *JobOwners) removeLocked(e *list.Element) {
	delete(o.byID, e.Value.(*ownedJob).id)
	o.order.Remove(e)
}
