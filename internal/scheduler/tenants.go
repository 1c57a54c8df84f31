package scheduler

import (
	"cmp"
	"errors"
	"slices"
)

// Tenants share the GPU time of a pool by weight. Each job may name its
// tenant (Ticket.Tenant). While several tenants have jobs waiting, the
// next free worker goes to the tenant that has been served least: each
// tenant has a virtual counter of service, the cost of the jobs it was
// given workers for divided by its weight, and among the waiting jobs of
// the highest priority, the tenant with the lowest counter goes first;
// within a tenant, the queue order then arrival. This is the Virtual
// Token Counter of "Fairness in Serving Large Language Models" (Sheng et
// al., OSDI'24), counted in cost (predicted GPU work) rather than tokens:
// a tenant sending many small jobs and one sending few large ones get the
// same work done. It is work-conserving: a tenant with nothing waiting
// takes no share, and the others use its workers.
//
// A tenant that becomes active (it had nothing waiting or running) has
// its counter lifted to the lowest counter of the active tenants, so that
// idle time banks no credit: it comes back even with the others, not
// ahead of them for as long as it was away.
//
// A job is charged its cost once, when it first gets a worker: a re-run
// after a worker's failure is not charged again (the failure is not the
// tenant's), a hedged copy is (it takes a second GPU).
//
// Tenant names come from clients, so their number is bounded: at most
// MaxTenants are tracked; a new name beyond them takes the place of a
// tracked tenant that is idle, or, while every one is active, shares the
// tenant OtherTenant, which also holds the jobs that name no tenant.

// OtherTenant is the tenant of jobs that name none, and of tenants beyond
// the number tracked.
const OtherTenant = "other"

// DefaultMaxTenants is how many tenants a pool tracks when the config
// sets no limit.
const DefaultMaxTenants = 64

// ErrTenantQueueFull refuses a job whose tenant has TenantMaxQueue jobs
// waiting.
var ErrTenantQueueFull = errors.New("tenant queue full")

// tenant is one tenant's share of a pool.
type tenant struct {
	name    string
	served  float64   // virtual service: cost given workers / weight
	cost    float64   // cost given workers, for the metrics
	queue   []*waiter // its waiting jobs, in compare order
	running int       // its jobs holding a worker
	cursor  int       // scratch of a dispatch: its next job to try
	evicted bool      // no longer tracked: a ticket still naming it joins again
}

func (tn *tenant) idle() bool { return len(tn.queue) == 0 && tn.running == 0 }

// tenancy is a pool's tenants. It is off until a job names a tenant, and
// nothing of it is touched while off.
type tenancy struct {
	on     bool
	byName map[string]*tenant
	list   []*tenant // tracked, OtherTenant first
	other  *tenant
	order  []*tenant // scratch of a dispatch
}

// weight is the weight of tenant name under cfg: 1 unless set.
func (cfg *Config) weight(name string) float64 {
	if w := cfg.TenantWeights[name]; w > 0 {
		return w
	}
	return 1
}

// joinTenantLocked sets t's tenant, tracking it if it is new.
func (d *dispatchState) joinTenantLocked(t *Ticket) {
	ts := &d.tenancy
	if !ts.on {
		d.startTenancyLocked()
	}
	name := cmp.Or(t.Tenant, OtherTenant)
	tn := ts.byName[name]
	if tn == nil {
		tn = ts.other
		if len(ts.list)-1 < cmp.Or(t.cfg.MaxTenants, DefaultMaxTenants) || d.evictIdleTenantLocked() {
			tn = &tenant{name: name}
			ts.byName[name] = tn
			ts.list = append(ts.list, tn)
		}
	}
	t.tenant = tn
}

// startTenancyLocked turns tenants on: the jobs waiting so far named
// none, so they are the other tenant's.
func (d *dispatchState) startTenancyLocked() {
	ts := &d.tenancy
	ts.on = true
	ts.other = &tenant{name: OtherTenant}
	ts.byName = map[string]*tenant{OtherTenant: ts.other}
	ts.list = []*tenant{ts.other}
	for _, wt := range d.queue {
		wt.t.tenant = ts.other
		ts.other.queue = append(ts.other.queue, wt)
	}
}

// evictIdleTenantLocked stops tracking an idle tenant, to make room for
// a new one; false when every tracked tenant is active.
func (d *dispatchState) evictIdleTenantLocked() bool {
	ts := &d.tenancy
	for i, tn := range ts.list {
		if tn != ts.other && tn.idle() {
			tn.evicted = true
			delete(ts.byName, tn.name)
			ts.list = slices.Delete(ts.list, i, i+1)
			return true
		}
	}
	return false
}

// activateLocked lifts the counter of tn, which is idle and about to have
// a job waiting or running, to the lowest counter of the active tenants.
func (d *dispatchState) activateLocked(tn *tenant) {
	low, found := 0.0, false
	for _, u := range d.tenancy.list {
		if u != tn && !u.idle() && (!found || u.served < low) {
			low, found = u.served, true
		}
	}
	if found {
		tn.served = max(tn.served, low)
	}
}

// chargeLocked notes that t's job, of tenant tn, got a worker.
func (d *dispatchState) chargeLocked(tn *tenant, t *Ticket) {
	if tn.idle() {
		d.activateLocked(tn)
	}
	tn.running++
	if !t.charged {
		t.charged = true
		tn.served += t.Cost / t.cfg.weight(tn.name)
		tn.cost += t.Cost
	}
}

// tenantQueueFullLocked reports whether t may not wait because its tenant
// has as many jobs waiting as it may.
func tenantQueueFullLocked(t *Ticket) bool {
	tn := t.tenant
	return tn != nil && t.cfg.TenantMaxQueue > 0 && len(tn.queue) >= t.cfg.TenantMaxQueue && t.Attempts == 0
}

// enqueueTenantLocked adds wt to its tenant's queue.
func (d *dispatchState) enqueueTenantLocked(tn *tenant, wt *waiter) {
	if tn.idle() {
		d.activateLocked(tn)
	}
	i, _ := slices.BinarySearchFunc(tn.queue, wt, compareWaiters)
	tn.queue = slices.Insert(tn.queue, i, wt)
}

// dequeueTenantLocked takes wt out of its tenant's queue.
func dequeueTenantLocked(tn *tenant, wt *waiter) {
	i, found := slices.BinarySearchFunc(tn.queue, wt, compareWaiters)
	if !found || tn.queue[i] != wt {
		i = slices.Index(tn.queue, wt)
	}
	if i >= 0 {
		tn.queue = slices.Delete(tn.queue, i, i+1)
	}
}

func compareWaiters(a, b *waiter) int { return a.t.compare(b.t) }

// dispatchTenantsLocked hands free slots to waiting jobs while tenants
// are on, one at a time, each to the job nextLocked picks.
func (p *Pool) dispatchTenantsLocked() {
	for {
		wt, w := p.nextLocked()
		if w == nil {
			return
		}
		p.dequeueLocked(wt)
		p.handOutLocked(wt, w)
	}
}

// nextLocked picks the waiting job that gets a free worker next while
// tenants are on, and the worker: among the waiting jobs of the highest
// priority, those of the tenant with the lowest counter first (of equal
// counters, the one whose first job came first), each tenant's in queue
// order; a job no free worker may serve lets the ones behind it pass,
// whatever their tenant, and then the next priority has its turn. nil
// when no free worker may take any waiting job.
func (p *Pool) nextLocked() (*waiter, *worker) {
	order := p.tenancy.order[:0]
	for _, tn := range p.tenancy.list {
		if len(tn.queue) > 0 {
			tn.cursor = 0
			order = append(order, tn)
		}
	}
	p.tenancy.order = order
	slices.SortFunc(order, func(a, b *tenant) int {
		return cmp.Or(cmp.Compare(a.served, b.served), cmp.Compare(a.queue[0].t.seq, b.queue[0].t.seq))
	})
	for {
		level, found := 0, false
		for _, tn := range order {
			if tn.cursor < len(tn.queue) && (!found || tn.queue[tn.cursor].t.Priority > level) {
				level, found = tn.queue[tn.cursor].t.Priority, true
			}
		}
		if !found {
			return nil, nil
		}
		for _, tn := range order {
			for ; tn.cursor < len(tn.queue) && tn.queue[tn.cursor].t.Priority == level; tn.cursor++ {
				wt := tn.queue[tn.cursor]
				w, anyFree := p.chooseLocked(wt.t)
				if w != nil {
					return wt, w
				}
				if !anyFree {
					return nil, nil
				}
			}
		}
	}
}

// TenantStats is what the pool knows of one tenant.
type TenantStats struct {
	Name    string  `json:"name"`
	Waiting int     `json:"waiting"`
	Running int     `json:"running"`
	Cost    float64 `json:"cost_served"`     // cost of the jobs given workers
	Service float64 `json:"virtual_service"` // that cost over the tenant's weight, lifted after idle spells
	// Backlog is how long the pool's workers are predicted to take to
	// finish the tenant's jobs, running and waiting, as Backlog plays the
	// queue out, in seconds.
	Backlog float64 `json:"backlog_seconds"`
}

// Tenants lists the tenants the pool tracks, OtherTenant first; none
// while no job has named a tenant.
func (p *Pool) Tenants() []TenantStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.tenancy.on {
		return nil
	}
	backlog := make(map[*tenant]float64, len(p.tenancy.list))
	p.backlogLocked(backlog)
	out := make([]TenantStats, 0, len(p.tenancy.list))
	for _, tn := range p.tenancy.list {
		out = append(out, TenantStats{Name: tn.name, Waiting: len(tn.queue), Running: tn.running, Cost: tn.cost, Service: tn.served, Backlog: backlog[tn]})
	}
	return out
}

// TenantOf is the tenant t's job counts for: its own, or OtherTenant;
// "" before it was admitted or while tenants are off.
func (t *Ticket) TenantOf() string {
	if t.tenant == nil {
		return ""
	}
	return t.tenant.name
}
