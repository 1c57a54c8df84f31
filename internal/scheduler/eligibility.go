package scheduler

import (
	"math/bits"
	"slices"

	"github.com/miles-rollout/miles-diffusion-router/internal/request"
)

// Which workers may take a request is decided in one place: the chain of
// constraints that brokenLocked checks, in order. Dispatch, hedging, a
// retry, the backlog, placement and the queue's errors all ask it, each a
// question that leaves out the constraints it has no use for, so that the
// rule cannot drift between them (a hedge's copy once went to a worker
// without the job's adapter). A new constraint is a constant here, its
// name, its case in brokenLocked, and what it reads of a job in
// classOf, then added to the questions below that need it;
// TestEligibilityChain then wants a worker that breaks it, and checks
// that dispatch, hedging, the backlog and placement refuse that worker
// unless their question leaves the constraint out.

// constraint is one rule of the chain, a bit; a set of them is what a
// question asks.
type constraint uint16

// The chain, in the order brokenLocked checks it. The slot and serving
// come first: on a busy fleet they turn most workers away, and dispatch
// reads from them whether any worker was free at all.
const (
	hasSlot      constraint = 1 << iota // a slot free under max_inflight; one job at a time on probation
	isServing                           // takes new jobs: not ejected, down, asleep, draining, suspect or held back; terminating only as the last resort
	makesTask                           // its /v1/models says it makes the request's task
	isPinned                            // the worker the request is pinned to, if it is
	onVersion                           // on the weight version the request asks for, if it does
	freshEnough                         // on base weights its version policy admits, if it has one (see staleness.go)
	untried                             // the request was not tried on it already (see Retry)
	holdsAdapter                        // holds the job's adapter at its latest publish, while adapters are placed
	chainEnd
)

// constraintNames name the chain's constraints, in its order.
var constraintNames = [...]string{"slot", "serving", "task", "pin", "version", "staleness", "untried", "adapter"}

// String names c, for tests that go through the chain by name.
func (c constraint) String() string { return constraintNames[bits.TrailingZeros16(uint16(c))] }

// What the users of the chain ask, each asking more than the last.
const (
	// couldServe: w is what the request needs, whatever it does now.
	// The queue's errors ask it: is some worker worth waiting for? A
	// worker on weights too stale for the job's policy is: an update
	// brings it to the newest.
	couldServe = makesTask | isPinned | onVersion
	// mayServe: and it is on weights the job's version policy admits,
	// and the request was not tried on it already. Placement asks it (is
	// a worker that may serve the job out of placement?), and dispatch of
	// a pinned request before it asks about the slot.
	mayServe = couldServe | freshEnough | untried
	// wouldServe: and it takes new jobs; a slot and the adapter come in
	// time. A retry and the backlog ask it.
	wouldServe = mayServe | isServing
	// takesNow: w may take the request now. Dispatch and hedging ask it.
	takesNow = chainEnd - 1
)

// A question is what a user of the chain asks of a worker: the
// constraints that apply, and the weight version an update under way
// brings ("" when the question is about now), which a worker that will
// be on it counts as on.
type question struct {
	asks     constraint
	upcoming string
}

// brokenLocked is the first constraint of the chain, among those q asks,
// that w breaks for t's request at now; 0 when w may take it.
func (p *Pool) brokenLocked(t *Ticket, w *worker, now int64, q question) constraint {
	switch {
	case q.asks&hasSlot != 0 && !fits(t.Job, t.cfg.MaxInflight, w, now):
		return hasSlot
	case q.asks&isServing != 0 && !w.serving(now) && !(w.stateAt(now) == Terminating && p.lastResortLocked(t, w, now)):
		return isServing
	case q.asks&makesTask != 0 && !w.can(t.Task):
		return makesTask
	case q.asks&isPinned != 0 && t.Pin != "" && w.url != t.Pin:
		return isPinned
	case q.asks&onVersion != 0 && t.WantVersion != "" && t.versionOn(w.life.version) != t.WantVersion && q.upcoming != t.WantVersion:
		return onVersion
	case q.asks&freshEnough != 0 && t.Staleness.Bounded() && !p.fleet.freshLocked(t.Staleness, w.life.version, q.upcoming):
		return freshEnough
	case q.asks&untried != 0 && slices.Contains(t.tried, w):
		return untried
	case q.asks&holdsAdapter != 0 && !p.holdsAdapterLocked(w, t):
		return holdsAdapter
	}
	return 0
}

// classKey is what the chain reads of a job: jobs alike in it break the
// same constraints on every worker, so the queue asks the chain about one
// of them for all (see queueindex.go).
type classKey struct {
	slots  int           // hasSlot: max_inflight of the job's config
	task   request.Task  // makesTask; and isServing, which asks whether another worker could serve it
	pin    string        // isPinned
	want   string        // onVersion, with policy
	stale  VersionPolicy // freshEnough
	tried  *Ticket       // untried: a job tried on some worker already is a class of its own
	policy *policy       // holdsAdapter, and onVersion: the version a worker serves with it
}

// classOf is the class of t, a job: each constraint adds what it reads
// of t.
func classOf(t *Ticket) classKey {
	k := classKey{slots: t.cfg.MaxInflight, task: t.Task, pin: t.Pin, want: t.WantVersion, stale: t.Staleness, policy: t.policy}
	if len(t.tried) > 0 {
		k.tried = t
	}
	return k
}

// mayTakeLocked reports whether w meets every constraint q asks for t's
// request at now.
func (p *Pool) mayTakeLocked(t *Ticket, w *worker, now int64, q question) bool {
	return p.brokenLocked(t, w, now, q) == 0
}
