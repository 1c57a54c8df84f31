package main

import (
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/clock"
)

// The schedule mode runs each job's attempts as the router does, on a
// goroutine of its own (and each hedged copy on one of attempt's), so
// that the attempts' own code decides everything; but its clock is
// virtual, and may only move once every goroutine waits on something the
// simulation controls. And the same seed must give the same figures: the
// pool's decisions depend on the order of its calls. So the goroutines
// take turns: the conductor wakes one at a time, in the order they became
// ready, and waits until it waits again (or ends) before it wakes the
// next, or steps the clock when none is ready.
//
// A goroutine's turn ends where it waits:
//   - in its worker's Next (simworker.go), until its worker answers or
//     its attempt's context ends: the worker's answer is a timer of the
//     clock; a context that ends (a copy answered first, a stall watch
//     fired) is found by a look, whenever no goroutine is ready, at the
//     attempts of the jobs whose contexts may end (watched);
//   - in the pool's queue, for its first worker (Admit, whose callback
//     readies it) or a re-run's (poolWait);
//   - for its hedged copies to end (attempt.Runner.AwaitCopies), which
//     the last copy's end readies;
//   - as it ends.
//
// A copy's goroutine starts in a clock step (a hedge's timer), on its
// own; the step waits for it to reach its Next.

// simGoroutine is a goroutine of the simulation: a job's, or a copy's.
type simGoroutine struct {
	wake chan struct{} // the conductor's word that its turn has come
	task *schedTask
	call *simCall // the attempt it waits in, at its worker; nil: none
}

// conductor runs the simulation's goroutines in turns, and its clock.
type conductor struct {
	clk          *clock.Virtual
	back         chan struct{}      // a turn ended: its goroutine waits, or ended
	arrived      chan *simGoroutine // a goroutine that waited in the pool's queue got its worker
	runnable     []*simGoroutine    // ready, in the order they became so
	current      *simGoroutine      // whose turn it is
	starting     int                // copies launched that have not reached their Next
	watched      []*schedTask       // jobs whose attempts' contexts may end
	poolWaiters  []*simGoroutine    // goroutines that wait in the pool's queue for a re-run's worker
	admitWaiting int                // jobs that wait in the pool's queue for their first worker
	queued       func() int         // how many jobs wait in the pool's queue
	remaining    int                // jobs not answered yet
}

func (c *conductor) init(clk *clock.Virtual, jobs int) {
	c.clk, c.remaining = clk, jobs
	c.back = make(chan struct{})
	c.arrived = make(chan *simGoroutine, jobs)
}

// start makes the goroutine of task that runs it or a copy of it.
func (c *conductor) start(task *schedTask) *simGoroutine {
	g := &simGoroutine{wake: make(chan struct{}), task: task}
	task.goros = append(task.goros, g)
	return g
}

// ready lets g take a turn.
func (c *conductor) ready(g *simGoroutine) { c.runnable = append(c.runnable, g) }

// conduct runs turns and steps the clock until every job is answered, or
// none can be: no timer left but the pool's queue timeouts (see
// poolWait), or the horizon passed.
func (c *conductor) conduct() {
	for c.remaining > 0 {
		switch {
		case len(c.runnable) > 0:
			c.turn()
		case c.wakeCancelled(), c.wakePoolWaiters():
		case c.clk.Pending() == len(c.poolWaiters), c.clk.Now().Sub(simEpoch) > simHorizon:
			return
		default:
			c.clk.Step()
			c.awaitStarting()
		}
	}
}

// turn runs the next ready goroutine until it waits or ends.
func (c *conductor) turn() {
	g := c.runnable[0]
	c.runnable = c.runnable[1:]
	c.current = g
	g.wake <- struct{}{}
	<-c.back
	c.current = nil
	c.awaitStarting()
}

// yield ends the current turn: g waits from now on, and takes its next
// turn once readied.
func (c *conductor) yield(g *simGoroutine) {
	c.back <- struct{}{}
	<-g.wake
}

// awaitStarting waits until the copies launched have reached their Next.
func (c *conductor) awaitStarting() {
	for ; c.starting > 0; c.starting-- {
		<-c.back
	}
}

// watch adds task to the jobs whose attempts' contexts may end: a copy
// of it was launched, or an answer of it stalled.
func (c *conductor) watch(task *schedTask) {
	if !task.watched {
		task.watched = true
		c.watched = append(c.watched, task)
	}
}

// wakeCancelled readies, in a fixed order, each goroutine that waits at
// its worker for an attempt whose context ended, and reports whether
// there was one.
func (c *conductor) wakeCancelled() bool {
	woke := false
	kept := c.watched[:0]
	for _, task := range c.watched {
		if task.status != 0 {
			task.watched = false
			continue
		}
		kept = append(kept, task)
		for _, g := range task.goros {
			if call := g.call; call != nil && call.waits() && call.ctx.Err() != nil {
				call.state = callCancelled
				c.ready(g)
				woke = true
			}
		}
	}
	clear(c.watched[len(kept):])
	c.watched = kept
	return woke
}

// finished ends the turn of task's job goroutine, its last: the client
// has its answer.
func (c *conductor) finished(task *schedTask) {
	c.remaining--
	c.back <- struct{}{}
}

// awaitCopies is attempt.Runner.AwaitCopies: task's goroutine waits for
// its copies, and its turn ends; the last copy to end readies it.
func (c *conductor) awaitCopies(task *schedTask) (over func()) {
	task.awaiting = true
	g := c.current
	c.back <- struct{}{}
	return func() { <-g.wake }
}

// copyEnded notes that a copy of task ended (attempt calls the pool's
// EndHedge last): its goroutine's turn ends with it.
func (c *conductor) copyEnded(task *schedTask) {
	task.live--
	if task.live == 0 && task.awaiting {
		task.awaiting = false
		c.ready(task.goros[0])
	}
	c.back <- struct{}{}
}

// poolWaitMark is the queue timeout of the simulation's jobs: never
// reached, it makes the pool set a timer on its clock as a job begins to
// wait in its queue, and stop it as the job's wait ends, which is how the
// conductor sees a re-run wait (see poolClock).
const poolWaitMark = 1000 * time.Hour

// poolClock is the pool's clock: the virtual one, but for the timer of a
// job's wait in the queue, which ends the turn of the goroutine that
// waits, and, stopped as its wait ends, keeps that goroutine until its
// next turn.
type poolClock struct {
	*clock.Virtual
	c *conductor
}

// AfterFunc implements clock.Clock.
func (pc poolClock) AfterFunc(d time.Duration, f func()) clock.Timer {
	timer := pc.Virtual.AfterFunc(d, f)
	if d != poolWaitMark {
		return timer
	}
	g := pc.c.current
	pc.c.poolWaiters = append(pc.c.poolWaiters, g)
	pc.c.back <- struct{}{}
	return poolWait{timer, pc.c, g}
}

// poolWait is the timer of g's wait in the pool's queue.
type poolWait struct {
	clock.Timer
	c *conductor
	g *simGoroutine
}

// Stop implements clock.Timer: g's wait ended, and g waits for its turn.
func (w poolWait) Stop() bool {
	pending := w.Timer.Stop()
	w.c.arrived <- w.g
	<-w.g.wake
	return pending
}

// wakePoolWaiters readies the goroutines that waited in the pool's queue
// for a re-run's worker and got it, in the order they began to wait, and
// reports whether there was one. Those still in the queue are its jobs
// but the ones that wait for their first worker (Admit).
func (c *conductor) wakePoolWaiters() bool {
	if len(c.poolWaiters) == 0 {
		return false
	}
	given := len(c.poolWaiters) - (c.queued() - c.admitWaiting)
	if given == 0 {
		return false
	}
	got := make(map[*simGoroutine]bool, given)
	for range given {
		got[<-c.arrived] = true
	}
	waiting := c.poolWaiters[:0]
	for _, g := range c.poolWaiters {
		if got[g] {
			c.ready(g)
		} else {
			waiting = append(waiting, g)
		}
	}
	clear(c.poolWaiters[len(waiting):])
	c.poolWaiters = waiting
	return true
}
