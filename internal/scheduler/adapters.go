package scheduler

import (
	"errors"
	"iter"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// LoRA adapters as policies. sglang-diffusion merges one adapter into a
// worker's weights for every later request (/v1/set_lora is worker-wide),
// and switching costs seconds to tens of seconds. So when a pool declares
// adapters, each worker holds one (or the base weights), a job runs only
// on a worker holding its own, and the pool decides which workers hold
// which (adapterplacement.go). What a worker holds is what the router set
// and then read back from /v1/list_loras; until then it serves nothing.

// Adapter is a LoRA policy a pool serves: what /v1/set_lora loads.
type Adapter struct {
	Name     string  `json:"name"`               // its lora_nickname, which requests name it by
	Path     string  `json:"path"`               // its lora_path
	Strength float64 `json:"strength,omitempty"` // 1 unless set
}

// PlacementConfig is how a pool places adapters on its workers.
type PlacementConfig struct {
	// SwitchPrior is how long a worker is assumed to take to switch
	// adapters before it has switched once; then its own switches say.
	SwitchPrior time.Duration
	// MaxSwitches bounds a worker's switches in any minute.
	MaxSwitches int
	// Turn is how long an adapter keeps its only worker while another
	// adapter with jobs waiting has none.
	Turn time.Duration
	// SwitchTimeout bounds each call that switches a worker's adapter
	// (/v1/set_lora, /v1/unmerge_lora_weights), and a read of it
	// (/v1/list_loras) when shorter than ReadTimeout.
	SwitchTimeout time.Duration
	// Retry is how long a worker whose adapter call failed waits before
	// it is called again.
	Retry time.Duration
}

// Placement defaults.
const (
	DefaultSwitchPrior   = 30 * time.Second
	DefaultMaxSwitches   = 4
	DefaultTurn          = time.Minute
	DefaultSwitchTimeout = time.Minute
	DefaultRetry         = 5 * time.Second
)

// ReadTimeout bounds a read of a worker's adapter: an idle worker answers
// /v1/list_loras at once (placement reads only workers without jobs), and
// every job that waits for the worker waits for the read.
const ReadTimeout = 5 * time.Second

// readTimeout is how long a read of a worker's adapter may take.
func (c *PlacementConfig) readTimeout() time.Duration { return min(ReadTimeout, c.SwitchTimeout) }

// Errors of adapters and their publishes.
var (
	ErrSamePath = errors.New("the adapter is loaded from this path already; a worker would not load it again")
)

// UnknownAdapterError refuses a request that names an adapter the pool
// does not serve.
type UnknownAdapterError struct {
	Name     string
	Declared []string
}

func (e *UnknownAdapterError) Error() string {
	return "adapter " + strconv.Quote(e.Name) + " is not served here; declared adapters: " + strings.Join(e.Declared, ", ")
}

// UnservableAdapterError ends the jobs of an adapter (or of the base
// weights) that no worker can serve: every worker that could is out of
// placement after its LoRA calls failed FailuresOut times in a row.
type UnservableAdapterError struct {
	Name   string // "" for the base weights
	Worker string // one of the workers out
	Last   string // why its last call failed
}

func (e *UnservableAdapterError) Error() string {
	what := "the base weights"
	if e.Name != "" {
		what = "adapter " + strconv.Quote(e.Name)
	}
	return "no worker can serve " + what + " now: every worker that could failed " + strconv.Itoa(FailuresOut) +
		" LoRA calls in a row (" + e.Worker + ": " + e.Last + ")"
}

// policy is a declared adapter as the pool serves it; the pool's base
// weights are one too, without a name, so that placement treats a request
// for no adapter as one more policy.
type policy struct {
	Adapter
	publish   int // the publishes since it was declared: its path's version
	declared  int // loaded configs declaring it
	switches  uint64
	switching float64 // seconds spent switching to it in all
	failures  uint64  // switches to it that failed

	tally  policyTally // what placement counts on each pass
	donors []donor     // scratch space of a pass: its holders that may leave it
}

// version is the weight version a worker on weight version v serves with
// pol: "<base>+lora:<name>@<publish>", v's LoRA part (of a fleet-wide
// set_lora before adapters were declared) replaced; the base alone for
// the base weights.
func (pol *policy) version(v string) string {
	base, _, _ := strings.Cut(v, LoraSuffix)
	if pol.Name == "" {
		return base
	}
	return base + LoraSuffix + pol.Name + "@" + strconv.Itoa(pol.publish)
}

// LoraSuffix starts the LoRA part of a weight version.
const LoraSuffix = "+lora:"

// placement is the pool's side of its adapters, guarded by the pool's
// mutex.
type placement struct {
	on       bool               // adapters are declared: jobs run only where theirs is
	base     policy             // the base weights
	stray    policy             // what a worker holds that no request asks for
	policies map[string]*policy // declared adapters by name
	order    []*policy          // the same, in order of declaration
	cfg      PlacementConfig
	switcher Switcher
	ticking  bool        // the placement's clock runs
	needy    []*policy   // scratch space of a pass
	adrift   []donor     // scratch space of a pass: donors that serve no policy
	moved    int         // jobs that arrived or ended since the last pass: see placementDueLocked
	shape    uint64      // the queue's shape at the last pass
	placing  atomic.Bool // on, read without the lock by every request
}

// each yields every policy: the base weights, the stray one and the
// declared adapters.
func (pl *placement) each() iter.Seq[*policy] {
	return func(yield func(*policy) bool) {
		if !yield(&pl.base) || !yield(&pl.stray) {
			return
		}
		for _, pol := range pl.order {
			if !yield(pol) {
				return
			}
		}
	}
}

// workerAdapter is what a worker holds and what placement does with it.
type workerAdapter struct {
	holds     *policy // what it holds: the base weights, an adapter, or a stray one
	publish   int     // the publish of holds it has loaded
	known     bool    // read back from /v1/list_loras since the last switch, restart or join
	switching bool    // stops taking jobs, to switch to target once its jobs end
	target    *policy // what it switches to
	seen      string  // the nickname its /v1/list_loras named last
	calling   bool    // a call to it is under way
	epoch     uint64  // bumped when its adapter is forgotten: a call begun before says nothing of it now
	called    int64   // when the call began, Unix nanoseconds
	since     int64   // when it began holding what it holds, Unix nanoseconds
	retryAt   int64   // a failed call is not repeated before then, Unix nanoseconds
	cost      float64 // its switches' learned time in seconds; 0: none yet
	recent    []int64 // when its switches of the last minute began, Unix nanoseconds
	last      SwitchResult
	unread    int    // reads of its adapter that failed in a row
	failed    int    // switches of it that failed in a row
	outUntil  int64  // after FailuresOut failed switches, placement switches it no more before then
	failure   string // why its last call failed
}

// FailuresOut is how many calls of one kind (reads, switches) to a
// worker's adapter fail in a row before placement takes the worker out:
// one failure may be a restart between probes, three are a worker whose
// LoRA endpoints are broken.
const FailuresOut = 3

// switchOutTime is how long a worker out for failed switches gets no
// switch; then it is tried once more.
const switchOutTime = time.Minute

// Why placement leaves a worker out after its LoRA calls failed.
const (
	// OutUnreadable: its adapter cannot be read, so it serves nothing.
	OutUnreadable = "unreadable"
	// OutSwitches: its switches fail, so it serves only what it holds.
	OutSwitches = "switches failing"
)

// out is why placement leaves the worker out after its LoRA calls
// failed, "" when it does not.
func (wa *workerAdapter) out(now int64) string {
	switch {
	case !wa.known && wa.unread >= FailuresOut:
		return OutUnreadable
	case wa.failed >= FailuresOut && now < wa.outUntil:
		return OutSwitches
	}
	return ""
}

// outFor reports whether the worker, out after failed LoRA calls, cannot
// serve pol's jobs: its adapter cannot be read, or it is read and is not
// pol, which it may not switch to. Until it is read after a failed
// switch, it may yet hold pol.
func (wa *workerAdapter) outFor(pol *policy, now int64) bool {
	switch wa.out(now) {
	case OutUnreadable:
		return true
	case OutSwitches:
		return wa.known && !wa.switching && (wa.holds != pol || wa.publish != pol.publish)
	}
	return false
}

// SwitchResult is how a worker's last switch went.
type SwitchResult struct {
	Adapter string // switched to; "" for the base weights
	Publish int
	OK      bool
	Status  int    // the worker's HTTP status; 502 when it could not be called, 504 when it did not answer in time
	Message string // what it said, or why the switch failed
	At      int64  // when it ended, Unix nanoseconds
}

// ready reports whether w holds what it holds for sure and keeps it: no
// call to it may change it meanwhile.
func (wa *workerAdapter) ready() bool { return wa.known && !wa.switching && !wa.calling }

// holdsAdapterLocked reports whether w may run t as far as adapters go:
// while the pool places adapters, a job runs only on a worker that holds
// its adapter, at its latest publish, and keeps it. Every choice of a
// worker for a job asks this, as the eligibility chain's adapter constraint.
func (p *Pool) holdsAdapterLocked(w *worker, t *Ticket) bool {
	if !p.placement.on || !t.Job {
		return true
	}
	wa := &w.adapter
	return wa.ready() && wa.holds == t.policy && wa.publish == t.policy.publish
}

// DeclareAdapters adds the adapters a config declares, and sets how they
// are placed; the config loaded last sets that. Declarations are counted,
// as workers' are, so that a reload keeps what both configs declare. An
// adapter declared again with another path is published anew: its
// holders load the new path before they serve it again.
func (p *Pool) DeclareAdapters(adapters []Adapter, cfg PlacementConfig) {
	if len(adapters) == 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	pl := &p.placement
	if pl.policies == nil {
		pl.policies = make(map[string]*policy)
	}
	pl.cfg = cfg
	for _, a := range adapters {
		pol := pl.policies[a.Name]
		if pol == nil {
			pol = &policy{Adapter: a}
			pl.policies[a.Name] = pol
			pl.order = append(pl.order, pol)
		} else if pol.Path != a.Path || pol.Strength != a.Strength {
			p.publishLocked(pol, a.Path, a.Strength)
		}
		pol.declared++
	}
	if !pl.on {
		p.startPlacementLocked()
	}
	p.dispatchLocked()
}

// UndeclareAdapters withdraws a config's adapters. One no loaded config
// declares leaves the pool: its holders hold a stray adapter, and its
// waiting jobs end with an UnknownAdapterError. Once none is declared,
// placement goes on until every worker is back on the base weights.
func (p *Pool) UndeclareAdapters(adapters []Adapter) {
	if len(adapters) == 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	pl := &p.placement
	for _, a := range adapters {
		pol := pl.policies[a.Name]
		if pol == nil {
			continue
		}
		if pol.declared--; pol.declared > 0 {
			continue
		}
		delete(pl.policies, a.Name)
		pl.order = slices.DeleteFunc(pl.order, func(x *policy) bool { return x == pol })
		p.retirePolicyLocked(pol)
	}
	p.dispatchLocked()
}

// retirePolicyLocked lets go of pol, no longer declared: its holders hold
// a stray adapter, a worker switching to it is read back (a call may be
// loading it), and its waiting jobs end.
func (p *Pool) retirePolicyLocked(pol *policy) {
	for _, w := range p.workers {
		wa := &w.adapter
		if wa.holds == pol {
			wa.holds = &p.placement.stray
		}
		if wa.target == pol {
			wa.switching, wa.target = false, nil
			p.forgetAdapterLocked(w)
		}
	}
	gone := &UnknownAdapterError{Name: pol.Name, Declared: p.adapterNamesLocked()}
	for wt := range p.queue.jobs() {
		if wt.t.policy == pol {
			wt.t.Cancel(gone)
		}
	}
}

// startPlacementLocked turns placement on: every worker's adapter is
// unknown until read back.
func (p *Pool) startPlacementLocked() {
	pl := &p.placement
	pl.on = true
	pl.placing.Store(true)
	for _, w := range p.workers {
		p.forgetAdapterLocked(w)
	}
	p.tickLocked()
}

// stopPlacementLocked turns placement off once no adapter is declared and
// every worker is known to be on the base weights: from then on every
// worker serves every job, as before any adapter was declared.
func (p *Pool) stopPlacementLocked() {
	pl := &p.placement
	if len(pl.order) > 0 || slices.ContainsFunc(p.workers, func(w *worker) bool {
		return !w.adapter.ready() || w.adapter.holds != &pl.base
	}) {
		return
	}
	pl.on = false
	pl.placing.Store(false)
}

// forgetAdapterLocked makes w's adapter unknown: it serves nothing until
// its /v1/list_loras is read (it joined, restarted, failed a job or was
// read back), and a call under way says nothing of it.
func (p *Pool) forgetAdapterLocked(w *worker) {
	if !p.placement.on {
		return
	}
	w.adapter.known = false
	w.adapter.epoch++
	if w.adapter.holds == nil {
		w.adapter.holds = &p.placement.stray
	}
}

// ResolveAdapter sets the adapter t's job runs with: name is what the
// request asks for, "" or the base model's id for the base weights. With
// no adapters declared, every name runs as it does without them.
func (p *Pool) ResolveAdapter(t *Ticket, name string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	pl := &p.placement
	if !pl.on {
		return nil
	}
	t.policy = &pl.base
	if name == "" || len(pl.order) == 0 || p.isBaseModelLocked(name) {
		return nil // with none declared (placement ends), every name is the base weights
	}
	pol := pl.policies[name]
	if pol == nil {
		return &UnknownAdapterError{Name: name, Declared: p.adapterNamesLocked()}
	}
	t.policy = pol
	return nil
}

// isBaseModelLocked reports whether name is the base model's id, as a
// worker's /v1/models gave it or an update named it.
func (p *Pool) isBaseModelLocked(name string) bool {
	if base, _, _ := strings.Cut(p.versionLocked(), LoraSuffix); name == base {
		return true
	}
	return slices.ContainsFunc(p.workers, func(w *worker) bool { return w.caps.modelID == name })
}

// adapterNamesLocked lists the declared adapters' names.
func (p *Pool) adapterNamesLocked() []string {
	names := make([]string, len(p.placement.order))
	for i, pol := range p.placement.order {
		names[i] = pol.Name
	}
	return names
}

// takePublishesLocked takes the record's publishes newer than the pool's;
// with unpublished, only for the adapters not published since the pool was
// made, as Restore does. The workers' adapters are read back from them
// before they serve.
func (p *Pool) takePublishesLocked(recs []AdapterRecord, unpublished bool) {
	for _, r := range recs {
		pol := p.placement.policies[r.Name]
		if pol != nil && r.Publish > pol.publish && (!unpublished || pol.publish == 0) {
			pol.Path, pol.Strength, pol.publish = r.Path, r.Strength, r.Publish
		}
	}
}

// AdaptersOn reports whether the pool has adapters declared: LoRA calls
// through the router are then publishes.
func (p *Pool) AdaptersOn() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.placement.order) > 0
}

// PlacesAdapters reports whether the pool places adapters now, so that
// every job must name its own. It takes no lock: it is asked on every
// job.
func (p *Pool) PlacesAdapters() bool { return p.placement.placing.Load() }

// AdapterPath is the path adapter name's latest publish loads; "" for
// an adapter not declared.
func (p *Pool) AdapterPath(name string) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if pol := p.placement.policies[name]; pol != nil {
		return pol.Path
	}
	return ""
}

// AdapterNames lists the declared adapters' names, in order of
// declaration.
func (p *Pool) AdapterNames() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.adapterNamesLocked()
}

// Publish makes path the adapter name's weights: from now on no job of it
// runs on a worker that loaded an earlier path, and its holders load the
// new one once their jobs end. It returns the holders, which the caller
// may wait for with WaitSwitched, and the adapter's weight version.
func (p *Pool) Publish(name, path string, strength float64) (holders []string, version string, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	pol := p.placement.policies[name]
	if pol == nil {
		return nil, "", &UnknownAdapterError{Name: name, Declared: p.adapterNamesLocked()}
	}
	if pol.Path == path {
		return nil, "", ErrSamePath
	}
	holders = p.publishLocked(pol, path, strength)
	p.dispatchLocked()
	p.Changed()
	return holders, pol.version(p.versionLocked()), nil
}

// publishLocked moves pol to path and sends its holders to load it. It
// returns those that serve now, which load it as soon as their jobs end;
// the others (down, asleep, held back) load it when they are back.
func (p *Pool) publishLocked(pol *policy, path string, strength float64) (holders []string) {
	pol.Path, pol.Strength = path, strength
	pol.publish++
	now := p.now().UnixNano()
	for _, w := range p.workers {
		wa := &w.adapter
		leaving := wa.switching && wa.target != pol
		if wa.holds == pol && !leaving || wa.switching && wa.target == pol {
			wa.switching, wa.target = true, pol
			if w.serving(now) {
				holders = append(holders, w.url)
			}
		}
	}
	return holders
}

// WaitSwitched waits, for at most timeout, until each worker named has
// ended a switch to adapter name's publish, or failed one, and returns
// how each went; a worker that left, or went on to another adapter, is
// not waited for.
func (p *Pool) WaitSwitched(stop <-chan struct{}, urls []string, name string, timeout time.Duration) map[string]SwitchResult {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for {
		p.mu.Lock()
		results, pending := p.switchResultsLocked(urls, name)
		if !pending {
			p.mu.Unlock()
			return results
		}
		changed := make(chan struct{})
		p.onRelease = append(p.onRelease, changed)
		p.mu.Unlock()
		select {
		case <-changed:
		case <-deadline.C:
			return results
		case <-stop:
			return results
		}
	}
}

// switchResultsLocked is how the workers named ended their switch to
// adapter name, and whether one still switches to it.
func (p *Pool) switchResultsLocked(urls []string, name string) (map[string]SwitchResult, bool) {
	pol := p.placement.policies[name]
	results := make(map[string]SwitchResult, len(urls))
	pending := false
	for _, u := range urls {
		w := p.findLocked(u)
		switch {
		case w == nil || pol == nil:
		case w.adapter.switching && w.adapter.target == pol:
			pending = true
		default:
			results[u] = w.adapter.last
		}
	}
	return results, pending
}

// AdapterStats are one adapter's figures, for /workers and the metrics.
type AdapterStats struct {
	Adapter
	Version       string  `json:"weight_version"` // its weight version on the pool's base weights
	Publish       int     `json:"publish"`        // publishes since it was declared
	Holders       int     `json:"holders"`        // workers holding it, ready or not
	Waiting       int     `json:"waiting"`        // jobs waiting for it
	WaitingCost   float64 `json:"waiting_cost"`   // their cost
	Switches      uint64  `json:"switches"`       // switches to it that succeeded
	SwitchSeconds float64 `json:"switch_seconds"` // their time in all
	Failures      uint64  `json:"switch_failures"`
}

// Adapters returns the figures of the declared adapters and, first, of
// the base weights (Name ""), while adapters are declared.
func (p *Pool) Adapters() []AdapterStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	pl := &p.placement
	if !pl.on {
		return nil
	}
	p.tallyLocked(p.now().UnixNano())
	base := p.versionLocked()
	out := make([]AdapterStats, 0, len(pl.order)+1)
	for _, pol := range append([]*policy{&pl.base}, pl.order...) {
		out = append(out, AdapterStats{
			Adapter: pol.Adapter, Version: pol.version(base), Publish: pol.publish,
			Holders: pol.tally.holders, Waiting: pol.tally.waiting, WaitingCost: pol.tally.queued,
			Switches: pol.switches, SwitchSeconds: pol.switching, Failures: pol.failures,
		})
	}
	return out
}

// adapterInfoLocked is what /workers says of w's adapter: its name (""
// for the base weights), and what placement does with it.
func (p *Pool) adapterInfoLocked(w *worker) (name, state string) {
	wa := &w.adapter
	if !p.placement.on {
		return "", ""
	}
	if wa.holds != nil {
		name = wa.holds.Name
	}
	if wa.holds == &p.placement.stray {
		name = wa.seen
	}
	switch {
	case wa.switching && wa.target != nil:
		return name, "switching to " + adapterName(wa.target.Name)
	case !wa.known:
		return name, "unknown"
	case wa.holds == &p.placement.stray || wa.publish != wa.holds.publish:
		return name, "stray"
	}
	return name, "ready"
}

// adapterOutLocked is why placement leaves w out after its LoRA calls
// failed, "" when it does not or places nothing.
func (p *Pool) adapterOutLocked(w *worker, now int64) string {
	if !p.placement.on {
		return ""
	}
	return w.adapter.out(now)
}

// adapterName names an adapter for people: the base weights are "base".
func adapterName(name string) string {
	if name == "" {
		return "base"
	}
	return name
}
