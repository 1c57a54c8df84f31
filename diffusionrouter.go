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
	"net/http"
	"net/netip"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(Handler{})
}

// Defaults for options a config leaves out.
const (
	defaultPoolName = "default"
	defaultMaxBody  = 64 << 20
	probeTimeout    = 5 * time.Second
	// reprobeInterval keeps a worker that does not answer its probe from
	// delaying more than one request in this long.
	reprobeInterval = 30 * time.Second
)

// defaultAdminAllow trusts only the machine the router runs on.
var defaultAdminAllow = []string{"127.0.0.0/8", "::1/128"}

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
	// at run time through POST /workers.
	Workers []string `json:"workers,omitempty"`

	// Policy is the routing strategy: least_work (default), least_request,
	// round_robin or random.
	Policy string `json:"policy,omitempty"`

	// MaxInflight is how many jobs a worker is given at once; the rest wait
	// in the pool's queue for the first worker that frees up. Default 1 for
	// least_work (a sglang-diffusion worker runs one job at a time), no limit
	// for the other policies; -1 means no limit.
	MaxInflight int `json:"max_inflight,omitempty"`

	// QueueOrder is which waiting job goes first: fifo (default),
	// largest_first (the longest-processing-time rule, for batch makespan)
	// or smallest_first.
	QueueOrder string `json:"queue_order,omitempty"`

	// QueueTimeout is the longest a job waits in the queue before a 503.
	// Default: no limit beyond the client's own.
	QueueTimeout caddy.Duration `json:"queue_timeout,omitempty"`

	// MaxQueue is how many jobs may wait at once; beyond it 429. Default 10000.
	MaxQueue int `json:"max_queue,omitempty"`

	// DefaultSteps, DefaultSize and DefaultFrames cost the requests that
	// leave num_inference_steps, size or a video's frame count out.
	// Defaults 20, 1024x1024 and 96.
	DefaultSteps  int    `json:"default_steps,omitempty"`
	DefaultSize   string `json:"default_size,omitempty"`
	DefaultFrames int    `json:"default_frames,omitempty"`

	// CFGFactor multiplies the cost of a job that asks for classifier-free
	// guidance (guidance_scale or true_cfg_scale above 1). Default 2.
	CFGFactor float64 `json:"cfg_factor,omitempty"`

	// MaxBody is the largest request body accepted, in bytes. Default 64 MiB.
	MaxBody int64 `json:"max_body,omitempty"`

	// AdminAllow lists the client networks (CIDR or single address) that
	// may call the endpoints that change the fleet. Default: loopback.
	AdminAllow []string `json:"admin_allow,omitempty"`

	// AdminToken, when set, also admits a control call that carries
	// "Authorization: Bearer <token>". Placeholders such as {env.VAR} are
	// expanded when the config loads.
	AdminToken string `json:"admin_token,omitempty"`

	// UpstreamTimeout bounds a whole proxied exchange with a worker. Default:
	// none, because a video can take many minutes.
	UpstreamTimeout caddy.Duration `json:"upstream_timeout,omitempty"`

	// WeightsMode is how POST /update_weights_from_disk updates the fleet
	// when the body names no mode: drain (default: pause, let jobs in
	// flight finish, update all, resume) or rolling (rolling_batch workers
	// at a time while the others serve).
	WeightsMode string `json:"weights_mode,omitempty"`

	// RollingBatch is how many workers a rolling update takes at once.
	// Default 1.
	RollingBatch int `json:"rolling_batch,omitempty"`

	// DrainTimeout bounds the wait for jobs in flight before an update,
	// sleep or wake; beyond it 504 and nothing changes. Default 10m.
	DrainTimeout caddy.Duration `json:"drain_timeout,omitempty"`

	// WeightsTimeout bounds one worker's weight update, sleep or wake call.
	// Default 10m.
	WeightsTimeout caddy.Duration `json:"weights_timeout,omitempty"`

	// WeightsPathPrefix, when set, restricts model_path to paths under one
	// of these prefixes (403 otherwise).
	WeightsPathPrefix []string `json:"weights_path_prefix,omitempty"`

	// HealthURI is the path of the active health probe. Default /health.
	HealthURI string `json:"health_uri,omitempty"`
	// HealthInterval is how often each worker is probed. Default 10s.
	HealthInterval caddy.Duration `json:"health_interval,omitempty"`
	// HealthTimeout bounds one probe. Default 5s.
	HealthTimeout caddy.Duration `json:"health_timeout,omitempty"`
	// HealthFails consecutive failed probes mark a worker unhealthy.
	// Default 3.
	HealthFails int `json:"health_fails,omitempty"`
	// HealthPasses consecutive passed probes bring it back. Default 2.
	HealthPasses int `json:"health_passes,omitempty"`
	// HealthStatus is the status a probe must answer. Default: any 2xx.
	HealthStatus int `json:"health_status,omitempty"`
	// HealthBody is a regular expression the probe's body must match.
	HealthBody string `json:"health_body,omitempty"`
	// StallFactor: a job running this many times longer than predicted
	// (and at least health_timeout) makes its worker suspect: no new jobs
	// until that job ends. Default 5.
	StallFactor float64 `json:"stall_factor,omitempty"`
	// MaxFails failed requests (connection refused or reset, 502, 503)
	// within FailWindow eject a worker for EjectTime, doubling on each
	// repeat up to MaxEjectTime; a success resets the doubling. Defaults 3,
	// 30s, 10s and 5m.
	MaxFails     int            `json:"max_fails,omitempty"`
	FailWindow   caddy.Duration `json:"fail_window,omitempty"`
	EjectTime    caddy.Duration `json:"eject_time,omitempty"`
	MaxEjectTime caddy.Duration `json:"max_eject_time,omitempty"`
	// MinReady is how many serving workers /readyz needs to answer 200.
	// Default 1.
	MinReady int `json:"min_ready,omitempty"`

	// DashboardOff turns the status page at /dashboard off.
	DashboardOff bool `json:"dashboard_off,omitempty"`

	// retryOn lists worker answers that are retried on another worker; it
	// configures the generated reverse_proxy, so only the Caddyfile sets it.
	retryOn []int

	ctx      context.Context // ends when the config is unloaded
	pool     *pool
	dispatch dispatchConfig
	costs    costModel
	weights  weightsConfig
	health   healthConfig
	metrics  poolMetrics
	allow    []netip.Prefix
	token    string
	control  *http.ServeMux
	client   *http.Client
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
// starts nothing and dials nobody, so `caddy validate` is free of effects.
func (h *Handler) Provision(ctx caddy.Context) error {
	h.ctx = ctx
	h.logger = ctx.Logger()
	if err := h.parseOptions(); err != nil {
		return err
	}
	p, err := loadPool(h.Pool)
	if err != nil {
		return err
	}
	h.pool = p
	h.pool.declare(h.Workers)
	h.client = new(http.Client) // every call has its own deadline
	h.control = h.controlMux()
	if err := registerMetrics(ctx); err != nil {
		return err
	}
	h.metrics = newPoolMetrics(p.name, h.Policy)
	app, err := ctx.App("diffusion_health")
	if err != nil {
		return err
	}
	app.(*HealthApp).watch(&prober{pool: p, cfg: &h.health, client: h.client, logger: h.logger})
	return nil
}

// Cleanup withdraws the config's workers and lets go of the pool.
func (h *Handler) Cleanup() error {
	if h.pool == nil {
		return nil
	}
	h.pool.undeclare(h.Workers)
	h.client.CloseIdleConnections()
	releasePool(h.Pool)
	return nil
}

// ServeHTTP answers control endpoints and sends everything else on to the
// reverse_proxy that follows.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	rec := &recorder{ResponseWriterWrapper: &caddyhttp.ResponseWriterWrapper{ResponseWriter: w}}
	class, err := "control", error(nil)
	if h.isControl(r) {
		h.control.ServeHTTP(rec, r) // sets the path values Handler does not
	} else {
		class = endpointClass(r.URL.Path)
		h.startCatchUps()
		err = h.forward(rec, r, next)
	}
	h.metrics.requests.WithLabelValues(class, statusClass(rec.status)).Inc()
	return err
}

// isControl reports whether the router answers r itself. Generation paths
// skip the lookup: they are the bulk of the traffic and never control.
func (h *Handler) isControl(r *http.Request) bool {
	if generationPaths[r.URL.Path] || strings.HasPrefix(r.URL.Path, "/v1/videos/") {
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
