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
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"mime"
	"net/http"
	"net/netip"
	"regexp"
	"strconv"
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
	pool     *Pool
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
	app.(*healthApp).watch(&prober{pool: p, cfg: &h.health, client: h.client, logger: h.logger})
	return nil
}

// parseOptions fills in defaults and turns option strings into the values
// the handler works with.
func (h *Handler) parseOptions() error {
	if h.Pool == "" {
		h.Pool = defaultPoolName
	}
	if err := h.parseDispatch(); err != nil {
		return err
	}
	if err := h.parseCosts(); err != nil {
		return err
	}
	if err := h.parseWeights(); err != nil {
		return err
	}
	if err := h.parseHealth(); err != nil {
		return err
	}
	if h.MaxBody == 0 {
		h.MaxBody = defaultMaxBody
	}
	if h.MaxBody < 0 {
		return fmt.Errorf("max_body must be positive, got %d", h.MaxBody)
	}
	if h.UpstreamTimeout < 0 {
		return fmt.Errorf("upstream_timeout must not be negative")
	}
	for i, raw := range h.Workers {
		u, err := normalizeWorkerURL(raw)
		if err != nil {
			return fmt.Errorf("worker %q: %v", raw, err)
		}
		h.Workers[i] = u
	}
	allow := h.AdminAllow
	if len(allow) == 0 {
		allow = defaultAdminAllow
	}
	prefixes, err := parsePrefixes(allow)
	if err != nil {
		return err
	}
	h.allow = prefixes
	if h.AdminToken != "" {
		h.token = caddy.NewReplacer().ReplaceAll(h.AdminToken, "")
		if h.token == "" {
			return fmt.Errorf("admin_token %q expands to an empty token", h.AdminToken)
		}
	}
	return nil
}

// Defaults of the queue options.
const defaultMaxQueue = 10000

// parseDispatch reads the routing and queue options.
func (h *Handler) parseDispatch() error {
	d := &h.dispatch
	h.Policy = cmp.Or(h.Policy, defaultStrategy)
	var ok bool
	if d.strategy, ok = strategies[h.Policy]; !ok {
		return fmt.Errorf("unknown policy %q (want one of %s)", h.Policy, strategyNames())
	}
	switch {
	case h.MaxInflight > 0:
		d.maxInflight = h.MaxInflight
	case h.MaxInflight == 0 && h.Policy == "least_work":
		d.maxInflight = 1
	case h.MaxInflight < -1:
		return fmt.Errorf("max_inflight must be positive or -1 (no limit), got %d", h.MaxInflight)
	}
	if d.order, ok = queueOrders[cmp.Or(h.QueueOrder, "fifo")]; !ok {
		return fmt.Errorf("unknown queue_order %q (want fifo, largest_first or smallest_first)", h.QueueOrder)
	}
	if h.QueueTimeout < 0 {
		return fmt.Errorf("queue_timeout must not be negative")
	}
	d.timeout = time.Duration(h.QueueTimeout)
	if h.MaxQueue < 0 {
		return fmt.Errorf("max_queue must be positive, got %d", h.MaxQueue)
	}
	d.maxQueue = cmp.Or(h.MaxQueue, defaultMaxQueue)
	return nil
}

// parseCosts reads the cost model's defaults.
func (h *Handler) parseCosts() error {
	c := &h.costs
	var err error
	if c.width, c.height, err = parseSize(cmp.Or(h.DefaultSize, defaultSize)); err != nil {
		return fmt.Errorf("default_size %q is not WIDTHxHEIGHT", h.DefaultSize)
	}
	c.steps = cmp.Or(h.DefaultSteps, defaultSteps)
	c.frames = cmp.Or(h.DefaultFrames, defaultFrames)
	c.cfgFactor = cmp.Or(h.CFGFactor, defaultCFGFactor)
	if c.steps < 0 || c.frames < 0 || c.cfgFactor < 1 {
		return fmt.Errorf("default_steps and default_frames must be positive and cfg_factor at least 1")
	}
	return nil
}

// parseWeights reads the weight update options.
func (h *Handler) parseWeights() error {
	c := &h.weights
	c.mode = cmp.Or(h.WeightsMode, modeDrain)
	if c.mode != modeDrain && c.mode != modeRolling {
		return fmt.Errorf("unknown weights_mode %q (want drain or rolling)", h.WeightsMode)
	}
	if h.RollingBatch < 0 || h.DrainTimeout < 0 || h.WeightsTimeout < 0 {
		return fmt.Errorf("rolling_batch, drain_timeout and weights_timeout must be positive")
	}
	c.rollingBatch = cmp.Or(h.RollingBatch, 1)
	c.drainTimeout = cmp.Or(time.Duration(h.DrainTimeout), defaultDrainTimeout)
	c.timeout = cmp.Or(time.Duration(h.WeightsTimeout), defaultWeightsTimeout)
	c.pathPrefixes = h.WeightsPathPrefix
	return nil
}

// parseHealth reads the health options.
func (h *Handler) parseHealth() error {
	c := &h.health
	c.uri = cmp.Or(h.HealthURI, defaultHealthURI)
	c.interval = cmp.Or(time.Duration(h.HealthInterval), defaultHealthInterval)
	c.timeout = cmp.Or(time.Duration(h.HealthTimeout), defaultHealthTimeout)
	c.fails = cmp.Or(h.HealthFails, defaultHealthFails)
	c.passes = cmp.Or(h.HealthPasses, defaultHealthPasses)
	c.status = h.HealthStatus
	c.stallFactor = cmp.Or(h.StallFactor, defaultStallFactor)
	c.maxFails = cmp.Or(h.MaxFails, defaultMaxFails)
	c.failWindow = cmp.Or(time.Duration(h.FailWindow), defaultFailWindow)
	c.ejectTime = cmp.Or(time.Duration(h.EjectTime), defaultEjectTime)
	c.maxEjectTime = cmp.Or(time.Duration(h.MaxEjectTime), defaultMaxEjectTime)
	h.MinReady = cmp.Or(h.MinReady, 1)
	if !strings.HasPrefix(c.uri, "/") || c.interval <= 0 || c.timeout <= 0 || c.fails < 1 || c.passes < 1 ||
		c.stallFactor < 1 || c.maxFails < 1 || c.failWindow <= 0 || c.ejectTime <= 0 || c.maxEjectTime < c.ejectTime ||
		h.MinReady < 1 || (c.status != 0 && (c.status < 100 || c.status > 599)) {
		return fmt.Errorf("bad health options: health_uri must be a path; durations, counts and min_ready positive; stall_factor at least 1; max_eject_time at least eject_time; health_status a status code")
	}
	if h.HealthBody != "" {
		re, err := regexp.Compile(h.HealthBody)
		if err != nil {
			return fmt.Errorf("health_body: %v", err)
		}
		c.body = re
	}
	h.dispatch.health = c
	return nil
}

// parsePrefixes reads CIDRs and single addresses.
func parsePrefixes(list []string) ([]netip.Prefix, error) {
	out := make([]netip.Prefix, 0, len(list))
	for _, s := range list {
		if p, err := netip.ParsePrefix(s); err == nil {
			out = append(out, p.Masked())
			continue
		}
		a, err := netip.ParseAddr(s)
		if err != nil {
			return nil, fmt.Errorf("admin_allow: %q is neither a CIDR nor an IP address", s)
		}
		out = append(out, netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen()))
	}
	return out, nil
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

// requestIDHeader carries a request's id: the client's, or one the router
// makes; the response echoes it and the worker sees it.
const requestIDHeader = "X-Request-Id"

func requestID(r *http.Request) string {
	if id := r.Header.Get(requestIDHeader); id != "" && len(id) <= 128 {
		return id
	}
	id := strconv.FormatUint(rand.Uint64()|1<<63, 16) // 16 hex digits
	r.Header.Set(requestIDHeader, id)
	return id
}

// forward proxies a request to a worker through next. It first gets the
// request a worker from the pool (a generation may wait in the pool's queue
// for one), and releases that worker once the response has been written.
func (h *Handler) forward(rec *recorder, r *http.Request, next caddyhttp.Handler) error {
	arrived := time.Now()
	id := requestID(r)
	rec.Header().Set(requestIDHeader, id)
	t, status, msg := h.admit(rec, r)
	if status != 0 {
		return writeError(rec, status, msg)
	}
	if t == nil {
		return nil // the client left while waiting
	}
	dispatched := time.Now()
	h.metrics.decisions.Inc()
	if ce := h.logger.Check(zap.DebugLevel, "routed"); ce != nil {
		ce.Write(zap.String("request_id", id), zap.String("worker", t.servedBy), zap.Float64("cost", t.cost),
			zap.String("strategy", h.Policy), zap.Duration("queue_wait", dispatched.Sub(arrived)))
	}
	err := h.proxy(rec, r, t, next)
	if t.job {
		h.logJob(id, r, t, rec.status, dispatched.Sub(arrived), time.Since(dispatched))
	}
	return err
}

// admit reads and costs r and gets it a worker. A non-zero status refuses
// r with that status and message; a nil ticket means the client left.
func (h *Handler) admit(rec *recorder, r *http.Request) (*ticket, int, string) {
	t, status, msg := h.ticketFor(r)
	if status == 0 {
		status, msg = h.readBody(rec, r, t)
	}
	if status != 0 {
		return nil, status, msg
	}
	if err := h.pool.acquire(r.Context(), t); err != nil {
		if r.Context().Err() != nil {
			return nil, 0, ""
		}
		rec.Header().Set("Retry-After", strconv.Itoa(retryAfter(t)))
		status, msg := queueError(h.pool, t, err)
		return nil, status, msg
	}
	return t, 0, ""
}

// proxy sends r to t's worker through next and releases the worker: when
// the answer begins (the generation is done; megabytes of base64 may still
// be on their way, but the worker's slot is free), or when a video job it
// started ends.
func (h *Handler) proxy(rec *recorder, r *http.Request, t *ticket, next caddyhttp.Handler) error {
	ctx := withTicket(r.Context(), t)
	if h.UpstreamTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, time.Duration(h.UpstreamTimeout))
		defer cancel()
	}
	released := false
	release := func(o outcome) {
		if released {
			return
		}
		released = true
		if d := h.pool.release(t, o); d > 0 {
			h.logger.Warn("worker ejected after failed requests", zap.String("worker", t.servedBy), zap.Duration("for", d))
		}
	}
	rec.ticket = t
	if readsVideoJob(r) {
		rec.peekLimit = maxVideoResponsePeek
	} else {
		rec.onHeader = func(status int) { release(outcomeOf(r.Context(), nil, status)) }
	}
	err := next.ServeHTTP(rec, r.WithContext(ctx))
	if !h.trackVideoJob(r, t, rec, err) {
		release(outcomeOf(r.Context(), err, rec.status))
	}
	if err != nil && rec.status == 0 {
		return h.proxyError(ctx, rec, t, err)
	}
	return err // non-nil only when the response had begun; Caddy logs it
}

// logJob logs a finished generation job and records its metrics. No
// prompt or image data is logged.
func (h *Handler) logJob(id string, r *http.Request, t *ticket, status int, waited, took time.Duration) {
	h.metrics.observeJob(t, waited, took)
	ce := h.logger.Check(zap.InfoLevel, "job finished")
	if ce == nil {
		return
	}
	ce.Write(
		zap.String("request_id", id),
		zap.String("endpoint", endpointClass(r.URL.Path)),
		zap.String("worker", t.servedBy),
		zap.Float64("cost", t.cost),
		zap.Duration("queue_wait", waited),
		zap.Duration("latency", took),
		zap.Int("status", status),
		zap.String("weight_version", t.servedVersion),
	)
}

// outcomeOf tells how the exchange with the worker ended, as evidence of
// the worker's health.
func outcomeOf(clientCtx context.Context, err error, status int) outcome {
	switch {
	case clientCtx.Err() != nil:
		return abandoned
	case err != nil, status == http.StatusBadGateway, status == http.StatusServiceUnavailable:
		return failed
	}
	return succeeded
}

// retryAfter suggests when a refused job might find a worker, in seconds.
func retryAfter(t *ticket) int {
	return max(1, int(t.cfg.timeout.Seconds()))
}

// ticketFor works out which workers may serve r. A non-zero status means r
// must be refused with that status and message.
func (h *Handler) ticketFor(r *http.Request) (*ticket, int, string) {
	t := &ticket{pool: h.pool, cfg: &h.dispatch, wantVersion: r.Header.Get(weightVersionHeader)}
	id, isJobPath := videoJobID(r.URL.Path)
	switch {
	case isJobPath:
		worker, ok := h.pool.videos.worker(id)
		if !ok {
			return nil, http.StatusNotFound, "Unknown video_id"
		}
		t.pin = worker
	case r.URL.Path == "/v1/videos":
		t.task = videoTask
		h.probeUnknown(r.Context())
		if !h.pool.canServe(videoTask) {
			return nil, http.StatusBadRequest, "No video-capable workers available in current worker pool."
		}
	case strings.HasPrefix(r.URL.Path, "/v1/images/"):
		t.task = imageTask
		h.probeUnknown(r.Context())
	}
	t.job = r.Method == http.MethodPost && generationPaths[r.URL.Path]
	return t, 0, ""
}

// videoJobID returns the job id of /v1/videos/{id} and /v1/videos/{id}/content.
func videoJobID(path string) (string, bool) {
	rest, ok := strings.CutPrefix(path, "/v1/videos/")
	if !ok {
		return "", false
	}
	id, tail, _ := strings.Cut(rest, "/")
	if id == "" || (tail != "" && tail != "content") {
		return "", false
	}
	return id, true
}

// generationPaths are the endpoints whose POSTs are generation jobs: they
// occupy a worker, so they are costed, take a slot and may wait for one.
var generationPaths = map[string]bool{
	"/v1/images/generations": true,
	"/v1/images/edits":       true,
	"/v1/diffusion/generate": true,
	"/v1/videos":             true,
	"/rollout/generate":      true,
}

// readBody caps the request body at max_body. A generation's body is read
// whole, once, to cost the job, so a bad one fails here with a message
// naming the field instead of on a worker; other bodies stream through.
func (h *Handler) readBody(w http.ResponseWriter, r *http.Request, t *ticket) (int, string) {
	if r.ContentLength > h.MaxBody {
		return http.StatusRequestEntityTooLarge, tooLarge(h.MaxBody)
	}
	if r.Body == nil || r.Body == http.NoBody {
		r.Body = http.NoBody
	}
	r.Body = http.MaxBytesReader(w, r.Body, h.MaxBody)
	if !t.job {
		return 0, ""
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		if isMaxBytes(err) {
			return http.StatusRequestEntityTooLarge, tooLarge(h.MaxBody)
		}
		return http.StatusBadRequest, "reading request body: " + err.Error()
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	f, err := requestFields(body, r.Header.Get("Content-Type"))
	if err == nil {
		t.cost, err = h.costs.cost(r.URL.Path, f)
	}
	if err != nil {
		return http.StatusBadRequest, err.Error()
	}
	return 0, ""
}

// requestFields reads a generation's parameters. A msgpack or other binary
// body is passed on unread and costed by the pool's defaults.
func requestFields(body []byte, contentType string) (fields, error) {
	mt, _, _ := mime.ParseMediaType(contentType)
	switch {
	case strings.HasPrefix(mt, "multipart/"):
		return formFields(body, contentType)
	case mt == "application/msgpack", mt == "application/x-msgpack", mt == "application/octet-stream":
		return fields{}, nil
	}
	// The workers read every other body as JSON, whatever the client called
	// it (curl -d says x-www-form-urlencoded).
	return jsonFields(body)
}

func tooLarge(limit int64) string {
	return fmt.Sprintf("request body is larger than max_body (%d bytes)", limit)
}

// proxyError answers a request whose proxying failed before any response
// was written, with a JSON error a client can act on.
func (h *Handler) proxyError(ctx context.Context, w http.ResponseWriter, t *ticket, err error) error {
	status := http.StatusBadGateway
	if he, ok := errors.AsType[caddyhttp.HandlerError](err); ok && he.StatusCode != 0 {
		status = he.StatusCode
	}
	var msg string
	switch {
	case status == 499:
		return nil // the client went away; nobody reads an answer
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		status, msg = http.StatusGatewayTimeout, fmt.Sprintf("worker did not answer within upstream_timeout (%s)", time.Duration(h.UpstreamTimeout))
	case isMaxBytes(err):
		status, msg = http.StatusRequestEntityTooLarge, tooLarge(h.MaxBody)
	case status == http.StatusServiceUnavailable:
		_, msg = queueError(h.pool, t, errNoWorker)
	default:
		msg = "Worker request failed: " + err.Error()
	}
	h.logger.Warn("proxying to worker failed", zap.Int("status", status), zap.Error(err))
	return writeError(w, status, msg)
}

func isMaxBytes(err error) bool {
	_, ok := errors.AsType[*http.MaxBytesError](err)
	return ok
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
)
