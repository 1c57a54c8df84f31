package scheduler

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/workerurl"
)

// Config is how one diffusion_router config hands jobs to workers.
type Config struct {
	Strategy      Strategy
	MaxInflight   int           // jobs a worker holds at once; 0: no limit
	Order         QueueOrder    // which waiting job goes first
	Timeout       time.Duration // longest wait in the queue; 0: the client's own
	MaxQueue      int           // jobs that may wait at once
	MaxAttempts   int           // workers a job may be sent to
	MaxPassedOver time.Duration // longest a job waits while higher priorities go first; 0: no limit
	HedgeAfter    float64       // a job overrunning its prediction this much gets a copy; 0: never
	Health        *HealthConfig // how failed requests count against a worker

	// Tenants: see tenants.go.
	TenantWeights  map[string]float64 // each tenant's share by weight; 1 unless set
	TenantMaxQueue int                // jobs one tenant may have waiting; 0: no limit but MaxQueue
	MaxTenants     int                // tenants tracked; 0: DefaultMaxTenants
}

// order is cfg's queue order; arrival order when it sets none.
func (cfg *Config) order() QueueOrder {
	if cfg.Order == nil {
		return FIFO{}
	}
	return cfg.Order
}

// Outcome is how a ticket's claim on a worker ended.
type Outcome int

const (
	Succeeded   Outcome = iota // the worker answered
	Refused                    // the worker refused the request (4xx): the request's fault, not the worker's
	Failed                     // the worker failed: a 5xx, an answer cut short or stalled, none in time, or an error not known to be Unreachable
	Unreachable                // no connection could be made, or it closed before any byte of an answer: the worker was down
	Abandoned                  // the client left; says nothing of the worker
	Asleep                     // the worker said it is asleep: put to sleep behind the router's back
	Overtaken                  // a copy of the job on another worker answered first: it overran, hung
)

// failed reports whether o counts as a failure of the worker.
func (o Outcome) failed() bool {
	return o == Failed || o == Unreachable || o == Overtaken
}

// Why a request gets no worker.
var (
	ErrNoWorker      = errors.New("No healthy workers available in the pool")
	ErrQueueFull     = errors.New("queue full")
	ErrQueueTimeout  = errors.New("queue timeout")
	ErrNoVersion     = errors.New("no worker is or will be on the weight version asked for")
	ErrAsleep        = errors.New("every worker that could serve it is asleep")
	ErrNoOtherWorker = errors.New("no worker it was not sent to may serve it")
)

// Ticket is one request's claim on the pool, carried in the request
// context from the handler, which acquires a worker for it, through
// reverse_proxy, which proxies to that worker, and back to the handler,
// which releases it.
//
// Who may touch a ticket: the request's own goroutine sets it up and reads
// it; everything the pool decides (worker, servedBy, servedVersion,
// started, predicted, tried) is written only under the pool's lock, while
// the request either holds that lock or waits for the pool to close its
// waiter's ready channel. After release, t.worker is nil and nothing but
// the request reads the ticket again; a held video job's ticket passes to
// the pool, which releases it when the job ends.
type Ticket struct {
	pool  *Pool
	cfg   *Config
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

	WantVersion   string        // only a worker on this weight version may serve
	Staleness     VersionPolicy // only a worker on base weights this admits may serve a job
	servedVersion string        // the weight version of the worker chosen
	heldBack      bool          // its version policy held it back once: see noteHeldLocked

	worker    *worker // the worker holding the request now
	servedBy  string  // URL of the last worker chosen, kept after release
	started   int64   // when the job reached the head of its worker, Unix nanoseconds
	predicted time.Duration
	tried     []*worker               // workers a retry must avoid
	shunned   []*worker               // workers that stalled on it: never tried again (see RetryElsewhere)
	held      bool                    // a video job answered at once and running on its worker
	Sent      bool                    // the request went to the worker
	ghost     bool                    // its client left; the worker still computes it
	charged   bool                    // its tenant was charged its cost (beside the other flags: no room of its own)
	probation bool                    // a job its worker got on probation (see OnProbation)
	Lookups   int                     // upstream lookups by reverse_proxy; more than one is a retry
	Attempts  int                     // times the request was sent to a worker
	Blamed    string                  // the worker whose 5xx made the job run again, if one did
	seq       uint64                  // arrival order among jobs: a job that runs again keeps its place
	key       float64                 // its place by the queue order (see compare)
	arrived   int64                   // when it first arrived, Unix nanoseconds
	Body      []byte                  // a job's body, sent again when it runs again
	dueWork   float64                 // cost its worker had to process, when it got t, until t is done: the jobs before t, then t
	tenant    *tenant                 // the tenant t's job counts against, while tenants are on
	waiter    *waiter                 // its place in the queue while it waits
	policy    *policy                 // the adapter t's job runs with, while adapters are declared
	cancel    context.CancelCauseFunc // ends the job's context: see Cancel
	ctx       context.Context         // the job's context, which cancel ends
	job       jobContext              // what ctx points to: a context of its own costs no allocation
	parent    context.Context         // the client's context, which ctx is a child of

	RID     string  // the request's id (X-Request-Id), by which it can be aborted
	tracked bool    // in the pool's registry of jobs by id; guarded by the registry's lock
	sameRID *Ticket // the next job in the registry with the same id; guarded by the registry's lock
	aborted error   // why an abort ended the job: it gets no worker from then on
}

// errCancelled is the cause of a ticket's context that Cancel ended.
type errCancelled struct{ cause error }

func (e *errCancelled) Error() string { return e.cause.Error() }
func (e *errCancelled) Unwrap() error { return e.cause }

// WithCancel makes t cancellable: its job waits for a worker and runs on
// it in the context returned, a child of ctx that carries t (TicketFrom).
func (t *Ticket) WithCancel(ctx context.Context) context.Context {
	t.parent = ctx
	var cancellable context.Context
	cancellable, t.cancel = context.WithCancelCause(ctx)
	t.job = jobContext{Context: cancellable, t: t}
	t.ctx = &t.job
	return t.ctx
}

// errOvertaken is the cause of a ticket's context that Overtake ended. It
// is a cancellation, as the client's leaving is: the attempt's answer is
// nobody's.
var errOvertaken = fmt.Errorf("a copy of the job on another worker answered first: %w", context.Canceled)

// Overtake ends the context of t's attempt, which a copy of its job (see
// CopyContext) overtook, with no cause an abort would give: the client
// gets the copy's answer. A job's one context serves its attempt too, so
// that a job that is never copied, nearly all of them, costs no context
// of its own for the chance.
func (t *Ticket) Overtake() {
	if t.cancel != nil {
		t.cancel(errOvertaken)
	}
}

// CopyContext returns the context of a copy of t's job running beside
// t's attempt, and what ends it: it ends when the client leaves or t's
// job is cancelled (Cancel), but not when the copy overtakes t's attempt
// (Overtake). A cancelled job whose attempt a copy overtook already has
// its answer: its copy runs on. t must have been made cancellable.
func (t *Ticket) CopyContext() (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(t.parent)
	stop := context.AfterFunc(t.ctx, func() {
		if CancelledBy(t.ctx) != nil {
			cancel(context.Cause(t.ctx))
		}
	})
	return ctx, func() { stop(); cancel(nil) }
}

// Cancelled returns the cause Cancel gave t's job, or nil: whatever error
// its attempt ended with (a connection closed, an answer cut off), that
// is what the job's client is to be told.
func (t *Ticket) Cancelled() error {
	if t.ctx == nil {
		return nil
	}
	return CancelledBy(t.ctx)
}

// Cancel ends t's job for cause, whether it waits or runs. A waiting job
// leaves the queue at once and never reaches a worker. A running one has
// its connection to the worker closed; sglang-diffusion cannot stop a
// generation, so its worker's slot stays counted until the job's
// predicted end, as for a client that left: freeLocked decides that, in
// one place, for every job released as abandoned.
func (t *Ticket) Cancel(cause error) {
	if t.cancel != nil {
		t.cancel(&errCancelled{cause})
	}
}

// CancelledBy returns the cause Cancel gave ctx's job, or nil.
func CancelledBy(ctx context.Context) error {
	if c, ok := errors.AsType[*errCancelled](context.Cause(ctx)); ok {
		return c.cause
	}
	return nil
}

// waiter is a job waiting in the pool's queue.
type waiter struct {
	t     *Ticket
	ready chan struct{} // closed once t.worker is set
	given func()        // called once t.worker is set, when its caller does not wait on ready: see Admit
	since int64         // when it joined the queue, Unix nanoseconds
	gone  bool          // it left the queue: see arrivals
	line  *line         // the line it waits in (see queueindex.go)
	at    int           // its place's index in the line's heap
}

// Acquire gives t a worker. A job that finds every fitting worker full
// waits in the pool's queue until one frees up (late binding), the client
// leaves, or the queue timeout passes.
func (p *Pool) Acquire(ctx context.Context, t *Ticket) error {
	p.mu.Lock()
	wt, err := p.admitLocked(t)
	p.mu.Unlock()
	if wt == nil {
		return err
	}
	return p.wait(ctx, t, wt)
}

// Admit is Acquire for a caller that does not wait: it gives t a worker
// now or a place in the queue, and calls given once t has its worker,
// under the pool's lock and before Admit returns if a worker is free. It
// reports why t may not wait, as Acquire does. t waits with no timeout,
// until it gets a worker. The scheduler's simulation (cmd/bench --mode
// schedule) runs thousands of jobs this way on one goroutine.
func (p *Pool) Admit(t *Ticket, given func()) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	wt, err := p.admitLocked(t)
	switch {
	case err != nil:
		return err
	case wt == nil:
		given()
	case wt.gone: // given a worker as it joined the queue
		given()
	default:
		wt.given = given
	}
	return nil
}

// admitLocked gives t a worker now, or a place in the queue, or the reason
// it may not wait.
func (p *Pool) admitLocked(t *Ticket) (*waiter, error) {
	if t.aborted != nil {
		return nil, t.aborted
	}
	if t.seq == 0 {
		p.seq++
		t.seq = p.seq
		t.arrived = p.now().UnixNano()
		p.noteQueueLengthLocked(t)
		t.key = t.cfg.order().Key(p.orderedLocked(t))
	}
	if t.Job && (t.Tenant != "" || p.tenancy.on) && (t.tenant == nil || t.tenant.evicted) {
		p.joinTenantLocked(t)
	}
	if p.placement.on && t.policy == nil {
		t.policy = &p.placement.base // adapters were declared after t was resolved
	}
	if !t.Job || p.queue.n == 0 || p.goesFirstLocked(t) { // a job never overtakes waiting ones
		if w, _ := p.chooseLocked(t); w != nil {
			p.assignLocked(t, w)
			return nil, nil
		}
	}
	if err := p.waitErrorLocked(t); err != nil {
		return nil, err
	}
	if p.queue.n >= t.cfg.MaxQueue && t.Attempts == 0 { // a job running again was admitted already
		return nil, ErrQueueFull
	}
	if tenantQueueFullLocked(t) {
		return nil, ErrTenantQueueFull
	}
	wt := p.enqueueLocked(t)
	p.jobMovedLocked(nil) // a prefetch slot may be free for the queue's head
	return wt, nil
}

// orderedLocked is t's job as a queue order sees it now.
func (p *Pool) orderedLocked(t *Ticket) Job {
	return Job{
		Cost: t.Cost, Seq: t.seq,
		Arrived: float64(t.arrived) / float64(time.Second),
		Runs:    t.Cost / p.defaultSpeed,
		Long:    p.long,
	}
}

// longQueue is how many of the largest jobs that came since the queue was
// last empty, per worker, the queue holds when it becomes long (see
// Adaptive). An open stream of jobs at 70% of the fleet's capacity makes
// it so too rarely to change its waits by 1%, and a rollout step of 64
// heavy-mix jobs per worker at once about a sixth of the way in (cmd/bench
// --mode schedule; docs/benchmarks.md).
const longQueue = 4

// noteQueueLengthLocked notes whether the queue is long, as t arrives
// (see Adaptive): the jobs waiting already take a new place in an order
// that reads it.
func (p *Pool) noteQueueLengthLocked(t *Ticket) {
	p.largest = max(p.largest, t.Cost)
	if p.long || !(p.queuedCost > longQueue*p.largest*float64(len(p.workers))) {
		return
	}
	p.long = true
	p.queue.rekey(func(t *Ticket) float64 { return t.cfg.order().Key(p.orderedLocked(t)) })
}

// goesFirstLocked reports whether t, a job, goes ahead of every waiting
// one. With tenants, only a higher priority is sure to: among jobs of one
// priority the tenants' counters decide, so t waits and dispatch decides.
func (d *dispatchState) goesFirstLocked(t *Ticket) bool {
	if d.tenancy.on {
		return t.Priority > d.queue.top()
	}
	return t.before(d.queue.first().wt.t)
}

// wait waits for wt's ticket to be given a worker.
func (p *Pool) wait(ctx context.Context, t *Ticket, wt *waiter) error {
	var expired chan struct{}
	if t.cfg.Timeout > 0 {
		expired = make(chan struct{})
		timer := p.clock.AfterFunc(t.cfg.Timeout, func() { close(expired) })
		defer timer.Stop()
	}
	var err error
	select {
	case <-wt.ready:
		return nil
	case <-ctx.Done():
		err = cmp.Or(CancelledBy(ctx), ctx.Err())
	case <-expired:
		err = ErrQueueTimeout
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.dequeueLocked(wt) {
		p.releaseLocked(t, Abandoned) // a worker came as we gave up: hand it on
	}
	return err
}

// Retry moves t off a worker that failed it, with what the attempt said
// of that worker, onto another one, waiting for it in its old place in
// the queue: the worker it leaves goes to the queue only once t is back
// in it. It reports an error when t got no worker.
func (p *Pool) Retry(ctx context.Context, t *Ticket, o Outcome) error {
	p.mu.Lock()
	p.offWorkerLocked(t, o)
	if !p.untriedServingLocked(t) {
		p.forgetTriedLocked(t)
	}
	return p.retryLocked(ctx, t)
}

// forgetTriedLocked lets t go back to the workers it tried: better a
// worker that failed once than waiting for ones that are out, which may
// stay out for minutes. The one that failed it last stays off while
// another serving worker may serve t: a worker that breaks its answers at
// once is the least loaded, and would take t straight back.
func (p *Pool) forgetTriedLocked(t *Ticket) {
	var last *worker
	if n := len(t.tried); n > 0 {
		last = t.tried[n-1]
	}
	t.tried = append(t.tried[:0], t.shunned...)
	if last == nil || slices.Contains(t.tried, last) {
		return
	}
	t.tried = append(t.tried, last)
	if !p.untriedServingLocked(t) {
		t.tried = t.tried[:len(t.tried)-1]
	}
}

// RetryElsewhere is Retry for a job whose worker stalled on it: that
// worker never gets it again, and when no other serving worker may serve
// it, t leaves its worker and gets ErrNoOtherWorker rather than wait.
func (p *Pool) RetryElsewhere(ctx context.Context, t *Ticket, o Outcome) error {
	p.mu.Lock()
	if w := t.worker; w != nil {
		t.shunned = append(t.shunned, w)
	}
	p.offWorkerLocked(t, o)
	if !p.untriedServingLocked(t) {
		p.dispatchLocked()
		p.mu.Unlock()
		return ErrNoOtherWorker
	}
	return p.retryLocked(ctx, t)
}

// retryLocked puts t back in the queue in its old place and waits for
// its next worker; it unlocks p.mu.
func (p *Pool) retryLocked(ctx context.Context, t *Ticket) error {
	wt, err := p.admitLocked(t)
	p.dispatchLocked()
	p.mu.Unlock()
	if wt == nil {
		return err
	}
	return p.wait(ctx, t, wt)
}

// Leave moves t off a worker that failed it, with what the attempt said
// of that worker, as Retry does, without giving it another yet: copies of
// its job still run. Retry may follow.
func (p *Pool) Leave(t *Ticket, o Outcome) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.offWorkerLocked(t, o)
	p.dispatchLocked()
}

// offWorkerLocked frees the worker holding t, if one does, and keeps t off it.
func (p *Pool) offWorkerLocked(t *Ticket, o Outcome) {
	if w := t.worker; w != nil {
		t.tried = append(t.tried, w)
		p.freeLocked(t, o)
	}
}

// untriedServingLocked reports whether a serving worker that t has not
// been sent to may serve it.
func (p *Pool) untriedServingLocked(t *Ticket) bool {
	now := p.now().UnixNano()
	return slices.ContainsFunc(p.workers, func(w *worker) bool {
		return p.mayTakeLocked(t, w, now, question{asks: wouldServe})
	})
}

// Release ends t's claim on its worker. It reports how long the worker is
// ejected for if this failure ejected it. A worker that failed t is one t
// tried, as for Retry: an answer that broke while its worker's slot was
// held (on probation) may run again, and not there.
func (p *Pool) Release(t *Ticket, o Outcome) time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	if w := t.worker; w != nil && o.failed() {
		t.tried = append(t.tried, w)
	}
	return p.releaseLocked(t, o)
}

// chooseLocked picks the worker for t by its strategy among the workers that
// may serve it and have a free slot. It also reports whether any serving
// worker had a free slot at all, so a dispatch pass can stop early.
func (p *Pool) chooseLocked(t *Ticket) (*worker, bool) { return p.chooseAmongLocked(t, p.workers) }

// chooseAmongLocked is chooseLocked among workers, which holds every
// worker of the pool that has a slot free for t.
func (p *Pool) chooseAmongLocked(t *Ticket, workers []*worker) (*worker, bool) {
	now := p.now().UnixNano()
	if t.Pin != "" {
		return p.choosePinnedLocked(t, now)
	}
	if p.fleet.holding && t.Job {
		return nil, false
	}
	cands, views := p.cands[:0], p.views[:0]
	anyFree, stale := false, false
	job, limit := t.Job, t.cfg.MaxInflight
	for _, w := range workers { // the hot loop
		// The chain's first constraint, inline: on a busy fleet it turns
		// most workers away, and calling the chain for each of them made
		// the decision half as slow again. The chain checks it again.
		if !fits(job, limit, w, now) {
			continue
		}
		broken := p.brokenLocked(t, w, now, question{asks: takesNow})
		// The chain checks serving right after the slot: any other
		// answer is from a free worker.
		anyFree = anyFree || broken != isServing
		stale = stale || broken == freshEnough
		if broken == 0 {
			cands = append(cands, w)
			views = append(views, p.viewLocked(w, now))
		}
	}
	p.cands, p.views = cands, views
	if len(cands) == 0 {
		if stale {
			p.noteHeldLocked(t)
		}
		return nil, anyFree
	}
	return cands[t.cfg.Strategy.Pick(Job{Cost: t.Cost, Seq: t.seq}, views)], true
}

// choosePinnedLocked is chooseLocked for t pinned to a worker: it goes
// there or nowhere. Whether that worker has a free slot is asked only of
// a job that may go to it. It looks at no other worker, so it cannot say
// that none is free: a dispatch pass goes on past a job pinned to a busy
// worker.
func (p *Pool) choosePinnedLocked(t *Ticket, now int64) (*worker, bool) {
	w := p.findLocked(t.Pin)
	switch {
	case w == nil || !p.mayTakeLocked(t, w, now, question{asks: mayServe}):
		return nil, true
	case !t.Job: // a poll or delete of a job the worker holds goes there, whatever its health
		return w, true
	}
	if p.brokenLocked(t, w, now, question{asks: takesNow}) != 0 {
		return nil, true
	}
	return w, true
}

// viewLocked is w as a strategy sees it at now (Unix nanoseconds).
func (d *dispatchState) viewLocked(w *worker, now int64) Candidate {
	return Candidate{URL: w.url, Inflight: w.load.inflight, WorkLeft: d.workLeftLocked(w, now), Speed: d.speedOfLocked(w)}
}

// prefetchWindow: a worker whose jobs are predicted to end within it gets
// its next job already, beyond max_inflight, so that the round trip of
// handing it over does not leave the worker idle. Against jobs of seconds
// that is one job more, at the end of the last, and the wait it can add
// behind a job is negligible; jobs that take almost no time go on to their
// workers, up to maxPrefetch beyond max_inflight, instead of each waiting
// in the queue for the one before it.
const (
	prefetchWindow = 5 * time.Millisecond
	maxPrefetch    = 8
)

// fits reports whether w has a slot at now for a request (a job, or not)
// under a limit of jobs per worker (0: none); only jobs take slots. A
// worker whose jobs are overdue by more than the window may be stalled: it
// is given one job beyond the limit at most.
func fits(job bool, limit int, w *worker, now int64) bool {
	if w.health.probation && job {
		return w.load.inflight == 0
	}
	if !job || limit == 0 || w.load.inflight < limit {
		return true
	}
	left := w.load.endsAt - now
	switch {
	case left < -int64(prefetchWindow):
		return w.load.inflight == limit
	case left < int64(prefetchWindow):
		return w.load.inflight < limit+maxPrefetch
	}
	return false
}

// updateEndsLocked predicts when w's jobs will be done, from when the
// running one started: what fits checks for every full worker.
func (d *dispatchState) updateEndsLocked(w *worker) {
	w.load.endsAt = w.load.headSince + int64(d.timeForLocked(w, w.load.work))
}

// versionOn is the weight version t's job is served with by a worker on
// weight version v: with its adapter, while adapters are placed; "" while
// v is not known.
func (t *Ticket) versionOn(v string) string {
	if t.policy == nil || !t.Job || v == "" {
		return v
	}
	return t.policy.version(v)
}

// waitErrorLocked says why t may not wait in the queue for a worker, or
// nil when it may: it is a job and some worker that may serve it could
// take it later. A job is not held for workers that are all asleep: a
// trainer that put the fleet to sleep is training, and a generation then
// is a mistake to report, not to hold. A worker t was sent to counts as
// asleep, never as awake: a job found it asleep by being sent there.
func (p *Pool) waitErrorLocked(t *Ticket) error {
	awake, sleeper := false, false
	now := p.now().UnixNano()
	for _, w := range p.workers {
		if !p.mayTakeLocked(t, w, now, question{asks: couldServe, upcoming: p.fleet.target()}) {
			continue
		}
		s := w.life.state == Sleeping || w.stateAt(now) == Sleeping
		sleeper = sleeper || s
		awake = awake || !s && p.mayTakeLocked(t, w, now, question{asks: untried})
	}
	switch {
	case awake && t.Job:
		return nil
	case sleeper && !awake:
		return ErrAsleep
	case t.WantVersion != "":
		return ErrNoVersion
	}
	return ErrNoWorker
}

func (p *Pool) assignLocked(t *Ticket, w *worker) {
	t.worker, t.servedBy, t.servedVersion = w, w.url, t.versionOn(w.life.version)
	t.probation = t.Job && w.health.probation
	if !t.Job {
		return
	}
	if t.tenant != nil {
		p.chargeLocked(t.tenant, t)
	}
	if w.load.inflight == 0 {
		p.startLocked(w, t, p.now().UnixNano())
	}
	w.load.inflight++
	w.load.jobs = append(w.load.jobs, t)
	w.load.work += t.Cost
	t.predicted = p.timeForLocked(w, t.Cost)
	p.updateEndsLocked(w)
	t.dueWork = p.workLeftLocked(w, p.now().UnixNano())
}

// startLocked notes that t has reached the head of w's jobs: a worker runs
// its jobs one at a time, in arrival order.
func (p *Pool) startLocked(w *worker, t *Ticket, now int64) {
	t.started = now
	w.load.headCost, w.load.headSince = t.Cost, now
}

func (p *Pool) releaseLocked(t *Ticket, o Outcome) (ejected time.Duration) {
	w := t.worker
	ejected = p.freeLocked(t, o)
	if o.failed() || o == Asleep {
		p.dispatchLocked() // news of the worker
	} else {
		p.jobMovedLocked(w)
	}
	return ejected
}

// freeLocked is releaseLocked but for handing the slot it frees to a
// waiting job.
func (p *Pool) freeLocked(t *Ticket, o Outcome) (ejected time.Duration) {
	w := t.worker
	if w == nil {
		return 0
	}
	if o == Abandoned && t.Job && t.Sent && !t.held && !t.ghost {
		p.keepGhostLocked(t)
		return 0
	}
	t.worker = nil
	p.wakeWaitersLocked()
	switch {
	case o == Succeeded:
		w.stats.served++
		w.evidence.consecFails = 0
	case o == Refused:
		w.stats.served++
	case o.failed():
		w.stats.failures++
		w.evidence.consecFails++
		p.forgetAdapterLocked(w) // it may have restarted: read its adapter back before its next job
	}
	ejected = p.noteOutcomeLocked(w, t, o)
	if !t.Job {
		return ejected
	}
	if t.tenant != nil {
		t.tenant.running--
	}
	now := p.now().UnixNano()
	w.load.lastFinish = now
	if o == Succeeded {
		// An answer released before the head's (two arriving together)
		// never started on this clock: it has no run time to learn from.
		if t.started != 0 {
			w.load.speed.Observe(t.Cost, time.Duration(now-t.started), t.predicted)
		}
		w.stats.jobsDone++
		w.stats.costDone += t.Cost
		p.completions++
		// The median changes when a worker learns its first speed, and
		// slowly otherwise.
		if w.load.speed.Samples() == 1 || p.completions%256 == 0 {
			p.refreshDefaultSpeedLocked()
		}
	}
	wasHead := len(w.load.jobs) > 0 && w.load.jobs[0] == t
	w.load.inflight--
	w.load.jobs = slices.DeleteFunc(w.load.jobs, func(x *Ticket) bool { return x == t })
	w.load.work -= t.Cost
	switch {
	case len(w.load.jobs) == 0:
		w.load.work = 0 // no float drift on an idle worker
	case wasHead:
		p.startLocked(w, w.load.jobs[0], now)
	}
	switch {
	case o == Overtaken:
		w.health.suspect = true // until a probe finds nothing overrunning
	case wasHead:
		w.health.suspect = false // the stalled job, if it was one, has ended
	}
	if w.life.removed && w.load.inflight == 0 {
		delete(p.departing, workerurl.AddressKey(w.dial))
	}
	p.updateEndsLocked(w)
	p.rearmGhostsLocked()
	return ejected
}

// keepGhostLocked keeps a job whose client left on its worker until the
// worker would have finished it: the GPU goes on computing it, and the
// next job is placed knowing that.
func (p *Pool) keepGhostLocked(t *Ticket) {
	t.ghost = true
	p.ghosts[t] = p.clock.AfterFunc(p.untilGhostEndsLocked(t), func() { p.endGhost(t) })
}

// untilGhostEndsLocked is how long from now t, a job whose client left,
// is predicted to run on: at the speed the pool knows for its worker now,
// as the stall check reckons, not at the one it knew when t started. One
// not yet started runs no later than its worker's last job.
func (p *Pool) untilGhostEndsLocked(t *Ticket) time.Duration {
	w := t.worker
	end := w.load.endsAt
	if t.started > 0 {
		end = t.started + int64(p.timeForLocked(w, t.Cost))
	}
	return max(time.Duration(end-p.now().UnixNano()), 0)
}

// rearmGhostsLocked moves the ends of the jobs whose clients left to what
// the pool knows after a job ended: a speed learned (in a cold pool, the
// first answer turns a guess of minutes into seconds), or a job that
// started. A timer that has fired may fire again; endGhost lets go once.
func (p *Pool) rearmGhostsLocked() {
	for t, timer := range p.ghosts {
		timer.Reset(p.untilGhostEndsLocked(t))
	}
}

// endGhost lets go of a job whose client left, at its predicted end.
func (p *Pool) endGhost(t *Ticket) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.ghosts[t]; ok {
		delete(p.ghosts, t)
		p.releaseLocked(t, Abandoned)
	}
}

// dispatchLocked hands free slots to waiting jobs, in queue order; a job
// that no free worker may serve lets the ones behind it pass.
func (p *Pool) dispatchLocked() {
	p.dispatchJobsLocked()
	if p.placement.on {
		p.placeLocked()
	}
}

// jobMovedLocked is dispatchLocked after a job arrived or ended, freeing
// freed (nil: none): placement looks again only when the job calls for it
// (see placementDueLocked).
func (p *Pool) jobMovedLocked(freed *worker) {
	p.dispatchJobsLocked()
	if p.placement.on && p.placementDueLocked(freed, p.now().UnixNano()) {
		p.placeLocked()
	}
}

// dispatchJobsLocked is dispatchLocked without placement.
func (p *Pool) dispatchJobsLocked() {
	p.dispatchPassedOverLocked()
	p.dispatchQueueLocked()
}

// dispatchQueueLocked hands free slots to waiting jobs, one at a time,
// each to the job nextLocked picks.
func (p *Pool) dispatchQueueLocked() {
	p.queue.pass++
	for {
		wt, w := p.nextLocked()
		if w == nil {
			return
		}
		p.dequeueLocked(wt)
		p.handOutLocked(wt, w)
	}
}

// nextLocked picks the waiting job that gets a free worker next in a
// dispatch pass, and the worker; nil when no free worker may take any
// waiting job. A job that no free worker may serve lets the ones behind
// it pass, and so does the rest of its class for the rest of the pass:
// they break the same constraints, and a worker given a job in the pass
// can only have fewer slots free.
func (p *Pool) nextLocked() (*waiter, *worker) {
	for {
		l := p.queue.next()
		if l == nil {
			return nil, nil
		}
		wt := l.head().wt
		w, anyFree := p.chooseAmongLocked(wt.t, p.openLocked(wt.t.cfg.MaxInflight))
		switch {
		case w != nil:
			return wt, w
		case !anyFree:
			return nil, nil
		}
		l.class.blocked = p.queue.pass
	}
}

// openLocked is the workers that had a slot free for jobs under a limit
// of limit jobs per worker when they were first asked for in this pass:
// no worker frees up during a pass, so its jobs need look at no other.
// The pass reads the workers once, not once for each job it asks about.
// A worker switching its adapter, or whose adapter is not known, takes no
// job: placement can keep hundreds of them so for seconds.
func (p *Pool) openLocked(limit int) []*worker {
	if p.openFor != (openFor{p.queue.pass, limit}) {
		now := p.now().UnixNano()
		open := p.open[:0]
		placing := p.placement.on
		for _, w := range p.workers {
			if fits(true, limit, w, now) && (!placing || w.adapter.ready()) {
				open = append(open, w)
			}
		}
		p.open, p.openFor = open, openFor{p.queue.pass, limit}
	}
	return p.open
}

// handOutLocked gives wt's job, taken out of the queue, worker w.
func (p *Pool) handOutLocked(wt *waiter, w *worker) {
	p.assignLocked(wt.t, w)
	close(wt.ready)
	if wt.given != nil {
		wt.given()
	}
}

func (p *Pool) enqueueLocked(t *Ticket) *waiter {
	wt := &waiter{t: t, ready: make(chan struct{}), since: p.now().UnixNano()}
	if p.queue.n == 0 {
		p.queuedCost = 0 // no float drift carried into an empty queue
		p.long, p.largest = false, t.Cost
	}
	if tn := t.tenant; tn != nil {
		if tn.idle() {
			p.activateLocked(tn)
		}
		tn.waiting++
	}
	p.queue.add(wt)
	t.waiter = wt
	p.queuedCost += t.Cost
	p.arriveLocked(wt)
	return wt
}

// compare orders waiting jobs: by priority, then by the queue order, then
// by arrival. A job running again keeps its arrival, so its place.
func (t *Ticket) compare(u *Ticket) int {
	return cmp.Or(cmp.Compare(u.Priority, t.Priority), cmp.Compare(t.key, u.key), cmp.Compare(t.seq, u.seq))
}

// before reports whether t goes ahead of u in the queue.
func (t *Ticket) before(u *Ticket) bool { return t.compare(u) < 0 }

// dequeueLocked takes a waiter out of the queue; false means it had already
// been given a worker.
func (d *dispatchState) dequeueLocked(wt *waiter) bool {
	if wt.gone {
		return false
	}
	d.queue.remove(wt)
	if tn := wt.t.tenant; tn != nil {
		tn.waiting--
	}
	wt.gone, wt.t.waiter = true, nil
	d.queuedCost -= wt.t.Cost
	return true
}

// speedOfLocked is w's learned speed, or the pool's median speed while w has
// completed nothing.
func (d *dispatchState) speedOfLocked(w *worker) float64 {
	if w.load.speed.Value() > 0 {
		return w.load.speed.Value()
	}
	return d.defaultSpeed
}

// DefaultInitialSpeed is the speed, in cost units per second, assumed for
// every worker until one has completed a job: a 20-step 1024x1024 image in
// 20 s, slower than an H100 runs FLUX (6.7 s an image), so that the first
// jobs are not declared late on a guess.
const DefaultInitialSpeed = 1

// SetInitialSpeed sets the speed, in cost units per second, assumed for
// every worker while none of the pool's workers has completed a job; the
// config loaded last sets it.
func (p *Pool) SetInitialSpeed(speed float64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.initialSpeed = speed
	p.refreshDefaultSpeedLocked()
}

// refreshDefaultSpeedLocked sets the speed assumed for new workers to the
// median of the learned ones, or the initial speed while there are none.
func (p *Pool) refreshDefaultSpeedLocked() {
	speeds := p.speeds[:0]
	for _, w := range p.workers {
		if w.load.speed.Value() > 0 {
			speeds = append(speeds, w.load.speed.Value())
		}
	}
	p.speeds = speeds
	if len(speeds) == 0 {
		p.defaultSpeed = p.initialSpeed
		return
	}
	slices.Sort(speeds)
	p.defaultSpeed = speeds[len(speeds)/2]
}

// maxPrediction bounds a predicted time, so that no prediction overflows
// a time.Duration or an end time.
const maxPrediction = 30 * 24 * time.Hour

// timeForLocked is how long w is predicted to take over work of cost.
func (d *dispatchState) timeForLocked(w *worker, cost float64) time.Duration {
	return time.Duration(min(cost/d.speedOfLocked(w), maxPrediction.Seconds()) * float64(time.Second))
}

// workLeftLocked is the predicted cost w still has to process at now (Unix
// nanoseconds): its jobs' costs, less what the running one has done.
func (d *dispatchState) workLeftLocked(w *worker, now int64) float64 {
	if w.load.inflight == 0 {
		return 0
	}
	done := float64(now-w.load.headSince) / float64(time.Second) * d.speedOfLocked(w)
	return w.load.work - min(w.load.headCost, max(0, done))
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

// OutcomeOf tells how the exchange with the worker ended, as evidence of
// the worker's health: a 5xx is the worker's failure, as Envoy counts
// them; a 4xx is the request's fault and says nothing of the worker.
func OutcomeOf(clientCtx context.Context, err error, status int) Outcome {
	switch {
	case clientCtx.Err() != nil:
		return Abandoned
	case err != nil, status >= 500:
		return Failed
	case status >= 400:
		return Refused
	}
	return Succeeded
}
