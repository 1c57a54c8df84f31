package fakeworker

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"
)

// forever is the duration of a hung job, which ends only when the worker
// closes, and of a held one, which ends when the test releases it.
const forever = time.Duration(-1)

// slotQueue is the worker's single execution slot. Waiters get it strictly in
// arrival order, as sglang's scheduler takes its requests; a waiter whose
// client goes away leaves the queue without ever running.
type slotQueue struct {
	mu      sync.Mutex
	busy    bool
	waiters []chan struct{} // oldest first; empty while !busy
}

// acquire waits for the slot until ctx ends.
func (q *slotQueue) acquire(ctx context.Context) error {
	if ctx.Err() != nil {
		return context.Cause(ctx)
	}
	q.mu.Lock()
	if !q.busy {
		q.busy = true
		q.mu.Unlock()
		return nil
	}
	turn := make(chan struct{})
	q.waiters = append(q.waiters, turn)
	q.mu.Unlock()

	select {
	case <-turn:
		return nil
	case <-ctx.Done():
		q.leave(turn)
		return context.Cause(ctx)
	}
}

// leave takes a cancelled waiter out of the queue. If the slot reached it in
// the meantime, it passes the slot on.
func (q *slotQueue) leave(turn chan struct{}) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if i := slices.Index(q.waiters, turn); i >= 0 {
		q.waiters = slices.Delete(q.waiters, i, i+1)
		return
	}
	q.handOff()
}

func (q *slotQueue) release() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.handOff()
}

// handOff gives the slot to the oldest waiter, or frees it. q.mu is held.
func (q *slotQueue) handOff() {
	if len(q.waiters) == 0 {
		q.busy = false
		return
	}
	close(q.waiters[0])
	q.waiters = q.waiters[1:]
}

// jobRun is what became of a job that completed.
type jobRun struct {
	took    time.Duration
	adapter string // the LoRA adapter it ran on; "" for the base weights
	weights string // the transformer's weights it ran on, as Weights names them
}

// runJob queues a generation job of the given shape and waits for its end.
// If ctx ends while the job waits, the job is dropped; once it runs, it
// keeps the worker busy for its whole service time whether or not anyone
// still waits for it, as a GPU kernel would. onStart, if not nil, learns
// the planned service time (forever for a hung or held job) and the adapter when
// the job starts.
func (w *Worker) runJob(ctx context.Context, s shape, onStart func(time.Duration, string)) (jobRun, error) {
	if err := w.acquire(ctx); err != nil {
		return jobRun{}, err
	}
	cost := s.cost()
	v, err := w.admit(s)
	if err != nil {
		w.slot.release()
		if errors.Is(err, errCrashed) {
			w.Crash()
		}
		return jobRun{}, err
	}
	d := w.serviceTime(cost)
	switch {
	case v.hang, v.held != nil:
		d = forever
	case v.oom:
		// The first denoising step's activations are what no longer fit:
		// the job fails after one step's work, not at once, and not
		// after all of it.
		d = w.serviceTime(cost / float64(s.steps))
	}
	failure := v.failure
	if onStart != nil {
		onStart(d, v.adapter)
	}

	run := jobRun{adapter: v.adapter, weights: v.weights}
	var completed bool
	done := w.occupy(d, v.held, func(elapsed time.Duration, ok bool) {
		run.took, completed = elapsed, ok
		w.record(cost, elapsed, ok, failure != nil, v.adapter)
	})
	if err := awaitDone(ctx, done); err != nil {
		return jobRun{}, err
	}
	switch {
	case !completed:
		return jobRun{}, errClosed
	case failure != nil:
		return jobRun{}, failure
	}
	return run, nil
}

// verdict is what becomes of a job that got the slot.
type verdict struct {
	hang bool // it holds the worker until the worker closes
	// held, if not nil, ends the job when it closes (see Hold).
	held    <-chan struct{}
	failure error // the scheduler error it ends with, after running
	oom     bool  // it runs out of GPU memory in its first step
	// adapter is the LoRA adapter in effect, and weights the
	// transformer's: one job or engine operation runs at a time, so those
	// a job starts on are the ones it runs on.
	adapter, weights string
}

// admit decides, when a job of shape s gets the slot, what becomes of it,
// or that it cannot run at all (err). Deciding here rather than on arrival
// keeps faults and failures in FIFO order.
func (w *Worker) admit(s shape) (verdict, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	finished := w.stats.Jobs + w.stats.Failed
	v := verdict{adapter: w.lora.inEffect(), weights: w.weights["transformer"].label}
	switch {
	case w.asleep:
		return verdict{}, errAsleep
	case w.cfg.CrashAfter > 0 && finished >= w.cfg.CrashAfter:
		return verdict{}, errCrashed
	case w.hung || w.cfg.HangAfter > 0 && finished >= w.cfg.HangAfter:
		v.hang = true
	case w.oomPixels > 0 && s.width*s.height >= w.oomPixels:
		v.failure, v.oom = oomError(s), true
	case w.rng.Float64() < w.failRate:
		v.failure = errInjected
	}
	if !v.hang {
		// A job that runs (not one refused, nor one hung, which only the
		// worker's end ends) takes the hold.
		v.held, w.held = w.held, nil
	}
	return v, nil
}

func (w *Worker) record(cost float64, elapsed time.Duration, completed, failed bool, adapter string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.stats.Busy += elapsed
	switch {
	case !completed:
	case failed:
		w.stats.Failed++
	default:
		w.stats.Jobs++
		w.stats.Cost += cost
		if w.stats.JobsOn == nil {
			w.stats.JobsOn = make(map[string]int)
		}
		// One job or engine operation runs at a time: the weights a job
		// ends on are the ones it ran on.
		w.stats.JobsOn[w.weights["transformer"].label]++
		if w.stats.JobsOnAdapter == nil {
			w.stats.JobsOnAdapter = make(map[string]int)
		}
		w.stats.JobsOnAdapter[adapter]++
	}
}

// runControl queues an engine operation (weight update, sleep, wake, LoRA,
// checksum). Once the operation has the worker, start decides under w.mu
// what it does and how long it keeps the worker busy; then apply, if not
// nil, makes its effect under w.mu, before the next job starts.
func (w *Worker) runControl(ctx context.Context, start func() time.Duration, apply func()) error {
	if err := w.acquire(ctx); err != nil {
		return err
	}
	w.mu.Lock()
	d := start()
	w.mu.Unlock()
	var completed bool
	done := w.occupy(d, nil, func(_ time.Duration, ok bool) {
		completed = ok
		if !ok || apply == nil {
			return
		}
		w.mu.Lock()
		defer w.mu.Unlock()
		apply()
	})
	if err := awaitDone(ctx, done); err != nil {
		return err
	}
	if !completed {
		return errClosed
	}
	return nil
}

// acquire waits for the slot until ctx ends or the worker closes.
func (w *Worker) acquire(ctx context.Context) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stop := context.AfterFunc(w.life, func() { cancel(errClosed) })
	defer stop()
	return w.slot.acquire(ctx)
}

// occupy holds the slot, which the caller owns, for d in the background,
// or until end closes if it is not nil, then calls finish and frees the
// slot. completed is false when the worker closed first. The returned
// channel closes once the slot is free.
func (w *Worker) occupy(d time.Duration, end <-chan struct{}, finish func(elapsed time.Duration, completed bool)) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer w.slot.release()
		start := time.Now()
		completed := w.sleep(d, end)
		finish(time.Since(start), completed)
	}()
	return done
}

// sleep waits for d, or forever if d < 0, or until end closes if it is
// not nil, and reports false if the worker closed first.
func (w *Worker) sleep(d time.Duration, end <-chan struct{}) bool {
	var timeout <-chan time.Time
	if d >= 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		timeout = t.C
	}
	select {
	case <-timeout:
		return true
	case <-end:
		return true
	case <-w.life.Done():
		return false
	}
}

func awaitDone(ctx context.Context, done <-chan struct{}) error {
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}
