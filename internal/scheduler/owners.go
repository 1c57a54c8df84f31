package scheduler

import (
	"cmp"
	"sync"
	"time"
	"unique"
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

// JobOwners maps job ids to the URL of the worker that made them, and to
// the tenant they belong to, forgetting the oldest entries first. A job is
// known only to its own tenant: to any other, its id is unknown, so that
// no tenant lists, fetches or deletes another's job. Without tenants every
// job is the tenant OtherTenant's, known to all.
type JobOwners struct {
	ttl time.Duration
	mu  sync.Mutex
	memo
}

// NewJobOwners remembers at most limit jobs, each for at most ttl.
func NewJobOwners(limit int, ttl time.Duration) *JobOwners {
	return &JobOwners{ttl: ttl, memo: newMemo(limit)}
}

// Remember records that worker made the job id for tenant (a Ticket's
// Tenant: "" is OtherTenant).
func (o *JobOwners) Remember(id, worker, tenant string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.put(memoEntry{id: id, value: worker, owner: ownerOf(tenant)}, o.ttl)
}

// Worker returns the URL of the worker that made job id, when the job is
// tenant's; another tenant's job is unknown.
func (o *JobOwners) Worker(id, tenant string) (string, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	e, ok := o.get(id)
	if !ok || e.owner != cmp.Or(tenant, OtherTenant) {
		return "", false
	}
	return e.value, true
}

// ownerOf is the owner an entry records for tenant. A job's tenant comes
// with its request, a string of its own; interned, the up to
// DefaultOwnerLimit entries share one copy of each name, and hold no
// object each for the garbage collector to trace.
func ownerOf(tenant string) string {
	if tenant == "" {
		return OtherTenant
	}
	return unique.Make(tenant).Value()
}

// Forget drops job id, after it was deleted on its worker.
func (o *JobOwners) Forget(id string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.forget(id)
}

// ForgetWorker drops every job of a worker that left the pool.
func (o *JobOwners) ForgetWorker(worker string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.forgetValue(worker)
}
