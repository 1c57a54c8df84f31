// Package diffusionrouter turns Caddy into the front door of a diffusion
// rollout cluster: it spreads image and video generation requests over
// sglang-diffusion workers, keeps video job polls on the worker that made
// the job, and answers the control API of the Python sglang-diffusion
// router and of miles, so their clients work unchanged.
//
// Three modules share one named pool of workers, kept across config
// reloads: the handler diffusion_router (control endpoints, request
// bookkeeping), the reverse_proxy selection policy `diffusion` (which worker
// serves) and the reverse_proxy upstream source `diffusion` (which workers
// exist now). The Caddyfile directive diffusion_router expands into the
// handler followed by Caddy's own reverse_proxy wired to both.
package diffusionrouter

import (
	"context"
	"fmt"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/answer"
	"github.com/miles-rollout/miles-diffusion-router/internal/attempt"
	"github.com/miles-rollout/miles-diffusion-router/internal/control"
	"github.com/miles-rollout/miles-diffusion-router/internal/fleet"
	"github.com/miles-rollout/miles-diffusion-router/internal/jobkinds"
	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/workerurl"
)

func init() {
	caddy.RegisterModule(Handler{})
}

// Handler is the HTTP handler diffusion_router. It answers the control
// endpoints (worker registration, health, model list) itself, and prepares
// every other request for the reverse_proxy that follows it: a ticket that
// says which workers may serve the request, a bounded request body, and
// afterwards the release of the worker and a JSON error where the proxy
// failed.
type Handler struct {
	// Pool names the worker pool shared with `lb_policy diffusion` and
	// `dynamic diffusion`. Default: "default".
	Pool string `json:"pool,omitempty"`

	// Workers are the worker URLs the config lists. Workers can also join
	// at run time through POST /workers, or be found through DNS.
	Workers []string `json:"workers,omitempty"`

	// Discovery finds workers through DNS: the A/AAAA or SRV records of
	// names, looked up again on an interval.
	Discovery Discovery `json:"discovery,omitzero"`

	// LoadBalancing is how a worker is chosen for each job.
	LoadBalancing LoadBalancing `json:"load_balancing,omitzero"`

	// Queue is where jobs wait when every fitting worker is full.
	Queue Queue `json:"queue,omitzero"`

	// Cost is how a job's cost is worked out from its request.
	Cost CostModel `json:"cost,omitzero"`

	// HealthChecks is how the router tells which workers may get jobs.
	HealthChecks HealthChecks `json:"health_checks,omitzero"`

	// Weights is how weight updates, sleep and wake run over the fleet.
	Weights Weights `json:"weights,omitzero"`

	// Admin is who may call the endpoints that change the fleet.
	Admin Admin `json:"admin,omitzero"`

	// Answers is how much of the workers' answers is held back until they
	// are whole.
	Answers Answers `json:"answers,omitzero"`

	// MaxBody is the largest request body accepted, in bytes. Default 64 MiB.
	MaxBody int64 `json:"max_body,omitempty"`

	// MaxBodyTotal bounds the bytes of generation bodies held at once,
	// over every request of this handler, from their first byte until
	// their request ends. A body that declares its length takes room for
	// all of it at its first byte, though memory only as its bytes arrive;
	// one that does not takes room as its bytes arrive. When it is full no
	// body is read further, and one that waits 5 s for room gets 503. An
	// eighth of it is kept for bodies that declare at most 1 MiB, less
	// where a body of max_body would not fit beside it. Default 256 MiB,
	// or 8/7 of max_body where that is larger; never below max_body.
	MaxBodyTotal int64 `json:"max_body_total,omitempty"`

	// BodyTimeout is the longest a generation's whole body may take to
	// arrive; past it the request gets 408 and its memory is freed.
	// Default 60s.
	BodyTimeout caddy.Duration `json:"body_timeout,omitempty"`

	// UpstreamTimeout bounds a whole proxied exchange with a worker. Default:
	// none, because a video can take many minutes.
	UpstreamTimeout caddy.Duration `json:"upstream_timeout,omitempty"`

	// ForwardPaths, when set, are the only paths sent on to workers; any
	// other path that is not the router's own gets 404. A path ending in *
	// is a prefix, and "sglang" stands for every path sglang-diffusion
	// serves. Default: every path, as the Python router does.
	ForwardPaths []string `json:"forward_paths,omitempty"`

	// MaxWorkers is how many workers the pool may have; a registration
	// beyond it gets 429. Default 4096.
	MaxWorkers int `json:"max_workers,omitempty"`

	// Adapters are the LoRA policies the pool serves, each on the workers
	// that hold it (see docs/lora.md). Default: none, and every request
	// runs on whatever a worker has.
	Adapters []Adapter `json:"adapters,omitempty"`

	// AdapterFrom is where a request names its adapter: a placeholder
	// evaluated per request (a constant gives every request of the site
	// one adapter). Default: the OpenAI "model" field of the body. No
	// name, or the base model's id, runs on the base weights.
	AdapterFrom string `json:"adapter_from,omitempty"`

	// Placement is how the pool moves adapters between its workers.
	Placement Placement `json:"placement,omitzero"`

	// DashboardOff turns the status page at /dashboard off.
	DashboardOff bool `json:"dashboard_off,omitempty"`

	// PersistOff keeps the pool's fleet out of Caddy's storage: workers
	// registered at run time, workers held back and the last weight update
	// are then neither written on change nor read back when the process
	// starts. Default: kept, under diffusion_router/<pool>/fleet.json.
	// With ha, the record lives in etcd whatever this says, and it only
	// keeps the first leader from seeding it from Caddy's storage.
	PersistOff bool `json:"persist_off,omitempty"`

	// HA makes the router one of several that share the pool, of which
	// one, elected, serves it. Default: none, the router is the pool's
	// only one.
	HA HA `json:"ha,omitzero"`

	ctx      context.Context // ends when the config is unloaded
	pool     *pool
	dispatch scheduler.Config
	maxStale scheduler.VersionPolicy // weights.version_policy: the jobs that ask for none run under it
	costs    request.Model
	bodies   *request.BodyBudget
	weights  fleet.Config
	health   scheduler.HealthConfig
	attempts attempt.Runner
	metrics  poolMetrics
	tenants  map[string]bool // the tenants listed; nil: every name is one
	allow    []netip.Prefix
	token    string
	api      *control.API
	control  *http.ServeMux // the api's routes
	guard    *workerurl.Guard
	found    *discovery // nil without DNS names
	ha       *haConfig  // nil without `ha`
	forwards pathSet
	logger   *zap.Logger
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.diffusion_router",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision checks the options and attaches the handler to its pool. It
// starts nothing, dials nobody and reads no storage, so `caddy validate`
// is free of effects.
func (h *Handler) Provision(ctx caddy.Context) error {
	h.ctx = ctx
	h.logger = ctx.Logger()
	if err := h.provisionOptions(); err != nil {
		return err
	}
	h.guard = newDialGuard(ctx)
	for _, u := range h.Workers {
		if h.guard.RefusesURL(u) {
			return optionError("workers", "workers", "%q: %v", u, workerurl.ErrAdmin)
		}
	}
	found, err := newDiscovery(ctx, h)
	if err != nil {
		return err
	}
	p, err := loadPool(h.Pool)
	if err != nil {
		return err
	}
	h.pool = p
	p.fleet.UseGuard(h.guard)
	p.SetInitialSpeed(h.LoadBalancing.InitialSpeed)
	var storage fleet.Storage // nil: persist off
	if !h.PersistOff {
		storage = ctx.Storage()
	}
	if h.ha != nil {
		storage = &groupRecord{election: p.election, seed: storage}
	}
	p.store.Use(h, storage, fleet.Rules{MaxWorkers: h.MaxWorkers, Guard: h.guard, Weights: &h.weights})
	h.pool.Declare(h.Workers)
	p.DeclareAdapters(h.adapters(), h.placement())
	if found != nil {
		h.found = found
		found.declare()
	}
	h.api = &control.API{
		Pool: p.controlled(), Fleet: p.fleet, Store: p.store, Logger: h.logger, Allow: h.allow, Token: h.token,
		AllowIsDefault: len(h.Admin.Allow) == 0, Proxied: throughProxy, ClientIP: clientIP, Guard: h.guard, MaxWorkers: h.MaxWorkers, MinReady: h.HealthChecks.MinReady,
		Policy: h.LoadBalancing.Policy, Dashboard: !h.DashboardOff,
		Models: &p.models, EngineMetrics: &p.metrics,
		AbortMemory: time.Duration(h.Queue.AbortMemory),
	}
	h.wireWeights(h.api)
	if h.ha != nil {
		h.api.HA = p.election
	}
	h.control = h.api.Mux()
	if err := registerMetrics(ctx); err != nil {
		return err
	}
	h.metrics = newPoolMetrics(p.Name(), h.LoadBalancing.Policy)
	h.attempts.Pool, h.attempts.Kinds, h.attempts.Proxy = p.jobs, jobkinds.New(p.jobs), reverseProxy
	h.attempts.UpstreamTimeout, h.attempts.RetryOn = time.Duration(h.UpstreamTimeout), h.LoadBalancing.RetryOn
	h.attempts.Metrics, h.attempts.Logger = h.metrics.runs, h.logger
	app, err := ctx.App("diffusion_health")
	if err != nil {
		return err
	}
	app.(*HealthApp).watch(&prober{pool: p, cfg: &h.health, client: p.fleet.Client(), logger: h.logger, switcher: fleet.NewSwitcher(p.fleet), weights: &h.weights, ha: h.ha})
	if found != nil {
		app.(*HealthApp).discover(found)
	}
	return nil
}

// Cleanup withdraws the config's workers and DNS lookups and lets go of
// the pool.
func (h *Handler) Cleanup() error {
	if h.pool == nil {
		return nil
	}
	h.pool.store.Drop(h) // before undeclaring: Caddy stopping is not recorded as the config's workers leaving
	h.pool.Undeclare(h.Workers)
	h.pool.UndeclareAdapters(h.adapters())
	if h.found != nil {
		h.found.undeclare()
	}
	releasePool(h.Pool)
	return nil
}

// ServeHTTP answers control endpoints and sends everything else on to the
// reverse_proxy that follows.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	h.pool.store.AwaitReady(r.Context()) // as the process starts: the fleet read back from storage first
	rec := attempt.NewRecorder(w)
	h.settleVariant(r)
	route := request.Endpoints.Match(r.Method, r.URL)
	dotted := hasDotSegment(r.URL.Path)
	answered := !dotted && h.isControl(r, route)
	class, err := route.Class, error(nil)
	if answered {
		class = "control"
	}
	switch {
	case dotted:
		err = answer.WriteError(rec, http.StatusBadRequest, "the path must not have . or .. segments")
	case !h.pool.election.Leading() && !standbyServes(r, answered):
		err = h.refuseAsStandby(rec)
	case !answered && hasEscapedSeparator(r.URL):
		err = answer.WriteError(rec, http.StatusBadRequest, "the path must not hold %2F, %5C or \\: a worker decodes them and would read another path")
	case !answered && !h.forwards.has(r.URL.Path):
		err = answer.WriteError(rec, http.StatusNotFound, fmt.Sprintf("path %s is not sent to workers (forward_paths)", r.URL.Path))
	case !answered:
		r.URL.RawPath = "" // the worker gets the path as the router read it
		h.pool.fleet.StartCatchUps(&h.weights)
		err = h.forward(rec, r, route, next)
	case r.ContentLength > control.MaxBody:
		rec.Header().Set("Connection", "close") // the body stays unread
		err = answer.WriteError(rec, http.StatusRequestEntityTooLarge, fmt.Sprintf("request body is larger than the %d bytes a control call may send", control.MaxBody))
	default:
		h.control.ServeHTTP(rec, r) // sets the path values Handler does not
	}
	h.metrics.requests.WithLabelValues(class, statusClass(rec.Status())).Inc()
	return err
}

// settleVariant makes r a request for the path its path is a variant of
// (a trailing or repeated slash, ;params: see request.Canonical) when the
// router answers or refuses that path, so that the variant is answered
// or refused as it is, in whatever forwarding mode, and never reaches a
// worker. A variant of a path that goes to the workers goes on as it
// came, decided by itself.
func (h *Handler) settleVariant(r *http.Request) {
	c, ok := request.Canonical(r.URL)
	if !ok {
		return
	}
	variant := r.URL
	r.URL = c
	if !h.forwarded(r, request.Endpoints.Match(r.Method, c)) {
		return
	}
	r.URL = variant
}

// forwarded reports whether r, which goes to route, is sent on to a
// worker: not answered by the router, nor refused for its path.
func (h *Handler) forwarded(r *http.Request, route request.Route) bool {
	return !hasDotSegment(r.URL.Path) && !h.isControl(r, route) && !hasEscapedSeparator(r.URL) && h.forwards.has(r.URL.Path)
}

// hasDotSegment reports whether path has a . or .. segment, which would
// let /v1/videos/../update_weights_from_disk pass the router's own
// endpoints by and reach a worker that resolves it.
func hasDotSegment(path string) bool {
	for seg := range strings.SplitSeq(path, "/") {
		if seg == "." || seg == ".." {
			return true
		}
	}
	return false
}

// hasEscapedSeparator reports whether u's path holds an escaped / or \, or
// a \ at all. Workers decode the path before they route it (uvicorn
// does), so /v1%2Fset_lora, one segment to the router's endpoints, reaches
// a worker's /v1/set_lora. Only the router's own
// endpoints take such a path: /workers/{id} names a worker by its escaped
// URL.
func hasEscapedSeparator(u *url.URL) bool {
	return strings.Contains(u.Path, `\`) || strings.Contains(strings.ToLower(u.RawPath), "%2f")
}

// isControl reports whether the router answers r itself. Paths of the
// endpoint table skip the lookup: they are the bulk of the traffic and
// never control.
func (h *Handler) isControl(r *http.Request, route request.Route) bool {
	if route.Kind != request.Forwarded {
		return false
	}
	_, pattern := h.control.Handler(r)
	return pattern != ""
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
)
