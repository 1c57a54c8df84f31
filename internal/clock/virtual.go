package clock

import (
	"container/heap"
	"sync"
	"time"
)

// Virtual is a clock whose time stands still until Step or Advance moves
// it to the next timer due, whose function then runs on the caller's
// goroutine: a discrete-event simulation's clock. Timers due at one
// instant fire in the order they were set. It is safe for concurrent
// use, but a timer's function runs with no lock of the clock held, so
// it may set timers of its own.
type Virtual struct {
	mu     sync.Mutex
	now    time.Time
	timers timerHeap
	seq    uint64 // timers set, ever: the order of timers due at one instant
}

// NewVirtual returns a virtual clock that reads start.
func NewVirtual(start time.Time) *Virtual { return &Virtual{now: start} }

// Now implements Clock.
func (v *Virtual) Now() time.Time {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.now
}

// AfterFunc implements Clock: f runs in the Step or Advance that reaches
// d from now.
func (v *Virtual) AfterFunc(d time.Duration, f func()) Timer {
	t := &virtualTimer{clock: v, f: f, index: -1}
	v.mu.Lock()
	defer v.mu.Unlock()
	v.scheduleLocked(t, d)
	return t
}

// Step moves the clock to the earliest timer due and runs its function.
// It reports false, and does nothing, when no timer is pending.
func (v *Virtual) Step() bool {
	v.mu.Lock()
	if len(v.timers) == 0 {
		v.mu.Unlock()
		return false
	}
	t := heap.Pop(&v.timers).(*virtualTimer)
	if t.at.After(v.now) { // a timer set in the past fires now
		v.now = t.at
	}
	v.mu.Unlock()
	t.f()
	return true
}

// Advance runs, in order, every timer due within d from now, and leaves
// the clock d later.
func (v *Virtual) Advance(d time.Duration) {
	v.mu.Lock()
	end := v.now.Add(d)
	v.mu.Unlock()
	for {
		v.mu.Lock()
		if len(v.timers) == 0 || v.timers[0].at.After(end) {
			v.now = end
			v.mu.Unlock()
			return
		}
		v.mu.Unlock()
		v.Step()
	}
}

// Pending is the number of timers set and not yet fired or stopped.
func (v *Virtual) Pending() int {
	v.mu.Lock()
	defer v.mu.Unlock()
	return len(v.timers)
}

func (v *Virtual) scheduleLocked(t *virtualTimer, d time.Duration) {
	v.seq++
	t.at, t.seq = v.now.Add(d), v.seq
	heap.Push(&v.timers, t)
}

// virtualTimer is a timer of a Virtual clock; index is its place in the
// clock's heap, -1 when not pending.
type virtualTimer struct {
	clock *Virtual
	f     func()
	at    time.Time
	seq   uint64
	index int
}

func (t *virtualTimer) Reset(d time.Duration) bool {
	v := t.clock
	v.mu.Lock()
	defer v.mu.Unlock()
	pending := t.stopLocked()
	v.scheduleLocked(t, d)
	return pending
}

func (t *virtualTimer) Stop() bool {
	t.clock.mu.Lock()
	defer t.clock.mu.Unlock()
	return t.stopLocked()
}

func (t *virtualTimer) stopLocked() bool {
	if t.index < 0 {
		return false
	}
	heap.Remove(&t.clock.timers, t.index)
	return true
}

// timerHeap orders pending timers by when they are due, then by when
// they were set.
type timerHeap []*virtualTimer

func (h timerHeap) Len() int { return len(h) }

func (h timerHeap) Less(i, j int) bool {
	if !h[i].at.Equal(h[j].at) {
		return h[i].at.Before(h[j].at)
	}
	return h[i].seq < h[j].seq
}

func (h timerHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index, h[j].index = i, j
}

func (h *timerHeap) Push(x any) {
	t := x.(*virtualTimer)
	t.index = len(*h)
	*h = append(*h, t)
}

func (h *timerHeap) Pop() any {
	old := *h
	t := old[len(old)-1]
	old[len(old)-1] = nil
	t.index = -1
	*h = old[:len(old)-1]
	return t
}
