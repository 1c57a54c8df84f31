package scheduler

import (
	"context"
	"errors"
	"net"
	"regexp"
	"slices"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/request"
)

// HealthConfig is how one diffusion_router config judges its workers.
type HealthConfig struct {
	URI      string
	Interval time.Duration
	Timeout  time.Duration
	Fails    int            // consecutive failed probes that mark a worker unhealthy
	Passes   int            // consecutive passed probes that bring it back
	Status   int            // expected probe status; 0: any 2xx
	Body     *regexp.Regexp // expected in the probe's body; nil: anything

	StallFactor  float64       // a job overrunning its prediction this much makes its worker suspect
	MaxFails     int           // failures within failWindow that eject a worker
	FailWindow   time.Duration //
	EjectTime    time.Duration // first ejection; doubles on each repeat until cleanRunForgives successes in a row
	MaxEjectTime time.Duration // cap of the doubling

	MaxEjectionPercent int // workers that may be ejected at once, in percent of the pool; one always may
}

// HealthChange is what a probe result did to a worker.
type HealthChange int

// URLs returns the pool's worker URLs.
func (p *Pool) URLs() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]string, len(p.workers))
	for i, w := range p.workers {
		out[i] = w.url
	}
	return out
}

// RecordProbe counts a probe result; err nil means it passed.
func (p *Pool) RecordProbe(url string, err error, cfg *HealthConfig) HealthChange {
	p.mu.Lock()
	defer p.mu.Unlock()
	w := p.findLocked(url)
	if w == nil {
		return Unchanged
	}
	now := p.now().UnixNano()
	w.evidence.lastProbe, w.evidence.lastError = now, ""
	if err == nil {
		change := p.probePassedLocked(w, now, cfg)
		p.dispatchLocked()
		return change
	}
	w.evidence.lastError = err.Error()
	if couldNotConnect(err) {
		p.fleet.changedLocked(w) // it is down, or restarting on weights of its own
	}
	if isTimeout(err) && p.busyLocked(w, now, cfg) {
		return Unchanged // slow because it is working, not because it is dead
	}
	w.health.unverified = false // down already; back after health_passes passes, as any unhealthy worker
	w.evidence.probePasses = 0
	w.evidence.probeFails++
	if !w.health.down && w.evidence.probeFails >= cfg.Fails {
		w.health.down = true
		// A worker down long enough to fail its probes has most likely
		// lost what it ran; its video jobs give back their slots, so
		// that it comes back with room for new ones.
		p.endVideosOfLocked(w)
		return BecameUnhealthy
	}
	return Unchanged
}

// probePassedLocked counts a passed probe of w.
func (p *Pool) probePassedLocked(w *worker, now int64, cfg *HealthConfig) HealthChange {
	w.evidence.probeFails = 0
	w.evidence.probePasses++
	p.fleet.recoveredLocked(w)
	if w.health.suspect && !p.overrunningLocked(w, now, cfg) {
		w.health.suspect = false
	}
	// An ejection for bad answers runs its course while other workers
	// serve what w makes: a passed probe says the worker's HTTP server
	// answers, not that its answers are whole. With none, the probe ends
	// it into probation, as Envoy's panic threshold sends traffic to
	// ejected hosts when too few are healthy: one job at a time on a
	// worker that may be broken beats a queue waiting out an ejection of
	// minutes. An ejection for connections w did not answer ends after
	// health_passes passes, as an unhealthy worker's absence does: w was
	// down, and is up again.
	change := Unchanged
	switch {
	case now >= w.health.ejectedUntil:
	case w.health.ejectedDown && w.evidence.probePasses >= cfg.Passes:
		w.health.ejectedUntil, change = 0, BackUp
	case !p.othersServeLocked(w, now):
		w.health.ejectedUntil, change = 0, EjectionEnded
	}
	if w.health.down && (w.evidence.probePasses >= cfg.Passes || w.health.unverified) {
		w.health.down = false    // one pass admits a worker read back, as one answer admits a worker registered
		p.forgetAdapterLocked(w) // it may have restarted on the base weights
		change = BecameHealthy
	}
	w.health.unverified = false
	return change
}

// othersServeLocked reports whether workers other than w serve every
// kind of request w makes. Every worker takes the requests of no kind
// (rollouts): a video worker ejected beside image workers alone is the
// only one its video jobs have.
func (reg *registry) othersServeLocked(w *worker, now int64) bool {
	var served request.Tasks
	for _, o := range reg.workers {
		if o != w && o.serving(now) {
			served |= o.caps.makes
		}
	}
	return w.caps.makes&^served == 0
}

// couldNotConnect reports whether err says no connection to the worker
// could be made: nothing listens at its address, as while it restarts. A
// timeout says nothing of the kind: a busy worker may be slow to accept.
func couldNotConnect(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial" && !op.Timeout()
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout())
}

// busyLocked reports whether a slow probe answer is explained by work: a job
// still within twice its predicted time, or one finished within the last
// interval.
func (d *dispatchState) busyLocked(w *worker, now int64, cfg *HealthConfig) bool {
	if w.load.inflight > 0 && float64(now-w.load.headSince) < 2*d.predictedHeadLocked(w) {
		return true
	}
	return w.load.lastFinish > 0 && now-w.load.lastFinish < int64(cfg.Interval)
}

// predictedHeadLocked is how long the running job of w is predicted to take, in
// nanoseconds.
func (d *dispatchState) predictedHeadLocked(w *worker) float64 {
	return w.load.headCost / d.speedOfLocked(w) * float64(time.Second)
}

// overrunningLocked reports whether w's running job has overrun its prediction
// by the stall factor (and at least the probe timeout).
func (d *dispatchState) overrunningLocked(w *worker, now int64, cfg *HealthConfig) bool {
	if w.load.inflight == 0 || w.headUnwatched() {
		return false
	}
	return float64(now-w.load.headSince) > d.stallLimitLocked(w, cfg)
}

// headUnwatched reports whether w's running job is one whose end nobody
// waits for on a connection, so that it cannot hang: a held video job,
// which ends when its polls say so, or a job whose client left or that
// an abort ended, which the pool lets go of at its predicted end
// (keepGhostLocked). w must have a job in flight.
func (w *worker) headUnwatched() bool {
	head := w.load.jobs[0]
	return head.held || head.ghost
}

// stallLimitLocked is how long w's running job may run before it is taken
// for stalled, in nanoseconds: the stall factor times its prediction, and
// at least the probe timeout.
func (d *dispatchState) stallLimitLocked(w *worker, cfg *HealthConfig) float64 {
	return max(cfg.StallFactor*d.predictedHeadLocked(w), float64(cfg.Timeout))
}

// CheckStalls marks suspect the workers whose running job has overrun its
// prediction, and returns the ones newly marked.
func (p *Pool) CheckStalls(cfg *HealthConfig) []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := p.now().UnixNano()
	var marked []string
	for _, w := range p.workers {
		if !w.health.suspect && p.overrunningLocked(w, now, cfg) {
			w.health.suspect = true
			marked = append(marked, w.url)
		}
	}
	return marked
}

// cleanRunForgives is how many successes in a row, no failure between,
// wipe out a worker's past ejections: its next one lasts eject_time again.
// One success would forgive a worker that breaks most of its answers; ten
// show it works.
const cleanRunForgives = 10

// noteEvidenceLocked counts the passive evidence of one proxied request:
// max_fails failures within fail_window eject the worker for eject_time,
// doubling on each repeat up to max_eject_time, until cleanRunForgives
// successes in a row; when none of them was an answer (Unreachable all),
// health_passes passed probes end the ejection sooner. It reports how
// long the worker is now ejected for, if it is.
func (p *Pool) noteEvidenceLocked(w *worker, t *Ticket, ev Evidence) time.Duration {
	now, cfg := p.now().UnixNano(), t.cfg.Health
	switch ev {
	case Unreachable:
		p.fleet.changedLocked(w) // down, it may come back on other weights
	case Asleep:
		p.fleet.sleptLocked(w)
	}
	switch ev {
	case Succeeded:
		p.noteSuccessLocked(w, t.probation)
		return 0
	case Abandoned, Refused:
		return 0
	case Asleep:
		p.noteAsleepLocked(w, now)
		return 0
	}
	w.evidence.cleanRun = 0
	if cfg == nil || cfg.MaxFails == 0 {
		return 0
	}
	since := now - int64(cfg.FailWindow)
	w.evidence.recentFails = append(slices.DeleteFunc(w.evidence.recentFails, func(f failure) bool { return f.at <= since }),
		failure{at: now, answered: ev != Unreachable})
	w.evidence.lastFail = now
	if len(w.evidence.recentFails) < cfg.MaxFails && !w.health.probation || !p.mayEjectLocked(now, cfg) {
		return 0
	}
	d := min(cfg.EjectTime<<min(w.evidence.ejections, 20), cfg.MaxEjectTime)
	w.health.ejectedUntil = now + int64(d)
	// A worker that did not answer was down: once its probes pass, it is
	// back. One that answered badly may answer /health all along.
	w.health.ejectedDown = !slices.ContainsFunc(w.evidence.recentFails, func(f failure) bool { return f.answered })
	w.evidence.recentFails = w.evidence.recentFails[:0]
	w.evidence.probePasses = 0 // the passes that end it come after its failures
	// Back, it is on probation: one job at a time, and out again at its
	// first failure, until a job succeeds. A passed probe says its HTTP
	// server answers, not that its jobs do.
	w.health.probation = true
	w.evidence.ejectedAt = now
	w.evidence.ejections++
	w.stats.ejected++
	p.redispatchAtLocked(w.health.ejectedUntil) // jobs may be waiting for it
	return d
}

// noteSuccessLocked counts a success of w, the last of cleanRunForgives
// in a row wiping out its past ejections. Only the success of a job given
// to w on probation (trial) ends the probation: one w had before, if it
// is released as its answer begins, may still break.
func (p *Pool) noteSuccessLocked(w *worker, trial bool) {
	w.evidence.naps = 0
	w.health.probation = w.health.probation && !trial
	w.evidence.cleanRun++
	if w.evidence.cleanRun >= cleanRunForgives {
		w.evidence.ejections = 0
	}
}

// Forgive takes back the last failure counted against the worker at url,
// and the ejection it caused, if it did: the job it failed turned out to
// fail on another worker as well, so it was the job's fault.
func (p *Pool) Forgive(url string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	w := p.findLocked(url)
	if w == nil || w.stats.failures == 0 {
		return
	}
	w.stats.failures--
	w.evidence.consecFails = max(w.evidence.consecFails-1, 0)
	if n := len(w.evidence.recentFails); n > 0 && w.evidence.recentFails[n-1].at == w.evidence.lastFail {
		w.evidence.recentFails = w.evidence.recentFails[:n-1]
	}
	if w.evidence.ejectedAt != 0 && w.evidence.ejectedAt == w.evidence.lastFail {
		w.health.ejectedUntil, w.health.probation = 0, false
		w.evidence.ejections--
		w.stats.ejected--
		w.evidence.ejectedAt = 0
		p.dispatchLocked()
	}
}

// mayEjectLocked reports whether one more worker may be ejected at now:
// never more than MaxEjectionPercent of the workers at once, but always
// one, as Envoy's outlier detection does. Jobs failing everywhere say
// more of the jobs than of the workers, and a fleet must keep serving.
func (reg *registry) mayEjectLocked(now int64, cfg *HealthConfig) bool {
	out := 0
	for _, w := range reg.workers {
		if now < w.health.ejectedUntil {
			out++
		}
	}
	return out == 0 || (out+1)*100 <= cfg.MaxEjectionPercent*len(reg.workers)
}

// Bounds of how long a worker that said it is asleep is left alone.
const (
	asleepRecheck    = time.Second
	maxAsleepRecheck = 30 * time.Second
)

// noteAsleepLocked keeps a worker that said it is asleep out of routing
// for a while, twice as long each time it says so again. It was put to
// sleep behind the router's back (a trainer calls the engines directly),
// its health probe still passes, and only its answers tell when it wakes;
// a job that finds it still asleep runs again elsewhere.
func (p *Pool) noteAsleepLocked(w *worker, now int64) {
	d := min(asleepRecheck<<min(w.evidence.naps, 10), maxAsleepRecheck)
	w.evidence.naps++
	w.health.asleepUntil = now + int64(d)
	p.redispatchAtLocked(w.health.asleepUntil) // jobs may be waiting for it
}

// SetDown marks a worker unhealthy after err, until its health probes
// pass again.
func (p *Pool) SetDown(url string, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if w := p.findLocked(url); w != nil {
		w.health.down, w.evidence.lastError = true, err.Error()
	}
}

// NoteCutShort counts a failure against the worker that served t, whose
// answer began and then broke off; if t runs again, it is on another. It
// reports how long the worker is ejected for if this failure ejected it.
func (p *Pool) NoteCutShort(t *Ticket) (ejected time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	w := p.findLocked(t.servedBy)
	if w == nil {
		return 0
	}
	t.tried = append(t.tried, w)
	w.stats.failures++
	w.evidence.consecFails++
	return p.noteEvidenceLocked(w, t, Failed)
}

// redispatchAtLocked makes sure free slots are handed to waiting jobs at
// when (Unix nanoseconds), when an ejection ends. One timer serves the
// pool: it is set for the earliest ejection end and, when it fires, for
// the next one.
func (p *Pool) redispatchAtLocked(when int64) {
	if p.bg.ctx.Err() != nil || p.ejectionEnds != 0 && p.ejectionEnds <= when {
		return
	}
	p.ejectionEnds = when
	d := time.Duration(when - p.now().UnixNano())
	if p.redispatch == nil {
		p.redispatch = p.clock.AfterFunc(d, p.endEjection)
		return
	}
	p.redispatch.Reset(d)
}

// ejectionEnded hands out jobs to workers whose ejection is over and sets
// the timer for the next ejection to end.
func (p *Pool) endEjection() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.ejectionEnds = 0
	now := p.now().UnixNano()
	for _, w := range p.workers {
		if w.health.ejectedUntil > now {
			p.redispatchAtLocked(w.health.ejectedUntil)
		}
	}
	p.dispatchLocked()
}

// Sleep waits for d, reporting false if ctx ended first.
func Sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// What a probe result did to a worker.
const (
	Unchanged HealthChange = iota
	BecameUnhealthy
	BecameHealthy
	EjectionEnded // a passed probe ended an ejection: no other worker serves
	BackUp        // passed probes ended an ejection for connections the worker did not answer
)
