package diffusionrouter

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"regexp"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// Health. Caddy's own active health checks do not run on dynamic upstreams
// and a plugin cannot set Caddy's health flags, so the router keeps its
// own: an active prober per pool, passive evidence from the requests it
// proxies, and stall detection from the cost model. Two mistakes of
// existing routers are avoided: a worker marked down keeps being probed and
// comes back by itself, and a worker that is slow to answer because it is
// busyLocked on a minutes-long video is not declared dead.

func init() {
	caddy.RegisterModule(new(HealthApp))
}

// Defaults of the health options.
const (
	defaultHealthURI      = "/health"
	defaultHealthInterval = 10 * time.Second
	defaultHealthTimeout  = 5 * time.Second
	defaultHealthFails    = 3
	defaultHealthPasses   = 2
	defaultStallFactor    = 5
	defaultMaxFails       = 3
	defaultFailWindow     = 30 * time.Second
	defaultEjectTime      = 10 * time.Second
	defaultMaxEjectTime   = 5 * time.Minute
	maxHealthBody         = 64 << 10
)

// healthConfig is how one diffusion_router config judges its workers.
type healthConfig struct {
	uri      string
	interval time.Duration
	timeout  time.Duration
	fails    int            // consecutive failed probes that mark a worker unhealthy
	passes   int            // consecutive passed probes that bring it back
	status   int            // expected probe status; 0: any 2xx
	body     *regexp.Regexp // expected in the probe's body; nil: anything

	stallFactor  float64       // a job overrunning its prediction this much makes its worker suspect
	maxFails     int           // failures within failWindow that eject a worker
	failWindow   time.Duration //
	ejectTime    time.Duration // first ejection; doubles on each repeat
	maxEjectTime time.Duration
}

// HealthApp runs the active health checks of the pools its config uses,
// starts each pool the first time (reads its record back from Caddy's
// storage and keeps it written, see fleetStore), and runs the config's DNS
// discovery of workers. diffusion_router adds it to the config it is part
// of, so probing and lookups start when Caddy starts that config and stop
// when it is unloaded, and `caddy validate`, which starts nothing, probes,
// reads and looks up nothing.
type HealthApp struct {
	mu          sync.Mutex
	probers     []*prober
	discoveries []*discovery
	cancel      context.CancelFunc
	finished    sync.WaitGroup
}

// CaddyModule returns the Caddy module information.
func (*HealthApp) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "diffusion_health",
		New: func() caddy.Module { return new(HealthApp) },
	}
}

// watch asks the app to probe pool's workers once it starts; one prober
// per pool and config.
func (a *HealthApp) watch(pr *prober) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, other := range a.probers {
		if other.pool == pr.pool {
			return
		}
	}
	a.probers = append(a.probers, pr)
}

// discover asks the app to run a handler's DNS discovery once it starts.
func (a *HealthApp) discover(d *discovery) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.discoveries = append(a.discoveries, d)
}

// Start starts probing, once each pool has read its record back, and
// looking up.
func (a *HealthApp) Start() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	ctx, cancel := context.WithCancel(context.Background())
	a.cancel = cancel
	for _, pr := range a.probers {
		pr.pool.store.startOnce()
		goSafely(&a.finished, pr.logger, "health checks of pool "+pr.pool.name, func() { pr.run(ctx) })
	}
	for _, d := range a.discoveries {
		goSafely(&a.finished, d.h.logger, "DNS discovery of pool "+d.h.Pool, func() { d.run(ctx) })
	}
	return nil
}

// Stop stops probing and looking up, and waits until every probe and
// lookup has ended.
func (a *HealthApp) Stop() error {
	a.mu.Lock()
	cancel := a.cancel
	a.mu.Unlock()
	if cancel != nil {
		cancel()
	}
	a.finished.Wait()
	return nil
}

// prober probes the workers of one pool, spreading the probes over the
// interval so that a large fleet is not probed in lockstep.
type prober struct {
	pool   *pool
	cfg    *healthConfig
	client *http.Client
	logger *zap.Logger
}

func (pr *prober) run(ctx context.Context) {
	var probes sync.WaitGroup
	defer probes.Wait()
	for _, u := range pr.pool.unverified() { // read back from storage: probed at once, not in turn
		goSafely(&probes, pr.logger, "health probe of "+u, func() { pr.probe(ctx, u) })
	}
	for ctx.Err() == nil {
		urls := pr.pool.urls()
		// Each round takes one interval, give or take a tenth, so that
		// routers started together drift apart.
		round := time.Duration(float64(pr.cfg.interval) * (0.9 + 0.2*rand.Float64()))
		if len(urls) == 0 {
			sleep(ctx, round)
			continue
		}
		for _, u := range urls {
			goSafely(&probes, pr.logger, "health probe of "+u, func() { pr.probe(ctx, u) })
			if !sleep(ctx, round/time.Duration(len(urls))) {
				return
			}
		}
		for _, u := range pr.pool.checkStalls(pr.cfg) {
			pr.logger.Warn("job overran its predicted time; worker gets no new jobs until it ends", zap.String("worker", u))
		}
	}
}

// sleep waits for d, reporting false if ctx ended first.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// probe checks one worker once.
func (pr *prober) probe(ctx context.Context, workerURL string) {
	err := pr.check(ctx, workerURL)
	if ctx.Err() != nil {
		return // shutting down: says nothing of the worker
	}
	switch pr.pool.recordProbe(workerURL, err, pr.cfg) {
	case becameUnhealthy:
		pr.logger.Warn("worker failed its health checks; it gets no jobs until it passes again",
			zap.String("worker", workerURL), zap.Error(err))
	case becameHealthy:
		pr.logger.Info("worker passed its health checks again", zap.String("worker", workerURL))
	case ejectionEnded:
		pr.logger.Info("ejected worker passed a health check; its ejection ends", zap.String("worker", workerURL))
	}
}

// check sends one probe; nil means the worker passed.
func (pr *prober) check(ctx context.Context, workerURL string) error {
	ctx, cancel := context.WithTimeout(ctx, pr.cfg.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, workerURL+pr.cfg.uri, nil)
	if err != nil {
		return err
	}
	resp, err := pr.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxHealthBody))
	switch {
	case err != nil:
		return err
	case pr.cfg.status != 0 && resp.StatusCode != pr.cfg.status:
		return fmt.Errorf("status %d, want %d", resp.StatusCode, pr.cfg.status)
	case pr.cfg.status == 0 && resp.StatusCode/100 != 2:
		return fmt.Errorf("status %d", resp.StatusCode)
	case pr.cfg.body != nil && !pr.cfg.body.Match(body):
		return fmt.Errorf("body does not match %q", pr.cfg.body)
	}
	return nil
}

// healthChange is what a probe result did to a worker.
type healthChange int

const (
	unchanged healthChange = iota
	becameUnhealthy
	becameHealthy
	ejectionEnded
)

// urls returns the pool's worker URLs.
func (p *pool) urls() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]string, len(p.workers))
	for i, w := range p.workers {
		out[i] = w.url
	}
	return out
}

// recordProbe counts a probe result; err nil means it passed.
func (p *pool) recordProbe(url string, err error, cfg *healthConfig) healthChange {
	p.mu.Lock()
	defer p.mu.Unlock()
	w := p.findLocked(url)
	if w == nil {
		return unchanged
	}
	now := p.now().UnixNano()
	w.evidence.lastProbe, w.evidence.lastError = now, ""
	if err == nil {
		change := p.probePassedLocked(w, now, cfg)
		p.dispatchLocked()
		return change
	}
	w.evidence.lastError = err.Error()
	if isTimeout(err) && p.busyLocked(w, now, cfg) {
		return unchanged // slow because it is working, not because it is dead
	}
	w.health.unverified = false // down already; back after health_passes passes, as any unhealthy worker
	w.evidence.probePasses = 0
	w.evidence.probeFails++
	if !w.health.down && w.evidence.probeFails >= cfg.fails {
		w.health.down = true
		// A worker down long enough to fail its probes has most likely
		// lost what it ran; its video jobs give back their slots, so
		// that it comes back with room for new ones.
		p.endVideosOfLocked(w)
		return becameUnhealthy
	}
	return unchanged
}

// probePassedLocked counts a passed probe of w.
func (p *pool) probePassedLocked(w *worker, now int64, cfg *healthConfig) healthChange {
	w.evidence.probeFails = 0
	w.evidence.probePasses++
	p.fleet.recoveredLocked(w)
	if w.health.suspect && !p.overrunningLocked(w, now, cfg) {
		w.health.suspect = false
	}
	change := unchanged
	if now < w.health.ejectedUntil { // as Envoy does: a passed active check ends an ejection
		w.health.ejectedUntil = 0
		change = ejectionEnded
	}
	if w.health.down && (w.evidence.probePasses >= cfg.passes || w.health.unverified) {
		w.health.down = false // one pass admits a worker read back, as one answer admits a worker registered
		change = becameHealthy
	}
	w.health.unverified = false
	return change
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout())
}

// busyLocked reports whether a slow probe answer is explained by work: a job
// still within twice its predicted time, or one finished within the last
// interval.
func (p *pool) busyLocked(w *worker, now int64, cfg *healthConfig) bool {
	if w.load.inflight > 0 && float64(now-w.load.headSince) < 2*p.predictedHeadLocked(w) {
		return true
	}
	return w.load.lastFinish > 0 && now-w.load.lastFinish < int64(cfg.interval)
}

// predictedHeadLocked is how long the running job of w is predicted to take, in
// nanoseconds.
func (p *pool) predictedHeadLocked(w *worker) float64 {
	return w.load.headCost / p.speedOfLocked(w) * float64(time.Second)
}

// overrunningLocked reports whether w's running job has overrun its prediction
// by the stall factor (and at least the probe timeout). A held video job
// never does: nobody waits on its connection, and its worker answers its
// polls.
func (p *pool) overrunningLocked(w *worker, now int64, cfg *healthConfig) bool {
	if w.load.inflight == 0 || w.load.jobs[0].held {
		return false
	}
	limit := max(cfg.stallFactor*p.predictedHeadLocked(w), float64(cfg.timeout))
	return float64(now-w.load.headSince) > limit
}

// checkStalls marks suspect the workers whose running job has overrun its
// prediction, and returns the ones newly marked.
func (p *pool) checkStalls(cfg *healthConfig) []string {
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

// noteOutcomeLocked counts the passive evidence of one proxied request:
// max_fails failures within fail_window eject the worker for eject_time,
// doubling on each repeat up to max_eject_time; a success resets that. It
// reports how long the worker is now ejected for, if it is.
func (p *pool) noteOutcomeLocked(w *worker, o outcome, cfg *healthConfig) time.Duration {
	now := p.now().UnixNano()
	switch o {
	case succeeded:
		w.evidence.ejections, w.evidence.naps = 0, 0
		return 0
	case abandoned, refused:
		return 0
	case asleep:
		p.noteAsleepLocked(w, now)
		return 0
	}
	if cfg == nil || cfg.maxFails == 0 {
		return 0
	}
	since := now - int64(cfg.failWindow)
	kept := w.evidence.recentFails[:0]
	for _, at := range w.evidence.recentFails {
		if at > since {
			kept = append(kept, at)
		}
	}
	w.evidence.recentFails = append(kept, now)
	if len(w.evidence.recentFails) < cfg.maxFails {
		return 0
	}
	d := min(cfg.ejectTime<<min(w.evidence.ejections, 20), cfg.maxEjectTime)
	w.health.ejectedUntil, w.evidence.recentFails = now+int64(d), w.evidence.recentFails[:0]
	w.evidence.ejections++
	w.stats.ejected++
	p.redispatchAtLocked(w.health.ejectedUntil) // jobs may be waiting for it
	return d
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
func (p *pool) noteAsleepLocked(w *worker, now int64) {
	d := min(asleepRecheck<<min(w.evidence.naps, 10), maxAsleepRecheck)
	w.evidence.naps++
	w.health.asleepUntil = now + int64(d)
	p.redispatchAtLocked(w.health.asleepUntil) // jobs may be waiting for it
}

// setDown marks a worker unhealthy after err, until its health probes
// pass again.
func (p *pool) setDown(url string, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if w := p.findLocked(url); w != nil {
		w.health.down, w.evidence.lastError = true, err.Error()
	}
}

// noteCutShort counts a failure against the worker that served t, whose
// answer began and then broke off.
func (p *pool) noteCutShort(t *ticket) {
	p.mu.Lock()
	defer p.mu.Unlock()
	w := p.findLocked(t.servedBy)
	if w == nil {
		return
	}
	w.stats.failures++
	w.evidence.consecFails++
	p.noteOutcomeLocked(w, failed, t.cfg.health)
}

// redispatchAtLocked makes sure free slots are handed to waiting jobs at
// when (Unix nanoseconds), when an ejection ends. One timer serves the
// pool: it is set for the earliest ejection end and, when it fires, for
// the next one.
func (p *pool) redispatchAtLocked(when int64) {
	if p.bg.ctx.Err() != nil || p.ejectionEnds != 0 && p.ejectionEnds <= when {
		return
	}
	p.ejectionEnds = when
	d := time.Duration(when - p.now().UnixNano())
	if p.redispatch == nil {
		p.redispatch = time.AfterFunc(d, p.ejectionEnded)
		return
	}
	p.redispatch.Reset(d)
}

// ejectionEnded hands out jobs to workers whose ejection is over and sets
// the timer for the next ejection to end.
func (p *pool) ejectionEnded() {
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
