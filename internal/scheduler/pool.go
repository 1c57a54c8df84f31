package scheduler

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/clock"
	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/workerurl"
)

// Pool is a named set of sglang-diffusion workers and their state: the
// workers, the queue of jobs waiting for one, the health verdicts and the
// fleet's weights. The router's modules that name a pool share one, and
// it outlives config reloads.
//
// One mutex, mu, guards the registry, the queue, the fleet's state and
// every worker: a routing decision reads load, health and lifecycle at
// once and needs one consistent view of them, and a decision is a scan of
// microseconds even for a large fleet. Nothing outside this package can
// take it; a method whose name ends in Locked must be called with mu
// held, and every other method takes it itself. The state falls into
// groups, each a type of its own (registry, dispatchState, fleetState,
// placement): a method that reads or changes one group only is that
// group's, so that its receiver says what it touches; those that span
// groups are the Pool's.
//
// The lock order, outermost first; a goroutine holding one lock takes only
// locks after it:
//
//  1. a hedge's own lock, outside this package: the router's hedge holds
//     it while it asks a ticket's Due and HedgeCopy for a copy's worker
//  2. the fleet's operation token, then the fleet store's writing token,
//     then its mu (internal/fleet: a record is read back under the first
//     and written under the other two)
//  3. mu
//  4. videos' and images' own locks (JobOwners)
//
// The registry of jobs by request id (aborts) has a lock of its own,
// never held with any of these: every job takes it as it arrives and as
// it ends, and an abort takes it and then mu, one after the other.
type Pool struct {
	name   string
	clock  clock.Clock // the time of its decisions and its timers
	logger *zap.Logger
	bg     background    // the pool's own goroutines and timers
	due    chan struct{} // holds a token while the pool's record in storage is due to be written

	mu sync.Mutex
	registry
	dispatchState
	fleet     fleetState              // weights, updates and sleep
	placement                         // LoRA adapters and which workers hold them: see adapters.go
	held      map[string]*heldVideo   // video jobs running on their workers, by id
	ghosts    map[*Ticket]clock.Timer // jobs whose clients left, until their predicted end

	videos *JobOwners // which worker made each video job
	images *JobOwners // which worker made each image job
	aborts aborts     // the jobs in the router by request id, and what was aborted
}

// registry is which workers the pool has and why. A worker stays while
// anything keeps it: a registration, a loaded config that lists it, or a
// DNS answer that names it.
type registry struct {
	workers    []*worker             // in order of joining
	byDial     map[string]*worker    // one worker per address, by workerurl.AddressKey
	declared   map[string]int        // worker URL -> number of loaded configs listing it
	discovered map[string]int        // worker URL -> number of DNS answers naming it
	answers    map[string]*dnsAnswer // DNS lookup -> its last answer, while a loaded config names the lookup
	departing  map[string]*worker    // removed workers whose jobs have not ended, by workerurl.AddressKey
	unknown    atomic.Int32          // workers whose task types no probe has told yet; read without mu
	joins      uint64                // workers that joined, ever: each worker's join
}

// dispatchState is the state of routing decisions and of the queue.
type dispatchState struct {
	queue        waitingJobs // jobs waiting for a worker: see queueindex.go
	arrivals     []*waiter   // the same and some that left, in the order they came: see priority.go
	tenancy      tenancy     // the tenants' shares: see tenants.go
	seq          uint64      // arrival counter of the queue
	queuedCost   float64     // the cost of the jobs waiting
	long         bool        // the queue is long: see Adaptive
	largest      float64     // the largest cost of a job that arrived since the queue was last empty
	hedging      int         // copies of jobs running
	cands        []*worker   // scratch space of routing decisions
	open         []*worker   // scratch of a dispatch pass: see openLocked
	openHeld     bool
	openFor      openFor
	views        []Candidate     // the candidates as the strategy sees them
	speeds       []float64       // scratch space of the median speed
	defaultSpeed float64         // median learned speed, assumed for new workers
	initialSpeed float64         // the speed assumed while no worker has learned one
	completions  uint64          // jobs completed
	heldBack     heldCounts      // jobs each version policy held back: see staleness.go
	onRelease    []chan struct{} // closed when a worker is released: drains wait on them
	ejectionEnds int64           // when the redispatch timer fires, Unix nanoseconds; 0: not set
	redispatch   clock.Timer     // hands out jobs when an ejection ends
}

// openFor is the dispatch pass and the limit of jobs per worker the
// pool's open workers were read for.
type openFor struct {
	pass  uint64
	limit int
}

// New makes the pool named name, which logs to logger.
func New(name string, logger *zap.Logger) *Pool { return NewOn(clock.Real, name, logger) }

// NewOn is New on clock c: the scheduler's simulation runs a pool on a
// virtual clock.
func NewOn(c clock.Clock, name string, logger *zap.Logger) *Pool {
	p := &Pool{
		name:   name,
		clock:  c,
		logger: logger,
		registry: registry{
			byDial: make(map[string]*worker), declared: make(map[string]int), discovered: make(map[string]int),
			answers: make(map[string]*dnsAnswer), departing: make(map[string]*worker),
		},
		held:   make(map[string]*heldVideo),
		ghosts: make(map[*Ticket]clock.Timer),
		videos: NewJobOwners(DefaultOwnerLimit, DefaultOwnerTTL),
		images: NewJobOwners(DefaultOwnerLimit, DefaultOwnerTTL),
	}
	p.defaultSpeed, p.initialSpeed = DefaultInitialSpeed, DefaultInitialSpeed
	p.aborts.init(p.now)
	p.bg = newBackground(p.logger)
	p.due = make(chan struct{}, 1)
	return p
}

// now is the time on the pool's clock.
func (p *Pool) now() time.Time { return p.clock.Now() }

// Close stops what the pool runs on its own (catch-ups, timers of held
// video jobs and of ejections) and waits for it to end: the pool is done
// with, as when the last config using it is unloaded.
func (p *Pool) Close() error {
	p.mu.Lock()
	p.bg.cancel() // before the timers stop, so that none is set again
	for id, hv := range p.held {
		hv.timer.Stop()
		delete(p.held, id)
	}
	for t, timer := range p.ghosts {
		timer.Stop()
		delete(p.ghosts, t)
	}
	if p.redispatch != nil {
		p.redispatch.Stop()
	}
	p.mu.Unlock()
	p.bg.stop()
	return nil
}

// worker is one sglang-diffusion server. Its fields are guarded by the
// pool's mutex; read them through pool.snapshot.
type worker struct {
	// What every routing decision reads comes first, the most often read
	// fields first in each group, so that a decision, which scans the
	// whole fleet, reads few cache lines per worker.
	life   workerLife
	health workerHealth
	load   workerLoad
	caps   capabilities

	url        string // normalized: scheme://host[:port]
	dial       string // host:port as reverse_proxy dials it
	registered bool   // joined at run time (POST /workers), not from a config
	found      Found  // as a lookup last named it: its pod, and whether it is ready
	join       uint64 // which of the pool's joins brought it in: a call begun before it left says nothing of it since
	evidence   healthEvidence
	stats      workerStats
	adapter    workerAdapter
}

// workerLoad is the work a worker has been given.
type workerLoad struct {
	inflight   int     // jobs in flight
	work       float64 // their total cost
	headCost   float64 // cost of the oldest of them: the one running
	headSince  int64   // when it started running, Unix nanoseconds
	endsAt     int64   // when its jobs are predicted to be done, Unix nanoseconds
	speed      SpeedEstimate
	jobs       []*Ticket // jobs in flight, in dispatch order
	lastFinish int64     // when a job last ended, Unix nanoseconds
}

// workerHealth is the verdict on whether a worker works.
type workerHealth struct {
	down         bool  // failed its health probes
	unverified   bool  // read back from storage and not probed since: down until a probe passes
	suspect      bool  // a job of it overran its prediction: stalled
	ejectedUntil int64 // out after failed requests until then, Unix nanoseconds
	asleepUntil  int64 // out after it said it is asleep until then, Unix nanoseconds
	probation    bool  // back after an ejection: one job at a time, out at its first failure, until a job given on probation succeeds
	// ejectedDown says the failures that ejected the worker were all
	// connections it did not answer (Unreachable): it was down, and
	// health_passes passed probes end the ejection.
	ejectedDown bool
}

// healthEvidence is what the verdict on a worker's health rests on.
type healthEvidence struct {
	probeFails  int       // consecutive failed health probes
	probePasses int       // consecutive passed health probes
	lastProbe   int64     // Unix nanoseconds
	lastError   string    // of the last probe
	recentFails []failure // failed requests within the fail window
	lastFail    int64     // when the last failed request was counted, Unix nanoseconds
	ejectedAt   int64     // when the last ejection began, Unix nanoseconds
	ejections   uint      // ejections since the last cleanRunForgives successes in a row
	cleanRun    int       // successes since the last failure
	consecFails int       // failed requests since the last success
	naps        uint      // answers saying it is asleep since the last success
}

// failure is a failed request counted against a worker.
type failure struct {
	at       int64 // Unix nanoseconds
	answered bool  // it answered, badly: not a connection it did not answer (Unreachable)
}

// workerLife is where a worker is in the fleet's operations.
type workerLife struct {
	dead    bool   // held back by an operator (PUT /workers/{id})
	removed bool   // left the pool while jobs of it still ran
	state   State  // serving, draining, updating, stale or sleeping
	behind  lag    // missed an update: stale until a catch-up brings it to the pool's weights
	missed  bool   // stale because its last update got no answer: caught up once a probe passes
	version string // weight version the worker serves; "" until known
	source  string // where the router learned version: a Source constant, "" for SourceReported
	// unvouched says that, since a trainer declared the fleet's weights,
	// the router cannot vouch for what w holds: it did not match a
	// declaration's checksums, joined or missed an update after one, or
	// changed behind the router's back (see declare.go). It is stale,
	// whatever its lifecycle state, until a declaration names it, its
	// checksums match the declared ones, or an update from disk through
	// the router reaches it.
	unvouched bool
	// slept says that, unvouched, it answered a job as asleep: a trainer
	// may be moving its weights, so its own checksums tell nothing (see
	// sleptLocked) until a declaration names it or an update through the
	// router reaches it.
	slept bool
	// pausedAt is when a trainer paused the worker (pause_generation),
	// Unix nanoseconds; 0: not paused. It is a mark beside state, as dead
	// is, so that an update, a sleep or a wake leaves it paused.
	pausedAt int64
}

// workerStats are counts for reports; no decision reads them.
type workerStats struct {
	served   uint64  // requests answered
	jobsDone uint64  // generation jobs completed
	costDone float64 // their total cost
	failures uint64  // failed requests
	ejected  uint64  // ejections in all
}

// capabilities are what a worker's /v1/models says it can generate.
type capabilities struct {
	makes     request.Tasks // what the worker may be given
	taskTypes []string      // nil until a probe answers
	modelID   string        // the model its /v1/models names; "" until a probe answers
	probedAt  time.Time     // last capability probe attempt
}

// State is where a worker is. The fleet's operations move it
// through the first five; the others say what keeps a worker whose
// lifecycle state is serving from getting jobs now. Only serving workers
// get new jobs.
type State uint8

const (
	Serving     State = iota
	Draining          // finishing its jobs before a weight update
	Updating          // loading new weights
	Stale             // failed its last weight update, or holds weights the router cannot vouch for: out until it is on the fleet's
	Sleeping          // has released its GPU memory
	Dead              // held back by an operator
	Unhealthy         // failed its health probes
	Ejected           // out for a while after failed requests
	Suspect           // a job of it overran its prediction
	Paused            // paused by a trainer that moves its weights itself, and serving but for that
	NotReady          // its endpoint is neither ready nor serving (Kubernetes)
	Terminating       // its pod is terminating: a job only when no other worker would take it (Kubernetes)
)

var stateNames = [...]string{"serving", "draining", "updating", "stale", "sleeping", "dead", "unhealthy", "ejected", "suspect", "paused", "not_ready", "terminating"}

// StateCount is how many states a worker can be in: a State is below it.
const StateCount = len(stateNames)

// String names s as /workers and the metrics do.
func (s State) String() string { return stateNames[s] }

// stateAt is where w is at now (Unix nanoseconds).
func (w *worker) stateAt(now int64) State {
	switch {
	case w.life.dead:
		return Dead
	case w.life.state != Serving:
		return w.life.state
	case w.health.down:
		return Unhealthy
	case w.found.Condition == EndpointNotReady:
		return NotReady
	case now < w.health.ejectedUntil:
		return Ejected
	case now < w.health.asleepUntil: // before unvouched: a job on a fleet all asleep is told so at once
		return Sleeping
	case w.life.unvouched:
		return Stale
	case w.health.suspect:
		return Suspect
	case w.life.pausedAt != 0:
		return Paused
	case w.found.Condition == EndpointTerminating:
		return Terminating
	}
	return Serving
}

// serving reports whether w may be given new jobs at now.
func (w *worker) serving(now int64) bool {
	return w.stateAt(now) == Serving
}

// WorkerInfo is a copy of a worker's state, safe to read without the lock.
type WorkerInfo struct {
	URL         string
	Dial        string
	Source      string // what keeps it in the pool: registered, config, dns or kubernetes
	Namespace   string // its pod's, when the Kubernetes API found it
	Pod         string
	State       State // where the worker is now
	Lifecycle   State // where the fleet's operations put it
	Version     string
	VersionFrom string // where the router learned Version: a Source constant, "" while it knows none
	Inflight    int
	Served      uint64
	Failures    uint64
	ConsecFails int
	TaskTypes   []string // nil while unknown
	ProbeFails  int
	LastProbe   time.Time // zero: never probed
	LastError   string
	Jobs        uint64  // generation jobs completed
	Cost        float64 // their total cost
	Ejections   uint64
	EjectedTill time.Time // zero: not ejected
	Probation   bool      // back after an ejection: one job at a time until one succeeds
	PausedSince time.Time // when a trainer paused it; zero: not paused

	Speed           float64 // learned cost units per second; the pool's median while unknown
	SpeedLearned    bool
	WorkLeft        float64 // predicted cost still to process
	PredictionError float64 // moving average of |predicted - actual| / actual job time

	// While the pool places adapters: the one the worker holds ("" for
	// the base weights) and what placement does with it: ready, unknown
	// (not read back yet), stray (not what any request asks for), or
	// "switching to <adapter>".
	Adapter      string
	AdapterState string
	SwitchTime   float64 // its switches' learned time, seconds; 0: none yet
	// AdapterFailures counts its LoRA calls (reads, switches) that failed
	// in a row, and AdapterError says why the last one did; AdapterOut
	// says why placement leaves it out after FailuresOut of them
	// (OutUnreadable, OutSwitches), "" while it does not.
	AdapterFailures int
	AdapterError    string
	AdapterOut      string
}

func (p *Pool) infoLocked(w *worker) WorkerInfo {
	now := p.now().UnixNano()
	info := WorkerInfo{
		URL: w.url, Dial: w.dial, Source: p.sourceLocked(w), Namespace: w.found.Namespace, Pod: w.found.Pod,
		State: w.stateAt(now), Lifecycle: w.life.state, Version: w.life.version, VersionFrom: w.versionSource(),
		Inflight: w.load.inflight, Served: w.stats.served,
		Failures: w.stats.failures, ConsecFails: w.evidence.consecFails,
		TaskTypes: slices.Clone(w.caps.taskTypes),
		Speed:     p.speedOfLocked(w), SpeedLearned: w.load.speed.Value() > 0,
		WorkLeft: p.workLeftLocked(w, now), PredictionError: w.load.speed.RelErr(),
		ProbeFails: w.evidence.probeFails, LastError: w.evidence.lastError,
		Jobs: w.stats.jobsDone, Cost: w.stats.costDone, Ejections: w.stats.ejected,
		SwitchTime: w.adapter.cost, AdapterOut: p.adapterOutLocked(w, now),
	}
	if n := max(w.adapter.unread, w.adapter.failed); n > 0 {
		info.AdapterFailures, info.AdapterError = n, w.adapter.failure
	}
	info.Adapter, info.AdapterState = p.adapterInfoLocked(w)
	if now < w.health.ejectedUntil {
		info.EjectedTill = time.Unix(0, w.health.ejectedUntil)
	}
	if w.health.probation {
		info.Probation = true
	}
	if w.evidence.lastProbe > 0 {
		info.LastProbe = time.Unix(0, w.evidence.lastProbe)
	}
	if w.life.pausedAt != 0 {
		info.PausedSince = time.Unix(0, w.life.pausedAt)
	}
	return info
}

// Declare adds the workers a config lists. Declarations are counted so
// that a reload (new config declares, then old config undeclares) keeps the
// workers both list, and a failed reload undoes its own declarations.
func (p *Pool) Declare(urls []string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, u := range urls {
		p.declared[u]++
		if p.findLocked(u) == nil {
			p.addLocked(u)
		}
	}
	p.dispatchLocked()
	p.Changed()
}

// Undeclare withdraws a config's workers; a worker no loaded config lists
// and nobody registered at run time leaves the pool.
func (p *Pool) Undeclare(urls []string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, u := range urls {
		p.declared[u]--
		if p.declared[u] > 0 {
			continue
		}
		delete(p.declared, u)
		if w := p.findLocked(u); w != nil && !p.heldLocked(w) {
			p.removeLocked(w)
		}
	}
	p.Changed()
}

// heldLocked reports whether anything keeps w in the pool.
func (reg *registry) heldLocked(w *worker) bool {
	return w.registered || reg.declared[w.url] > 0 || reg.discovered[w.url] > 0
}

// sourceLocked names what keeps w in the pool, the longest-lived first: a
// registration outlives every config, and a config's list outlives the
// DNS answers.
func (reg *registry) sourceLocked(w *worker) string {
	switch {
	case w.registered:
		return "registered"
	case reg.declared[w.url] == 0 && reg.discovered[w.url] > 0:
		return w.found.source()
	}
	return "config"
}

// errTooManyWorkers refuses a registration beyond max_workers.
var errTooManyWorkers = errors.New("the pool has max_workers workers already")

// Register adds a worker, given by its canonical URL, at run time. It reports whether the worker is new;
// registering a known worker is a no-op apart from making it outlive the
// configs that list it.
func (p *Pool) Register(u string, maxWorkers int) (WorkerInfo, bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	w := p.findLocked(u)
	created := w == nil
	if created {
		if len(p.workers) >= maxWorkers {
			return WorkerInfo{}, false, errTooManyWorkers
		}
		w = p.addLocked(u)
	}
	w.registered = true
	p.dispatchLocked()
	p.Changed()
	return p.infoLocked(w), created, nil
}

// Remove takes a worker out of the pool. Requests already on it finish;
// they hold the worker and release it when they end.
func (p *Pool) Remove(url string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	w := p.findLocked(url)
	if w == nil {
		return false
	}
	p.removeLocked(w)
	p.Changed()
	return true
}

func (p *Pool) addLocked(u string) *worker {
	dial := workerurl.DialAddress(u)
	key := workerurl.AddressKey(dial)
	w := p.departing[key]
	if w != nil { // back before its last jobs ended: they still count
		delete(p.departing, key)
		w.url, w.life.removed = u, false
	} else {
		w = &worker{url: u, dial: dial, caps: capabilities{makes: request.Unprobed}}
	}
	p.joins++
	w.join = p.joins
	// After a declaration, one that names it vouches for it: out of the
	// pool, nothing watched what it holds, even for one back before its
	// last jobs ended.
	p.fleet.changedLocked(w)
	p.fleet.holdIfBehindLocked(w)
	p.forgetAdapterLocked(w)
	if w.caps.taskTypes == nil {
		p.unknown.Add(1)
	}
	p.workers = append(p.workers, w)
	p.byDial[key] = w
	return w
}

func (p *Pool) removeLocked(w *worker) {
	p.fleet.leaveLocked(w)
	if w.caps.taskTypes == nil {
		p.unknown.Add(-1)
	}
	delete(p.byDial, workerurl.AddressKey(w.dial))
	for i, x := range p.workers {
		if x == w {
			p.workers = append(p.workers[:i:i], p.workers[i+1:]...)
			break
		}
	}
	p.videos.ForgetWorker(w.url)
	p.images.ForgetWorker(w.url)
	w.life.pausedAt = 0 // the pause ends with it: registered again, it is a worker no trainer paused
	if w.load.inflight > 0 {
		w.life.removed = true
		p.departing[workerurl.AddressKey(w.dial)] = w
	}
}

// SetDead marks a worker dead (no new jobs) or alive again. Either ends
// a trainer's pause of it: the operator has taken it in hand.
func (p *Pool) SetDead(url string, dead bool) (WorkerInfo, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	w := p.findLocked(url)
	if w == nil {
		return WorkerInfo{}, false
	}
	w.life.dead, w.life.pausedAt = dead, 0
	if !dead {
		p.forgetAdapterLocked(w) // held back, perhaps to be restarted
	}
	p.fleet.holdIfBehindLocked(w) // back after an update it was held out of
	p.dispatchLocked()
	p.Changed()
	return p.infoLocked(w), true
}

// Worker returns a copy of one worker's state.
func (p *Pool) Worker(url string) (WorkerInfo, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	w := p.findLocked(url)
	if w == nil {
		return WorkerInfo{}, false
	}
	return p.infoLocked(w), true
}

// Snapshot returns a copy of every worker's state, in joining order.
func (p *Pool) Snapshot() []WorkerInfo {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]WorkerInfo, len(p.workers))
	for i, w := range p.workers {
		out[i] = p.infoLocked(w)
	}
	return out
}

// ServingCount is how many workers may take new jobs now: serving, and
// not out because their LoRA adapter cannot be read.
// Terminating workers count while none other serves: they take jobs then,
// as the last resort.
func (p *Pool) ServingCount() int {
	if n := p.countReadable(Serving); n > 0 {
		return n
	}
	return p.countReadable(Terminating)
}

// PausedCount is how many more workers would take new jobs now but for a
// trainer's pause.
func (p *Pool) PausedCount() int { return p.countReadable(Paused) }

// countReadable is how many workers are in state s now and not out
// because their LoRA adapter cannot be read.
func (p *Pool) countReadable(s State) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n, now := 0, p.now().UnixNano()
	for _, w := range p.workers {
		if w.stateAt(now) == s && p.adapterOutLocked(w, now) != OutUnreadable {
			n++
		}
	}
	return n
}

// ServingDials returns the dial addresses of the workers that may take new
// jobs now, for reverse_proxy's dynamic upstreams.
func (p *Pool) ServingDials() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	dials := make([]string, 0, len(p.workers))
	now := p.now().UnixNano()
	for _, w := range p.workers {
		if w.serving(now) {
			dials = append(dials, w.dial)
		}
	}
	return dials
}

// findLocked looks a worker up by URL; URLs that dial the same address name the
// same worker (http://h and http://h:80).
func (reg *registry) findLocked(url string) *worker {
	return reg.byDial[workerurl.AddressKey(workerurl.DialAddress(url))]
}

// Stats are the pool-wide figures.
type Stats struct {
	Queued     int
	ByPriority map[int]int // jobs waiting, by priority
	Completed  uint64      // jobs completed since the pool was made
	Version    string
	UpdatingTo string // the version an update in progress moves to
}

// Stats returns the pool-wide figures.
func (p *Pool) Stats() Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	byPriority := make(map[int]int, len(p.queue.levels))
	for _, l := range p.queue.levels {
		byPriority[l.priority] = l.waiting
	}
	return Stats{Queued: p.queue.n, ByPriority: byPriority, Completed: p.completions, Version: p.versionLocked(), UpdatingTo: p.fleet.target()}
}

// Version is the pool's weight version: that of the last update, or
// before any, the one most workers report.
func (p *Pool) Version() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.versionLocked()
}

// versionLocked is the pool's weight version: that of the last update, or
// before any, the one most workers report.
func (p *Pool) versionLocked() string {
	if p.fleet.version != "" {
		return p.fleet.version
	}
	count := map[string]int{}
	best := ""
	for _, w := range p.workers {
		if w.life.version == "" {
			continue
		}
		count[w.life.version]++
		if count[w.life.version] > count[best] {
			best = w.life.version
		}
	}
	return best
}

// Videos is which worker made each video job.
func (p *Pool) Videos() *JobOwners { return p.videos }

// Images is which worker made each image job.
func (p *Pool) Images() *JobOwners { return p.images }

// Name is the pool's name.
func (p *Pool) Name() string { return p.name }

// Changed marks the pool's record in storage as due to be written. It
// never blocks: writes coalesce, and the next one writes the state as it
// is then.
func (p *Pool) Changed() {
	select {
	case p.due <- struct{}{}:
	default:
	}
}

// Changes holds a token while a write of the pool's record is due.
func (p *Pool) Changes() <-chan struct{} { return p.due }

// Go runs f in the pool's background: with the pool's context, waited for
// when the pool closes, a panic logged rather than fatal. what names it in
// the log.
func (p *Pool) Go(what string, f func(ctx context.Context)) { p.bg.Go(what, f) }

// Logger is where the pool logs.
func (p *Pool) Logger() *zap.Logger { return p.logger }
