package scheduler

import (
	"cmp"
	"slices"
)

// dnsAnswer is what one lookup last said: a DNS name's, or a Kubernetes
// API's watch of EndpointSlices.
type dnsAnswer struct {
	users int     // loaded configs that name the lookup
	found []Found // the workers its last usable answer named
	// source is the lookup's kind ("dns", "kubernetes"); failing says
	// its last try failed, so that its workers are those of an older
	// answer.
	source  string
	failing bool
}

// FoundChange is what a lookup's answer did to the pool.
type FoundChange struct {
	Joined []string // workers new to the pool
	Left   []string // workers no longer named, which left
	NoRoom int      // workers named but left out: the pool is full
}

// DeclareLookups counts a config's lookups, by key, of the kind source
// ("dns", "kubernetes"), in, as declare counts its workers.
func (p *Pool) DeclareLookups(source string, keys []string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, k := range keys {
		if p.answers[k] == nil {
			p.answers[k] = &dnsAnswer{source: source, failing: true} // in sync once it answers
		}
		p.answers[k].users++
	}
}

// SetFailing records whether a lookup's last try failed: its workers stay
// those of its last answer.
func (p *Pool) SetFailing(key string, failing bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if a := p.answers[key]; a != nil {
		a.failing = failing
	}
}

// LookupsInSync reports, by kind of lookup, whether every lookup of that
// kind answered its last try.
func (p *Pool) LookupsInSync() map[string]bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make(map[string]bool)
	for _, a := range p.answers {
		synced, seen := out[a.source]
		out[a.source] = !a.failing && (synced || !seen)
	}
	return out
}

// UndeclareLookups withdraws a config's DNS lookups; the workers of a
// lookup no loaded config names leave, unless something else keeps them.
func (p *Pool) UndeclareLookups(keys []string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, k := range keys {
		a := p.answers[k]
		if a == nil {
			continue
		}
		if a.users--; a.users > 0 {
			continue
		}
		delete(p.answers, k)
		p.forgetFoundLocked(a.found)
	}
}

// SetFound records a lookup's new answer. Workers it names that the pool
// lacks join (up to maxWorkers): also those an operator removed, as a
// config's workers come back on a reload. Workers it no longer names
// leave, unless something else keeps them. A worker it names anew (its
// pod replaced at the same address) is a new worker (see found.go).
func (p *Pool) SetFound(key string, found []Found, maxWorkers int) FoundChange {
	p.mu.Lock()
	defer p.mu.Unlock()
	var c FoundChange
	a := p.answers[key]
	if a == nil {
		return c // its last config was unloaded while it looked up
	}
	for _, f := range found {
		p.discovered[f.URL]++
	}
	old := a.found
	a.found = found
	c.Left = p.forgetFoundLocked(old)
	// With room for fewer than it names, the pool takes the ready first,
	// as kube-proxy sends to them first.
	byReadiness := slices.Clone(found)
	slices.SortStableFunc(byReadiness, func(x, y Found) int { return cmp.Compare(x.Condition, y.Condition) })
	for _, f := range byReadiness {
		w := p.findLocked(f.URL)
		switch {
		case w != nil:
			p.refoundLocked(w, f)
		case len(p.workers) >= maxWorkers:
			c.NoRoom++
		default:
			p.refoundLocked(p.addLocked(f.URL), f) // one back before its last jobs ended may be another process
			c.Joined = append(c.Joined, f.URL)
		}
	}
	p.dispatchLocked()
	return c
}

// forgetFoundLocked drops one answer's count of each worker it found and
// removes the workers nothing keeps any more. It returns those.
func (p *Pool) forgetFoundLocked(found []Found) []string {
	var gone []string
	for _, f := range found {
		u := f.URL
		if p.discovered[u]--; p.discovered[u] > 0 {
			continue
		}
		delete(p.discovered, u)
		w := p.findLocked(u)
		switch {
		case w == nil:
		case !p.heldLocked(w):
			p.removeLocked(w)
			gone = append(gone, u)
		default:
			w.found = Found{} // kept by a config or a registration: no lookup's word holds it back
		}
	}
	return gone
}
