package scheduler

import (
	"fmt"
	"slices"
	"strings"
)

// Bounded staleness: a job may ask to run only on a worker whose base
// weights are among the last k+1 versions the fleet has had, in the order
// the router learned them. An update from disk that succeeded teaches the
// fleet a version, and so does a trainer's declaration; a LoRA call or an
// adapter's publish changes how the base weights are served, not which,
// and teaches none. The fleet remembers the last MaxStaleness+1 versions;
// the chain of eligibility.go asks freshLocked.

// MaxStaleness is the largest k a policy may give: the fleet remembers
// MaxStaleness+1 versions.
const MaxStaleness = 1000

// VersionPolicy is how stale the base weights a job runs on may be. The
// zero value bounds nothing: the job runs as it would without a policy.
type VersionPolicy struct {
	window int // how many of the newest versions it admits, k+1; 0: any
}

// Staleness is the policy that admits the last k+1 versions: 0, the
// newest only, is "latest".
func Staleness(k int) (VersionPolicy, error) {
	if k < 0 || k > MaxStaleness {
		return VersionPolicy{}, fmt.Errorf("the staleness bound must be 0 to %d, got %d", MaxStaleness, k)
	}
	return VersionPolicy{window: k + 1}, nil
}

// Bounded reports whether pol admits fewer than every version.
func (pol VersionPolicy) Bounded() bool { return pol.window > 0 }

// PolicyNames name the bounded policies in metrics: latest (k = 0) and
// max_staleness (any larger k).
var PolicyNames = [...]string{"latest", "max_staleness"}

// heldCounts are the jobs each bounded policy held back, by its index in
// PolicyNames.
type heldCounts [len(PolicyNames)]uint64

// kind is pol's index in PolicyNames.
func (pol VersionPolicy) kind() int { return min(pol.window-1, 1) }

// learnedLocked adds version to the base-weight versions the fleet has
// had, as the newest; the same version again adds nothing. An update from
// disk that succeeded and a trainer's declaration call it: it is the one
// way in.
func (f *fleetState) learnedLocked(version string) {
	f.versions = learned(f.versions, version)
}

// learned is versions, oldest first, once version has come after them,
// the oldest let go beyond MaxStaleness+1; versions itself is not
// changed, as a record's list may be shared.
func learned(versions []string, version string) []string {
	if n := len(versions); n > 0 && versions[n-1] == version {
		return versions
	}
	kept := versions[max(0, len(versions)-MaxStaleness):]
	return append(slices.Clip(kept), version)
}

// lastVersions is the last MaxStaleness+1 of versions, as a record read
// back may hold more.
func lastVersions(versions []string) []string {
	return slices.Clone(versions[max(0, len(versions)-MaxStaleness-1):])
}

// freshLocked reports whether a worker on version, or one an update
// under way brings to upcoming ("" when the question is about now), is
// on base weights pol admits.
func (f *fleetState) freshLocked(pol VersionPolicy, version, upcoming string) bool {
	return f.admitsLocked(pol, version) || upcoming != "" && f.admitsLocked(pol, upcoming)
}

// admitsLocked reports whether pol admits a worker on version: its base
// weights are among the newest pol.window the fleet has had, an update
// from disk under way counting as the newest. Before the fleet has had
// any, every version is admitted: nothing says which is newer.
func (f *fleetState) admitsLocked(pol VersionPolicy, version string) bool {
	base, _, _ := strings.Cut(version, LoraSuffix)
	known, window := f.versions, pol.window
	if u := f.running; u != nil && u.Path == DiskUpdatePath && (len(known) == 0 || known[len(known)-1] != u.Version) {
		if base == u.Version {
			return true
		}
		window-- // the target takes the newest place
	} else if len(known) == 0 {
		return true
	}
	return slices.Contains(known[max(0, len(known)-window):], base)
}

// noteHeldLocked counts t's job as held back by its version policy, the
// first time it is: a worker that could have taken it now was on weights
// too stale for it. When t waits, so was that worker for every job of its
// class (see queueindex.go), which a dispatch pass does not ask about
// once t was refused.
func (d *dispatchState) noteHeldLocked(t *Ticket) {
	d.countHeldLocked(t)
	if t.waiter == nil {
		return
	}
	c := t.waiter.line.class
	for _, wt := range c.unheld {
		if !wt.gone {
			d.countHeldLocked(wt.t)
		}
	}
	clear(c.unheld)
	c.unheld = c.unheld[:0]
}

// countHeldLocked counts t's job as held back, the first time it is.
func (d *dispatchState) countHeldLocked(t *Ticket) {
	if !t.heldBack {
		t.heldBack = true
		d.heldBack[t.Staleness.kind()]++
	}
}

// HeldBack is how many jobs each version policy has held back so far, by
// its name in PolicyNames.
func (p *Pool) HeldBack() map[string]uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make(map[string]uint64, len(PolicyNames))
	for i, name := range PolicyNames {
		out[name] = p.heldBack[i]
	}
	return out
}

// HeldByPolicy reports whether t's version policy held its job back at
// some point: while it waited, a worker that could have taken it was on
// weights too stale for it.
func (t *Ticket) HeldByPolicy() bool { return t.heldBack }
