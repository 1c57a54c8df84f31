package scheduler

import (
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// A job can be aborted by its request id, as SGLang's POST /abort_request
// aborts one, by a prefix of ids (a whole rollout step), or with every
// other job of the pool. A waiting job leaves the queue and never reaches
// a worker; a running one is released, its worker's slot counted until the
// job's predicted end (see Ticket.Cancel). Since miles resends a request
// that failed, any error included, up to 60 times, the pool remembers what
// it aborted for a while and refuses the resends at once, never queued.

// Bounds and default of the abort memory.
const (
	MaxAbortedIDs      = 100_000         // aborted request ids remembered at once; the oldest go first
	MaxAbortedPrefixes = 1_000           // aborted id prefixes remembered at once; the oldest go first
	DefaultAbortMemory = 5 * time.Minute // how long they are remembered: miles resends for about a minute
)

// Abort names the jobs an abort ends: those of one request id, those whose
// id starts with a prefix, or all of the pool's.
type Abort struct {
	RID    string
	Prefix string
	All    bool
	By     string        // how the abort was asked for, quoted in the jobs' answers
	Memory time.Duration // how long the id, the prefix or (for All) each job's id stays refused; 0: not at all
}

// AbortCounts are the jobs an abort ended, by where they were.
type AbortCounts struct {
	Waiting int // left the queue (or were about to join it): no worker saw them
	Running int // had left the queue: released from their worker, which finishes them
}

// AbortStats are the pool's aborts so far: the jobs ended, and the
// requests refused on arrival because an abort remembered their id.
type AbortStats struct {
	Waiting uint64 `json:"waiting"`
	Running uint64 `json:"running"`
	Resent  uint64 `json:"resent"`
}

// AbortedError is why an aborted job ended, and the answer to a request
// whose id an abort still remembers.
type AbortedError struct {
	RID   string
	By    string
	Until time.Time // of a refused request: when its id or prefix is forgotten; zero for the job the abort ended
}

func (e *AbortedError) Error() string {
	if e.Until.IsZero() {
		return fmt.Sprintf("request %q was aborted by %s", e.RID, e.By)
	}
	return fmt.Sprintf("request %q was aborted by %s; it is refused until %s, resends included",
		e.RID, e.By, e.Until.UTC().Format(time.RFC3339))
}

// aborts is a pool's registry of the jobs in the router by request id,
// and its memory of what it aborted. Its lock is its own and is never
// held with the pool's: every job passes through it twice, and a routing
// decision should not wait for that.
type aborts struct {
	mu sync.Mutex
	// live holds the jobs between Track and Untrack by request id; jobs
	// that share an id (two clients that chose the same) are chained
	// through Ticket.sameRID.
	live     map[string]*Ticket
	ids      memo // aborted request ids -> the abort's By
	prefixes memo // aborted id prefixes -> the abort's By

	waiting, running, resent atomic.Uint64
}

// init makes a an empty registry whose memory reads the clock now.
func (a *aborts) init(now func() time.Time) {
	a.live, a.ids, a.prefixes = make(map[string]*Ticket), newMemo(MaxAbortedIDs), newMemo(MaxAbortedPrefixes)
	a.ids.now, a.prefixes.now = now, now
}

// Track registers job t under its request id t.RID, so that an abort can
// find it, or refuses it with an *AbortedError when an abort remembers
// its id or a prefix of it. t must be made cancellable (WithCancel)
// before. Every Track that succeeds is paired with an Untrack.
func (p *Pool) Track(t *Ticket) error {
	a := &p.aborts
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.refusedLocked(t.RID); err != nil {
		a.resent.Add(1)
		return err
	}
	t.sameRID, t.tracked = a.live[t.RID], true
	a.live[t.RID] = t
	return nil
}

// Untrack takes t out of the registry, if an abort has not already.
func (p *Pool) Untrack(t *Ticket) {
	a := &p.aborts
	a.mu.Lock()
	defer a.mu.Unlock()
	if !t.tracked {
		return
	}
	t.tracked = false
	head := a.live[t.RID]
	switch {
	case head == t && t.sameRID == nil:
		delete(a.live, t.RID)
	case head == t:
		a.live[t.RID] = t.sameRID
	default:
		for x := head; x != nil; x = x.sameRID {
			if x.sameRID == t {
				x.sameRID = t.sameRID
				break
			}
		}
	}
	t.sameRID = nil
}

// refusedLocked says why a job with request id rid may not run: an abort
// remembers rid, or a prefix of it.
func (a *aborts) refusedLocked(rid string) error {
	e, ok := a.ids.get(rid)
	if !ok {
		e, ok = a.prefixes.find(func(prefix string) bool { return strings.HasPrefix(rid, prefix) })
	}
	if !ok {
		return nil
	}
	return &AbortedError{RID: rid, By: e.value, Until: time.Unix(0, e.expires)}
}

// Abort ends the jobs ab names, waiting or running, and remembers their
// ids (or the prefix) for ab.Memory. A waiting job's request gets its
// *AbortedError from Acquire; a running one's context ends with it.
func (p *Pool) Abort(ab Abort) AbortCounts {
	victims := p.aborts.take(ab)
	p.mu.Lock()
	c := p.endLocked(victims, ab.By)
	p.mu.Unlock()
	p.aborts.waiting.Add(uint64(c.Waiting))
	p.aborts.running.Add(uint64(c.Running))
	return c
}

// take takes the jobs ab names out of the registry and remembers ab.
func (a *aborts) take(ab Abort) []*Ticket {
	a.mu.Lock()
	defer a.mu.Unlock()
	var victims []*Ticket
	if head := a.live[ab.RID]; ab.RID != "" && head != nil {
		victims = a.unlinkAllLocked(victims, ab.RID, head)
	}
	for rid, head := range a.live {
		if ab.All || ab.Prefix != "" && strings.HasPrefix(rid, ab.Prefix) {
			victims = a.unlinkAllLocked(victims, rid, head)
		}
	}
	if ab.Memory <= 0 {
		return victims
	}
	switch {
	case ab.Prefix != "":
		a.prefixes.put(memoEntry{id: ab.Prefix, value: ab.By}, ab.Memory)
	case ab.RID != "":
		a.ids.put(memoEntry{id: ab.RID, value: ab.By}, ab.Memory)
	}
	if ab.All {
		for _, t := range victims {
			a.ids.put(memoEntry{id: t.RID, value: ab.By}, ab.Memory)
		}
	}
	return victims
}

// unlinkAllLocked takes every job of request id rid, chained from head,
// out of the registry and adds them to victims.
func (a *aborts) unlinkAllLocked(victims []*Ticket, rid string, head *Ticket) []*Ticket {
	for t := head; t != nil; {
		next := t.sameRID
		t.sameRID, t.tracked = nil, false
		victims = append(victims, t)
		t = next
	}
	delete(a.live, rid)
	return victims
}

// endLocked ends the victims' jobs: the waiting ones leave the queue at
// once, so that no worker that frees up meanwhile takes them, and no
// victim gets a worker from now on (admitLocked). Cancelling a context
// only closes channels (context.AfterFunc runs its function in a
// goroutine of its own), so it may be done under the lock.
func (d *dispatchState) endLocked(victims []*Ticket, by string) AbortCounts {
	var c AbortCounts
	for _, t := range victims {
		switch {
		case t.waiter != nil:
			d.dequeueLocked(t.waiter)
			c.Waiting++
		case t.seq == 0: // between Track and Acquire
			c.Waiting++
		default:
			c.Running++
		}
		cause := &AbortedError{RID: t.RID, By: by}
		t.aborted = cause
		t.Cancel(cause)
	}
	return c
}

// AbortStats are the pool's aborts so far.
func (p *Pool) AbortStats() AbortStats {
	a := &p.aborts
	return AbortStats{Waiting: a.waiting.Load(), Running: a.running.Load(), Resent: a.resent.Load()}
}
