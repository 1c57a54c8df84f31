// Package scheduler decides which worker runs each job and when: the
// workers' load and speed as the router learns them, the queue of waiting
// jobs and the order it hands them out in, the strategies that choose a
// worker, and which worker made each job a client will ask about again.
package scheduler

import (
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
// forgetting the oldest entries first. The entries sit by value in a ring,
// and the map holds their places, not pointers: a full map is 100,000 jobs
// that the garbage collector would otherwise trace object by object on
// every cycle, a cost that grew with each job the router served.
type JobOwners struct {
	limit int
	ttl   time.Duration
	now   func() time.Time // the clock; tests set their own

	mu   sync.Mutex
	byID map[string]uint64 // the place of each id's entry
	// The entry at place s is ring[s % limit]; places oldest to next-1 are
	// in use, the oldest first. The ring grows up to limit as it fills.
	ring         []ownedJob
	oldest, next uint64
}

type ownedJob struct {
	id      string // empty once forgotten
	worker  string
	expires int64 // Unix nanoseconds
}

// NewJobOwners remembers at most limit jobs, each for at most ttl.
func NewJobOwners(limit int, ttl time.Duration) *JobOwners {
	return &JobOwners{limit: limit, ttl: ttl, now: time.Now, byID: make(map[string]uint64)}
}

// Remember records that worker made the job id.
func (o *JobOwners) Remember(id, worker string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	now := o.now().UnixNano()
	if s, ok := o.byID[id]; ok {
		o.at(s).id = ""
	}
	if o.next-o.oldest == uint64(o.limit) {
		o.dropOldestLocked()
	}
	e := ownedJob{id: id, worker: worker, expires: now + int64(o.ttl)}
	if o.next < uint64(o.limit) {
		o.ring = append(o.ring, e)
	} else {
		*o.at(o.next) = e
	}
	o.byID[id] = o.next
	o.next++
	for o.oldest < o.next && (o.at(o.oldest).id == "" || o.at(o.oldest).expires <= now) {
		o.dropOldestLocked()
	}
}

// Worker returns the URL of the worker that made job id.
func (o *JobOwners) Worker(id string) (string, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	s, ok := o.byID[id]
	if !ok {
		return "", false
	}
	e := o.at(s)
	if e.expires <= o.now().UnixNano() {
		o.forgetLocked(e)
		return "", false
	}
	return e.worker, true
}

// Forget drops job id, after it was deleted on its worker.
func (o *JobOwners) Forget(id string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if s, ok := o.byID[id]; ok {
		o.forgetLocked(o.at(s))
	}
}

// ForgetWorker drops every job of a worker that left the pool.
func (o *JobOwners) ForgetWorker(worker string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for s := o.oldest; s < o.next; s++ {
		if e := o.at(s); e.id != "" && e.worker == worker {
			o.forgetLocked(e)
		}
	}
}

func (o *JobOwners) at(s uint64) *ownedJob { return &o.ring[s%uint64(o.limit)] }

// forgetLocked drops e's id; its place is reused when it is the oldest.
func (o *JobOwners) forgetLocked(e *ownedJob) {
	delete(o.byID, e.id)
	e.id = ""
}

func (o *JobOwners) dropOldestLocked() {
	if e := o.at(o.oldest); e.id != "" {
		o.forgetLocked(e)
	}
	*o.at(o.oldest) = ownedJob{} // lets go of the strings
	o.oldest++
}
