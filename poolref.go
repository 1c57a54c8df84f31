package diffusionrouter

import (
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/control"
	"github.com/miles-rollout/miles-diffusion-router/internal/fleet"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// pools holds every named pool across config reloads: a new config is
// provisioned before the old one is cleaned up, so a pool that both use
// keeps its workers (static and registered at run time) and their counters.
var pools = caddy.NewUsagePool()

// loadPool returns the pool with the given name, creating it on first use.
// Every loadPool must be paired with a releasePool when the module is
// cleaned up.
func loadPool(name string) (*pool, error) {
	v, _, err := pools.LoadOrNew(name, func() (caddy.Destructor, error) {
		return newPool(name), nil
	})
	if err != nil {
		return nil, err
	}
	return v.(*pool), nil
}

// releasePool drops one reference to the named pool; the last one frees it.
func releasePool(name string) {
	_, _ = pools.Delete(name)
}

// poolRef is a module's link to its named pool, for the reverse_proxy
// modules that take the pool name as their only argument.
type poolRef struct {
	// Pool names the worker pool; it must match the diffusion_router
	// handler's. Default: "default".
	Pool string `json:"pool,omitempty"`

	pool *pool
}

// Provision attaches the module to its pool.
func (r *poolRef) Provision(caddy.Context) error {
	if r.Pool == "" {
		r.Pool = defaultPoolName
	}
	p, err := loadPool(r.Pool)
	r.pool = p
	return err
}

// Cleanup lets go of the pool.
func (r *poolRef) Cleanup() error {
	releasePool(r.Pool)
	return nil
}

// unmarshalPoolArg reads `<what> [<pool>]`, which takes no block.
func (r *poolRef) unmarshalPoolArg(d *caddyfile.Dispenser, what string) error {
	d.Next() // module name
	if d.NextArg() {
		r.Pool = d.Val()
	}
	if d.NextArg() {
		return d.ArgErr()
	}
	if d.NextBlock(0) {
		return d.Errf("%s takes no block; set options in diffusion_router", what)
	}
	return nil
}

// pool is a scheduler pool as the router's modules share it, with the
// answers the handler makes from a call to every worker.
type pool struct {
	jobs
	configured
	probed
	observed
	sched    *scheduler.Pool      // all of it, handed to the fleet and the control API, closed with the pool
	fleet    *fleet.Fleet         // its operations over every worker
	store    *fleet.Store         // its record in Caddy's storage
	models   control.SharedAnswer // the union of the workers' model lists
	metrics  control.SharedAnswer // the workers' engine metrics
	election *election            // its standing among the routers that share it
}

func newPool(name string) *pool {
	logger := caddy.Log().Named("diffusion_router").With(zap.String("pool", name))
	p := scheduler.New(name, logger)
	f := fleet.New(p, logger)
	pl := &pool{jobs: p, configured: p, probed: p, observed: p, sched: p, fleet: f, store: fleet.NewStore(p, f, logger)}
	pl.election = newElection(pl, logger)
	f.OnlyWhile(pl.election.Leading)
	return pl
}

// controlled is the pool as the control API sees it.
func (p *pool) controlled() control.Pool { return p.sched }

// Destruct implements caddy.Destructor: the last config using the pool
// is unloaded. A leader resigns first, so that a standby takes over at
// once.
func (p *pool) Destruct() error {
	_ = p.election.elect(nil, "")
	err := p.sched.Close()
	p.fleet.Close() // after the pool's catch-ups, which call workers, ended
	return err
}
