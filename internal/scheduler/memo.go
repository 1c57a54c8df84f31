package scheduler

import "time"

// memo maps keys to values, each for a time of its own, forgetting the
// oldest first once it holds limit of them. The entries sit by value in a
// ring, and the map holds their places, not pointers: a full memo is
// 100,000 entries that the garbage collector would otherwise trace object
// by object on every cycle, a cost that grew with each job the router
// served. A memo has no lock: its owner holds one.
type memo struct {
	limit int
	now   func() time.Time // the clock; tests set their own

	byID map[string]uint64 // the place of each key's entry
	// The entry at place s is ring[s % limit]; places oldest to next-1 are
	// in use, the oldest first. The ring grows up to limit as it fills.
	ring         []memoEntry
	oldest, next uint64
}

type memoEntry struct {
	id      string // empty once forgotten
	value   string
	owner   string // who may see the entry, where its memo tells
	expires int64  // Unix nanoseconds
}

func newMemo(limit int) memo {
	return memo{limit: limit, now: time.Now, byID: make(map[string]uint64)}
}

// put remembers e under its id for ttl, in place of what the id had.
func (m *memo) put(e memoEntry, ttl time.Duration) {
	now := m.now().UnixNano()
	id := e.id
	if s, ok := m.byID[id]; ok {
		m.at(s).id = ""
	}
	if m.next-m.oldest == uint64(m.limit) {
		m.dropOldest()
	}
	e.expires = now + int64(ttl)
	if m.next < uint64(m.limit) {
		m.ring = append(m.ring, e)
	} else {
		*m.at(m.next) = e
	}
	m.byID[id] = m.next
	m.next++
	for m.oldest < m.next && (m.at(m.oldest).id == "" || m.at(m.oldest).expires <= now) {
		m.dropOldest()
	}
}

// get returns id's entry while it is remembered.
func (m *memo) get(id string) (memoEntry, bool) {
	s, ok := m.byID[id]
	if !ok {
		return memoEntry{}, false
	}
	e := m.at(s)
	if e.expires <= m.now().UnixNano() {
		m.forgetEntry(e)
		return memoEntry{}, false
	}
	return *e, true
}

// find returns the oldest entry remembered whose id matches.
func (m *memo) find(match func(id string) bool) (memoEntry, bool) {
	if m.oldest == m.next {
		return memoEntry{}, false
	}
	now := m.now().UnixNano()
	for s := m.oldest; s < m.next; s++ {
		if e := m.at(s); e.id != "" && e.expires > now && match(e.id) {
			return *e, true
		}
	}
	return memoEntry{}, false
}

// forget drops id.
func (m *memo) forget(id string) {
	if s, ok := m.byID[id]; ok {
		m.forgetEntry(m.at(s))
	}
}

// forgetValue drops every entry of value.
func (m *memo) forgetValue(value string) {
	for s := m.oldest; s < m.next; s++ {
		if e := m.at(s); e.id != "" && e.value == value {
			m.forgetEntry(e)
		}
	}
}

func (m *memo) at(s uint64) *memoEntry { return &m.ring[s%uint64(m.limit)] }

// forgetEntry drops e's id; its place is reused when it is the oldest.
func (m *memo) forgetEntry(e *memoEntry) {
	delete(m.byID, e.id)
	e.id = ""
}

func (m *memo) dropOldest() {
	if e := m.at(m.oldest); e.id != "" {
		m.forgetEntry(e)
	}
	*m.at(m.oldest) = memoEntry{} // lets go of the strings
	m.oldest++
}
