package scheduler

import (
	"context"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/request"
)

// Ticket is one request's claim on the pool, carried in the request
// context from the handler, which acquires a worker for it, through
// reverse_proxy, which proxies to that worker, and back to the handler,
// which releases it. It has three parts: what the request asks (Request,
// the root's, set before it asks for a worker and unchanged after), the
// pool's claim on a worker for it (claim, private to the pool), and its
// cancellation and place in the registry of jobs by id (ticketctx.go,
// abort.go). What its attempts count of it (how many, which worker was
// blamed) is package attempt's, which the ticket carries for it
// (SetAttempt) and the pool never reads.
//
// Who may touch a ticket: the request's own goroutine sets it up and reads
// it; everything the pool decides (the claim) is written only under the
// pool's lock, while the request either holds that lock or waits for the
// pool to close its waiter's ready channel. After release, t.worker is
// nil and nothing but the request reads the ticket again; a held video
// job's ticket passes to the pool, which releases it when the job ends.
type Ticket struct {
	Request
	pool *Pool
	cfg  *Config
	claim

	cancel context.CancelCauseFunc // ends the job's context: see Cancel
	ctx    context.Context         // the job's context, which cancel ends
	job    jobContext              // what ctx points to: a context of its own costs no allocation
	parent context.Context         // the client's context, which ctx is a child of

	tracked bool    // in the pool's registry of jobs by id; guarded by the registry's lock
	sameRID *Ticket // the next job in the registry with the same id; guarded by the registry's lock
	aborted error   // why an abort ended the job: it gets no worker from then on

	attempt any // what the job's attempts keep of it: see SetAttempt
}

// Request is what a request asks of the pool, as the root builds it
// before it asks for a worker (Acquire, Admit): whether it is a job, and
// which workers may serve it. Nothing changes it after; a copy of the job
// (HedgeCopy) asks the same.
type Request struct {
	Route request.Route // the request's endpoint
	Pin   string        // URL of the only worker that may serve (the creator of a video or image job)
	Task  request.Task  // what the worker must be able to generate
	Job   bool          // a generation: takes a worker slot, may wait for one
	Cost  float64
	// Priority ranks t among waiting jobs before anything else does: a
	// higher one goes first (see compare).
	Priority int
	// Tenant names whose share of the pool t's job counts against (see
	// tenants.go); "": no tenant.
	Tenant string

	WantVersion string        // only a worker on this weight version may serve
	Staleness   VersionPolicy // only a worker on base weights this admits may serve a job

	Body []byte // a job's body, sent again when it runs again
	RID  string // the request's id (X-Request-Id), by which it can be aborted
}

// claim is the pool's claim on a worker for a ticket, and the ticket's
// place among waiting jobs: the pool's alone, written under its lock, but
// for sent, which the request's attempt notes (NoteSent) while it holds
// the worker.
type claim struct {
	worker        *worker // the worker holding the request now
	servedBy      string  // URL of the last worker chosen, kept after release
	servedVersion string  // the weight version of the worker chosen
	heldBack      bool    // its version policy held it back once: see noteHeldLocked
	started       int64   // when the job reached the head of its worker, Unix nanoseconds
	predicted     time.Duration
	tried         []*worker // workers a retry must avoid
	shunned       []*worker // workers that stalled on it: never tried again (see Retry)
	held          bool      // a video job answered at once and running on its worker
	sent          bool      // the request went to a worker: see NoteSent
	again         bool      // it runs again (see Retry): admitted before, it is never refused for a full queue
	ghost         bool      // its client left; the worker still computes it
	charged       bool      // its tenant was charged its cost (beside the other flags: no room of its own)
	probation     bool      // a job its worker got on probation (see OnProbation)
	seq           uint64    // arrival order among jobs: a job that runs again keeps its place
	key           float64   // its place by the queue order (see compare)
	arrived       int64     // when it first arrived, Unix nanoseconds
	dueWork       float64   // cost its worker had to process, when it got t, until t is done: the jobs before t, then t
	tenant        *tenant   // the tenant t's job counts against, while tenants are on
	waiter        *waiter   // its place in the queue while it waits
	policy        *policy   // the adapter t's job runs with, while adapters are declared
}

// NoteSent notes that t's request goes to the worker holding it: from then
// on, a job whose client leaves is still computed there (see ghosts.go).
func (t *Ticket) NoteSent() { t.sent = true }

// SetAttempt keeps a with t for t's attempts (package attempt), which
// find t, not a, in a request's context; the pool never reads it.
func (t *Ticket) SetAttempt(a any) { t.attempt = a }

// Attempt is what SetAttempt kept with t; nil before it.
func (t *Ticket) Attempt() any { return t.attempt }

// versionOn is the weight version t's job is served with by a worker on
// weight version v: with its adapter, while adapters are placed; "" while
// v is not known.
func (t *Ticket) versionOn(v string) string {
	if t.policy == nil || !t.Job || v == "" {
		return v
	}
	return t.policy.version(v)
}

// NewTicket makes the claim on p of a request dispatched by cfg. The
// request sets up the ticket's exported fields before it asks for a worker.
func (p *Pool) NewTicket(cfg *Config) *Ticket { return &Ticket{pool: p, cfg: cfg} }

// Config is how t's request is dispatched.
func (t *Ticket) Config() *Config { return t.cfg }

// ServedBy is the URL of the worker chosen for t last; it is kept after
// release.
func (t *Ticket) ServedBy() string { return t.servedBy }

// OnProbation reports whether t is a job the worker chosen for it last
// got on probation: its slot is to be released only once its answer is
// known to be whole or broken, not as the answer begins. Released as a
// success early, the slot would go to a second job, and the probation
// end, before the answer broke.
func (t *Ticket) OnProbation() bool { return t.probation }

// ServedVersion is the weight version of the worker chosen for t last.
func (t *Ticket) ServedVersion() string { return t.servedVersion }

// Predicted is how long t's job was predicted to run on its worker.
func (t *Ticket) Predicted() time.Duration { return t.predicted }

// Due is how long the worker holding t is predicted to take, from when
// it got t, to finish t's job (the jobs before it, then it), at the speed
// the pool predicts for that worker now. A worker that has completed
// nothing is predicted at the pool's median speed, which the first jobs
// completed anywhere set: a job given to it before then, predicted at
// the speed assumed before anything was learned, is predicted anew. 0
// once no worker holds t.
func (t *Ticket) Due() time.Duration {
	p := t.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	if t.worker == nil {
		return 0
	}
	return p.timeForLocked(t.worker, t.dueWork)
}

// Dial is the address of the worker holding t, "" when none does.
func (t *Ticket) Dial() string {
	if t.worker == nil {
		return ""
	}
	return t.worker.dial
}

// AnsweredBy notes that t's client got the answer of c, a copy of t's job
// that ran on another worker.
func (t *Ticket) AnsweredBy(c *Ticket) {
	t.servedBy, t.servedVersion = c.servedBy, c.servedVersion
}

// VersionServed is the weight version the router records for the worker
// that served t; for a worker whose model id is not known yet (its
// /v1/models did not answer), the pool's.
func (t *Ticket) VersionServed() string {
	if t.servedVersion != "" || t.pool == nil {
		return t.servedVersion
	}
	return t.versionOn(t.pool.Version())
}
