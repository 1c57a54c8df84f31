package diffusionrouter

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/fleet"
	"github.com/miles-rollout/miles-diffusion-router/internal/ha"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
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
	// Half the pool: diffusion fleets are of a few to tens of workers,
	// where Envoy's 10% would let one bad worker of eight out at most.
	defaultMaxEjectionPercent = 50
	maxHealthBody             = 64 << 10
)

// HealthApp runs the active health checks of the pools its config uses,
// starts each pool the first time (reads its record back from Caddy's
// storage and keeps it written, see fleetStore), runs each pool's
// election as the config's `ha` says, and runs the config's DNS discovery
// of workers. diffusion_router adds it to the config it is part
// of, so probing and lookups start when Caddy starts that config and stop
// when it is unloaded, and `caddy validate`, which starts nothing, probes,
// reads and looks up nothing.
type HealthApp struct {
	ctx         caddy.Context // for the http app, which says where the routers listen
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

// Provision keeps the config's context.
func (a *HealthApp) Provision(ctx caddy.Context) error {
	a.ctx = ctx
	return nil
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

// Start starts each pool's election, probing once each pool has read its
// record back, and looking up.
func (a *HealthApp) Start() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, d := range a.discoveries { // first: a config that cannot reach its API starts nothing
		if err := d.connect(); err != nil {
			return err
		}
	}
	if err := a.elect(); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	a.cancel = cancel
	for _, pr := range a.probers {
		pr.pool.store.StartOnce()
		scheduler.GoSafely(&a.finished, pr.logger, "health checks of pool "+pr.pool.Name(), func() { pr.run(ctx) })
	}
	for _, d := range a.discoveries {
		scheduler.GoSafely(&a.finished, d.h.logger, "discovery of pool "+d.h.Pool, func() { d.run(ctx) })
	}
	return nil
}

// elect runs each pool's election as the config says: a campaign lives
// with the pool, not the config, so that a reload hands nothing over.
func (a *HealthApp) elect() error {
	var app *caddyhttp.App
	for _, pr := range a.probers {
		var cfg *ha.Config
		key := ""
		if pr.ha != nil {
			if app == nil {
				v, err := a.ctx.App("http")
				if err != nil {
					return err
				}
				app = v.(*caddyhttp.App)
			}
			c, k := pr.ha.campaign(app)
			cfg, key = &c, k
		}
		if err := pr.pool.election.elect(cfg, key); err != nil {
			return err
		}
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
	pool     *pool
	cfg      *scheduler.HealthConfig
	client   *http.Client
	logger   *zap.Logger
	switcher scheduler.Switcher // how the pool changes workers' adapters, once the router leads
	weights  *fleet.Config      // how a worker found again after it missed an update catches up
	ha       *haConfig          // the pool's HA group; nil: the router is the pool's only one
}

// run probes while the router is its pool's active one, and waits while
// it stands by: a standby calls no worker.
func (pr *prober) run(ctx context.Context) {
	election := pr.pool.election
	for ctx.Err() == nil {
		changed := election.changes() // taken first, so that no change is missed
		if election.Leading() {
			pr.lead(ctx)
			continue
		}
		select {
		case <-ctx.Done():
		case <-changed:
		}
	}
}

// lead probes the workers until ctx ends or the router no longer leads.
// From the first time the router leads, placement may switch adapters:
// a router that loses the lead keeps it, for the jobs it holds.
func (pr *prober) lead(ctx context.Context) {
	var probes sync.WaitGroup
	defer probes.Wait()
	pr.pool.UseSwitcher(pr.switcher)
	// Read back from storage, or not probed since the router took the
	// lead: probed at once, not in turn.
	for _, u := range pr.pool.Unverified() {
		scheduler.GoSafely(&probes, pr.logger, "health probe of "+u, func() { pr.probe(ctx, u) })
	}
	for ctx.Err() == nil && pr.pool.election.Leading() {
		pr.round(ctx, &probes)
	}
}

// round probes every worker once over an interval, give or take a tenth,
// so that routers started together drift apart.
func (pr *prober) round(ctx context.Context, probes *sync.WaitGroup) {
	urls := pr.pool.URLs()
	round := time.Duration(float64(pr.cfg.Interval) * (0.9 + 0.2*rand.Float64()))
	if len(urls) == 0 {
		scheduler.Sleep(ctx, round)
		return
	}
	for _, u := range urls {
		scheduler.GoSafely(probes, pr.logger, "health probe of "+u, func() { pr.probe(ctx, u) })
		if !scheduler.Sleep(ctx, round/time.Duration(len(urls))) || !pr.pool.election.Leading() {
			return
		}
	}
	for _, u := range pr.pool.CheckStalls(pr.cfg) {
		pr.logger.Warn("job overran its predicted time; worker gets no new jobs until it ends", zap.String("worker", u))
	}
}

// probe checks one worker once.
func (pr *prober) probe(ctx context.Context, workerURL string) {
	err := pr.check(ctx, workerURL)
	if ctx.Err() != nil {
		return // shutting down: says nothing of the worker
	}
	change := pr.pool.RecordProbe(workerURL, err, pr.cfg)
	if err == nil {
		pr.pool.fleet.StartCatchUps(pr.weights) // a worker found again may have missed an update meanwhile
	}
	switch change {
	case scheduler.BecameUnhealthy:
		pr.logger.Warn("worker failed its health checks; it gets no jobs until it passes again",
			zap.String("worker", workerURL), zap.Error(err))
	case scheduler.BecameHealthy:
		pr.logger.Info("worker passed its health checks again", zap.String("worker", workerURL))
	case scheduler.EjectionEnded:
		pr.logger.Info("ejected worker passed a health check with no other worker serving; it is back on probation", zap.String("worker", workerURL))
	case scheduler.BackUp:
		pr.logger.Info("worker ejected for connections it did not answer passed its health checks again; it is back on probation", zap.String("worker", workerURL))
	}
}

// check sends one probe; nil means the worker passed.
func (pr *prober) check(ctx context.Context, workerURL string) error {
	ctx, cancel := context.WithTimeout(ctx, pr.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, workerURL+pr.cfg.URI, nil)
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
	case pr.cfg.Status != 0 && resp.StatusCode != pr.cfg.Status:
		return fmt.Errorf("status %d, want %d", resp.StatusCode, pr.cfg.Status)
	case pr.cfg.Status == 0 && resp.StatusCode/100 != 2:
		return fmt.Errorf("status %d", resp.StatusCode)
	case pr.cfg.Body != nil && !pr.cfg.Body.Match(body):
		return fmt.Errorf("body does not match %q", pr.cfg.Body)
	}
	return nil
}
