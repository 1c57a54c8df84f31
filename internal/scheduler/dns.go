package scheduler

// dnsAnswer is what one DNS lookup last said.
type dnsAnswer struct {
	users int      // loaded configs that name the lookup
	urls  []string // the workers its last usable answer named
}

// FoundChange is what a DNS answer did to the pool.
type FoundChange struct {
	Joined []string // workers new to the pool
	Left   []string // workers no longer named, which left
	NoRoom int      // workers named but left out: the pool is full
}

// DeclareLookups counts a config's DNS lookups in, as declare counts its
// workers.
func (p *Pool) DeclareLookups(keys []string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, k := range keys {
		if p.answers[k] == nil {
			p.answers[k] = new(dnsAnswer)
		}
		p.answers[k].users++
	}
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
		p.forgetFoundLocked(a.urls)
	}
}

// SetFound records a lookup's new answer. Workers it names that the pool
// lacks join (up to maxWorkers): also those an operator removed, as a
// config's workers come back on a reload. Workers it no longer names
// leave, unless something else keeps them.
func (p *Pool) SetFound(key string, urls []string, maxWorkers int) FoundChange {
	p.mu.Lock()
	defer p.mu.Unlock()
	var c FoundChange
	a := p.answers[key]
	if a == nil {
		return c // its last config was unloaded while it looked up
	}
	for _, u := range urls {
		p.discovered[u]++
	}
	old := a.urls
	a.urls = urls
	c.Left = p.forgetFoundLocked(old)
	for _, u := range urls {
		switch {
		case p.findLocked(u) != nil:
		case len(p.workers) >= maxWorkers:
			c.NoRoom++
		default:
			p.addLocked(u)
			c.Joined = append(c.Joined, u)
		}
	}
	p.dispatchLocked()
	return c
}

// forgetFoundLocked drops one DNS answer's count of each of urls and
// removes the workers nothing keeps any more. It returns those.
func (p *Pool) forgetFoundLocked(urls []string) []string {
	var gone []string
	for _, u := range urls {
		if p.discovered[u]--; p.discovered[u] > 0 {
			continue
		}
		delete(p.discovered, u)
		if w := p.findLocked(u); w != nil && !p.heldLocked(w) {
			p.removeLocked(w)
			gone = append(gone, u)
		}
	}
	return gone
}
