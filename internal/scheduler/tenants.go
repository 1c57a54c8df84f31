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
	served  float64 // virtual service: cost given workers / weight
	cost    float64 // cost given workers, for the metrics
	waiting int     // its jobs waiting
	running int     // its jobs holding a worker
	evicted bool    // no longer tracked: a ticket still naming it joins again
	lines   []*line // its waiting jobs, a line for each class (see queueindex.go)
	first   *line   // the line of its first job in compare order
}

func (tn *tenant) idle() bool { return tn.waiting == 0 && tn.running == 0 }

// tenancy is a pool's tenants. It is off until a job names a tenant, and
// nothing of it is touched while off.
type tenancy struct {
	on     bool
	byName map[string]*tenant
	list   []*tenant // tracked, OtherTenant first
	other  *tenant
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
	d.queue.moveTo(ts.other)
	ts.other.waiting = d.queue.n
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
		d.serveLocked(tn, t.Cost/t.cfg.weight(tn.name))
		tn.cost += t.Cost
	}
}

// tenantQueueFullLocked reports whether t may not wait because its tenant
// has as many jobs waiting as it may.
func tenantQueueFullLocked(t *Ticket) bool {
	tn := t.tenant
	return tn != nil && t.cfg.TenantMaxQueue > 0 && tn.waiting >= t.cfg.TenantMaxQueue && !t.again
}

// serveLocked adds x to tn's counter.
func (d *dispatchState) serveLocked(tn *tenant, x float64) {
	tn.served += x
	d.queue.rerank(tn)
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
	v := p.newBacklogView(true)
	if v == nil {
		return nil
	}
	p.mu.Lock()
	out, tenants := p.tenantsLocked(v)
	p.mu.Unlock()
	backlog := make(map[*tenant]float64, len(tenants))
	v.playOut(backlog)
	for i, tn := range tenants {
		out[i].Backlog = backlog[tn]
	}
	return out
}

// tenantsLocked is Tenants, while tenants are on, but for the backlogs,
// and the tenants they are of, in its order; it copies into v what plays
// the backlogs out, which is done without the lock, a step for each
// waiting job.
func (p *Pool) tenantsLocked(v *backlogView) ([]TenantStats, []*tenant) {
	tenants := slices.Clone(p.tenancy.list)
	out := make([]TenantStats, 0, len(tenants))
	for _, tn := range tenants {
		out = append(out, TenantStats{Name: tn.name, Waiting: tn.waiting, Running: tn.running, Cost: tn.cost, Service: tn.served})
	}
	p.copyBacklogLocked(v)
	return out, tenants
}

// TenantOf is the tenant t's job counts for: its own, or OtherTenant;
// "" before it was admitted or while tenants are off.
func (t *Ticket) TenantOf() string {
	if t.tenant == nil {
		return ""
	}
	return t.tenant.name
}
