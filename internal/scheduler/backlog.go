package scheduler

import (
	"container/heap"
	"time"
)

// Backlog is the time the pool's workers are predicted to need to finish
// every job they run and every job waiting, at their learned speeds: the
// figure an autoscaler scales the fleet on, since sglang-diffusion serves
// no load metric of its own.
//
// The queue is played out as the pool dispatches it: in queue order, each
// waiting job goes to the serving worker that may serve it and frees up
// first (late binding), and runs there after the work that worker has. A
// worker that is not serving (ejected, draining, asleep) still finishes
// the jobs it runs but takes none of the waiting ones. A job no serving
// worker may serve adds nothing: it waits for a worker the pool lacks.
func (p *Pool) Backlog() time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := p.now().UnixNano()
	var free freeTimes
	longest := 0.0
	for _, w := range p.workers {
		left := p.workLeftLocked(w, now) / p.speedOfLocked(w)
		longest = max(longest, left)
		if w.serving(now) {
			free = append(free, freeAt{w, left})
		}
	}
	heap.Init(&free)
	for _, wt := range p.queue {
		if end, ok := free.take(wt.t, p.speedOfLocked, p.fleet.target); ok {
			longest = max(longest, end)
		}
	}
	return time.Duration(longest * float64(time.Second))
}

// freeAt is when a worker, in seconds from now, is done with the work it
// has been given so far.
type freeAt struct {
	w       *worker
	seconds float64
}

// freeTimes is a min-heap of workers by when they free up.
type freeTimes []freeAt

func (f freeTimes) Len() int           { return len(f) }
func (f freeTimes) Less(i, j int) bool { return f[i].seconds < f[j].seconds }
func (f freeTimes) Swap(i, j int)      { f[i], f[j] = f[j], f[i] }
func (f *freeTimes) Push(x any)        { *f = append(*f, x.(freeAt)) }
func (f *freeTimes) Pop() any {
	old := *f
	last := old[len(old)-1]
	*f = old[:len(old)-1]
	return last
}

// take gives t's job to the first worker to free up that may serve it,
// and returns when that worker will have done it. Workers passed over for
// t keep their places.
func (f *freeTimes) take(t *Ticket, speedOf func(*worker) float64, upcoming string) (float64, bool) {
	var passed []freeAt
	defer func() {
		for _, fa := range passed {
			heap.Push(f, fa)
		}
	}()
	for f.Len() > 0 {
		fa := heap.Pop(f).(freeAt)
		if !t.mayServe(fa.w, upcoming) {
			passed = append(passed, fa)
			continue
		}
		fa.seconds += t.Cost / speedOf(fa.w)
		heap.Push(f, fa)
		return fa.seconds, true
	}
	return 0, false
}
