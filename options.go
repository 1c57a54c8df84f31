package diffusionrouter

import (
	"cmp"
	"fmt"
	"math"
	"net/netip"
	"regexp"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/miles-rollout/miles-diffusion-router/internal/answer"
	"github.com/miles-rollout/miles-diffusion-router/internal/kubediscovery"
	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/workerurl"
)

// The handler's options, grouped in its JSON config the way reverse_proxy
// groups its own. The Caddyfile reads only their syntax; the checks of
// their values are all here, run when the config is provisioned, and
// every error names the option both as the Caddyfile and the JSON spell it.

// LoadBalancing is how a worker is chosen for each job.
type LoadBalancing struct {
	// Policy is the routing strategy: least_work (default: the worker that
	// will finish the job soonest), least_request, round_robin or random.
	Policy string `json:"policy,omitempty"`

	// MaxInflight is how many jobs a worker is given at once; the rest wait
	// in the pool's queue for the first worker that frees up. Default 1 for
	// least_work (a sglang-diffusion worker runs one job at a time), no
	// limit for the other policies; -1 means no limit.
	MaxInflight int `json:"max_inflight,omitempty"`

	// MaxAttempts is how many workers a job may be sent to. A job whose
	// worker fails it before any byte of the answer reached the client
	// (connection refused or reset, 502, 503, 504, a status in RetryOn, an
	// answer that the worker is asleep) runs again on another worker, ahead
	// of jobs that came after it. A video job runs again only when its
	// worker gave no answer. Default 3; 1 turns re-runs off.
	MaxAttempts int `json:"max_attempts,omitempty"`

	// RetryOn lists more worker answers (status codes, 400-599) after which
	// a job runs again on another worker, besides 502, 503 and 504.
	RetryOn []int `json:"retry_on,omitempty"`

	// HedgeAfter: a job still unanswered after this many times its
	// predicted time (the prediction of now, which the first jobs
	// completed revise for one sent before, see InitialSpeed; and at
	// least health_checks.active.timeout, as for the stall rule), while
	// another worker that may serve it is idle and no job waits, gets a
	// second copy on that worker; the first answer goes to the client and
	// the others are cancelled. A copy that overruns in its turn gets a
	// copy of its own, and one that fails another, within MaxAttempts.
	// Default: the stall factor
	// (health_checks.passive.stall_factor); -1 turns hedging off.
	HedgeAfter float64 `json:"hedge_after,omitempty"`

	// InitialSpeed is the speed, in cost units per second, every worker
	// is assumed to have until one of the pool's workers has completed a
	// job; from then on a worker that has completed none is assumed to
	// have the median of the learned speeds. It sets the first jobs'
	// predictions: where least_work sends them, when they get a copy and
	// when their worker is suspect. Default 1 (a 20-step 1024x1024 image
	// in 20 s). Of configs that share a pool, the one loaded last sets it.
	InitialSpeed float64 `json:"initial_speed,omitempty"`
}

// Queue is where jobs wait when every worker that may serve them is full.
type Queue struct {
	// Order is which waiting job goes first: adaptive (default: arrival
	// order until the queue is long, as when a rollout step arrives, then
	// the largest first among jobs that came together), fifo,
	// largest_first (the longest-processing-time rule, for batch
	// makespan) or smallest_first (for mean latency).
	Order string `json:"order,omitempty"`

	// Timeout is the longest a job waits before a 503. Default: no limit
	// beyond the client's own.
	Timeout caddy.Duration `json:"timeout,omitempty"`

	// MaxJobs is how many jobs may wait at once; beyond it 429. Default 10000.
	MaxJobs int `json:"max_jobs,omitempty"`

	// Priority is each job's priority, a placeholder evaluated per request
	// (for example {http.request.header.X-Priority}) that gives an
	// integer: among waiting jobs a higher one goes first. An empty value
	// is 0; one that is no integer gets 400. Default: every job 0.
	Priority string `json:"priority,omitempty"`

	// MaxPriority bounds priorities: they are clamped to -MaxPriority to
	// MaxPriority. Default 10.
	MaxPriority int `json:"max_priority,omitempty"`

	// PriorityMaxWait is the longest a job waits while jobs of higher
	// priority go first: then it goes to the next worker that frees up and
	// may serve it. -1: no limit. Default 1m.
	PriorityMaxWait caddy.Duration `json:"priority_max_wait,omitempty"`

	// AbortMemory is how long POST /abort_request remembers the request
	// ids and prefixes it aborted: a job that arrives with one meanwhile,
	// such as a client's resend of an aborted job, is refused with 409 at
	// once. Default 5m (miles resends a failed request for about a
	// minute); -1 remembers nothing.
	AbortMemory caddy.Duration `json:"abort_memory,omitempty"`

	// Tenant is each job's tenant, a placeholder evaluated per request
	// (for example {http.request.header.X-Tenant}): while several tenants
	// have jobs waiting, each gets a share of the GPU time, counted in
	// cost, proportional to its weight. A name is at most 64 of A-Z a-z
	// 0-9 . _ -, else 400; an empty value is the tenant "other". Default:
	// no tenants.
	Tenant string `json:"tenant,omitempty"`

	// Tenants, when set, are the only tenant names the pool tells apart:
	// a job naming any other is the tenant "other"'s, as one naming none
	// is, so that a client splitting its jobs over invented names gets no
	// more than one share. Default: every valid name is a tenant.
	Tenants []string `json:"tenants,omitempty"`

	// TenantWeights is each tenant's weight, by name. Default 1.
	TenantWeights map[string]float64 `json:"tenant_weights,omitempty"`

	// TenantMaxQueue is how many jobs one tenant may have waiting; beyond
	// it 429 naming the tenant. Default: no limit but MaxJobs.
	TenantMaxQueue int `json:"tenant_max_queue,omitempty"`

	// MaxTenants is how many tenants the pool tracks (and shows in the
	// metrics); a new one beyond them takes an idle one's place, or
	// shares the tenant "other" while all are active. Default 64, or the
	// number of Tenants when more; it may not be less than that.
	MaxTenants int `json:"max_tenants,omitempty"`
}

// CostModel is how a job's cost is worked out from its request, for the
// fields the request leaves out.
type CostModel struct {
	// DefaultSteps is the num_inference_steps of a request that names none.
	// Default 20.
	DefaultSteps int `json:"default_steps,omitempty"`

	// DefaultSize is the size, WIDTHxHEIGHT, of a request that gives
	// neither size nor width and height. Default 1024x1024.
	DefaultSize string `json:"default_size,omitempty"`

	// DefaultFrames is the frame count of a video that gives neither
	// num_frames nor fps and seconds. Default 96 (24 fps for 4 s).
	DefaultFrames int `json:"default_frames,omitempty"`

	// CFGFactor multiplies the cost of a job that asks for classifier-free
	// guidance (guidance_scale or true_cfg_scale above 1). Default 2.
	CFGFactor float64 `json:"cfg_factor,omitempty"`

	// MaxPixels is the most width × height (of one image or video frame)
	// a job may ask for; larger ones are refused with 400 before any
	// worker is used, as sglang-diffusion itself refuses none. Default
	// 16777216 (4096x4096).
	MaxPixels int `json:"max_pixels,omitempty"`
}

// HealthChecks is how the router tells which workers may get jobs.
type HealthChecks struct {
	// Active probes each worker on an interval.
	Active ActiveHealthChecks `json:"active,omitzero"`

	// Passive judges workers by the requests they serve.
	Passive PassiveHealthChecks `json:"passive,omitzero"`

	// MinReady is how many serving workers /readyz needs to answer 200.
	// Default 1.
	MinReady int `json:"min_ready,omitempty"`
}

// ActiveHealthChecks probe each worker on an interval. A worker that fails
// keeps being probed and comes back by itself; a worker slow to answer
// because it is busy is not counted as failing.
type ActiveHealthChecks struct {
	// URI is the path probed. Default /health.
	URI string `json:"uri,omitempty"`

	// Interval is how often each worker is probed. Default 10s.
	Interval caddy.Duration `json:"interval,omitempty"`

	// Timeout bounds one probe. Default 5s.
	Timeout caddy.Duration `json:"timeout,omitempty"`

	// Fails is how many consecutive failed probes mark a worker unhealthy.
	// Default 3.
	Fails int `json:"fails,omitempty"`

	// Passes is how many consecutive passed probes bring it back. Default 2.
	Passes int `json:"passes,omitempty"`

	// ExpectStatus is the status a probe must answer. Default: any 2xx.
	ExpectStatus int `json:"expect_status,omitempty"`

	// ExpectBody is a regular expression the probe's body must match.
	ExpectBody string `json:"expect_body,omitempty"`
}

// PassiveHealthChecks judge workers by the requests they serve.
type PassiveHealthChecks struct {
	// MaxFails is how many failed requests (connection refused or reset,
	// 5xx answers, answers cut short) within FailWindow eject a worker; a
	// 4xx is the request's fault and counts against nothing. Default 3.
	MaxFails int `json:"max_fails,omitempty"`

	// FailWindow is the window MaxFails counts in. Default 30s.
	FailWindow caddy.Duration `json:"fail_window,omitempty"`

	// EjectTime is how long the first ejection of a worker lasts; each
	// one after lasts twice the one before, until 10 answers in a row
	// with no failure reset the doubling. While other workers serve, a
	// passed health probe ends no ejection: it says /health answers, not
	// that answers are whole. Default 10s.
	EjectTime caddy.Duration `json:"eject_time,omitempty"`

	// MaxEjectTime is the longest ejection, the cap of the doubling.
	// Default 5m.
	MaxEjectTime caddy.Duration `json:"max_eject_time,omitempty"`

	// MaxEjectionPercent bounds the workers ejected at once, in percent
	// of the pool (one may always be): failures on every worker say more of
	// the jobs than of the workers, and the fleet keeps serving. Default 50.
	MaxEjectionPercent int `json:"max_ejection_percent,omitempty"`

	// StallFactor: a job running this many times longer than predicted
	// (and at least the probe timeout) makes its worker suspect, with no
	// new jobs until that job ends. Default 5.
	StallFactor float64 `json:"stall_factor,omitempty"`
}

// Answers is how much of the workers' answers the router holds back until
// they are whole, so that an answer a worker breaks runs again on another
// worker instead of reaching the client as a success.
type Answers struct {
	// MaxHeld is the largest answer held back until all of it has come
	// and, for JSON and msgpack, its structure is whole; a larger answer
	// streams, and if it breaks, the client's connection is reset. Default
	// 32 MiB: the largest image answer, a 2048x2048 RGBA PNG that does not
	// compress, is 16 MiB, 21.3 MiB in base64, under 22 MiB with its JSON.
	// -1 holds none.
	MaxHeld int64 `json:"max_held,omitempty"`

	// MaxHeldTotal bounds what all the answers held at once may take;
	// beyond it answers stream. A held answer takes the buffer it is held
	// in (up to 4 MiB, its size rounded up to a power of two) until the
	// client has taken it, so a slow client holds it longer. Default
	// 256 MiB.
	MaxHeldTotal int64 `json:"max_held_total,omitempty"`

	// StallTimeout is how long an answer held back may go without a byte
	// before its attempt fails as stalled: the job runs again on another
	// worker, never on this one, or the client gets 504. A held answer is
	// copied into memory as it comes, so a pause is the worker's, never a
	// slow client's. Default 30s.
	StallTimeout caddy.Duration `json:"stall_timeout,omitempty"`
}

// Admin is who may call the endpoints that change the fleet.
type Admin struct {
	// Allow lists the client networks (CIDR or single address) that may;
	// private_ranges stands for the private and loopback ranges, as in
	// Caddy's trusted_proxies. The client address is Caddy's, so
	// trusted_proxies is honoured. Default: loopback, but not for a call
	// that came through one of the server's trusted_proxies: a proxy or
	// sidecar on the same machine brings every client from loopback, so
	// such a call needs the token or an explicit list.
	Allow []string `json:"allow,omitempty"`

	// Token, when set, also admits a call that carries
	// "Authorization: Bearer <token>". Placeholders such as {env.VAR} are
	// expanded when the config loads.
	Token string `json:"token,omitempty"`
}

// Discovery finds workers through DNS, as a Kubernetes headless Service
// publishes the ready pods of a StatefulSet. The names are looked up with
// Caddy's own `a` and `srv` upstream sources every Refresh; a worker an
// answer names joins the pool, one it no longer names gets no new jobs and
// leaves once its jobs end. A lookup that fails, or names no usable
// worker, keeps the workers of the last one that did.
type Discovery struct {
	// A are names whose A and AAAA records are workers, each address at
	// the name's port: http://<address>:<port>.
	A []DNSName `json:"a,omitempty"`

	// SRV are names whose SRV records are workers, http://<target>:<port>,
	// such as _http._tcp.workers.rollout.svc.cluster.local. Targets stay
	// names, resolved by the system's resolver when dialled, as Caddy's srv
	// upstreams are; priority and weight are ignored.
	SRV []string `json:"srv,omitempty"`

	// Refresh is how often every name is looked up again. Default 10s.
	Refresh caddy.Duration `json:"refresh,omitempty"`

	// Resolvers are the DNS servers asked, host:port each (port 53 when
	// left out), one at random per lookup. Default: the system's resolver.
	Resolvers []string `json:"resolvers,omitempty"`

	// Kubernetes are lookups of the Kubernetes API: the endpoints of
	// EndpointSlices, followed as they change (a watch, not a refresh).
	Kubernetes []KubernetesLookup `json:"kubernetes,omitempty"`
}

// KubernetesLookup follows the EndpointSlices of a Service, or those a
// label selector names: each endpoint is a worker, http://<its first
// address>:<port>, ready, terminating or not ready as its conditions say.
type KubernetesLookup struct {
	// Namespace is the namespace watched. Default: every namespace,
	// which needs a ClusterRole.
	Namespace string `json:"namespace,omitempty"`

	// Service is the Service whose slices are followed (their label
	// kubernetes.io/service-name). Exactly one of Service and Selector.
	Service string `json:"service,omitempty"`

	// Selector is a label selector of the slices, such as app=engines (a
	// Service's slices carry its labels).
	Selector string `json:"selector,omitempty"`

	// Port is the workers' port in the slices: a number, or a port's
	// name such as http. Default: the slice's only port.
	Port string `json:"port,omitempty"`

	// AddressType is the slices' address family followed, IPv4 or IPv6.
	// Default IPv4.
	AddressType string `json:"address_type,omitempty"`

	// Kubeconfig is a kubeconfig file to reach the API with. Default: the
	// pod's service account (in-cluster).
	Kubeconfig string `json:"kubeconfig,omitempty"`
}

// DNSName is a name whose A and AAAA records are workers at Port.
type DNSName struct {
	// Name is the name looked up.
	Name string `json:"name"`

	// Port is the port the workers listen on.
	Port int `json:"port"`
}

// Defaults of the options that are not the cost model's, health's or
// weights'.
const (
	defaultPoolName   = "default"
	defaultMaxBody    = 64 << 20
	defaultBodyTotal  = 256 << 20
	defaultBodyTime   = time.Minute
	defaultMaxQueue   = 10000
	defaultMaxWorkers = 4096
	defaultAttempts   = 3
	defaultMaxPrio    = 10
	defaultPrioWait   = time.Minute
	defaultDNSRefresh = 10 * time.Second
	defaultMaxHeld    = 32 << 20
	defaultHeldTotal  = 256 << 20
	defaultStall      = 30 * time.Second
)

// defaultAdminAllow trusts only the machine the router runs on.
var defaultAdminAllow = []string{"127.0.0.0/8", "::1/128"}

// optionError is a bad option value: the option is named as the Caddyfile
// spells it and as the JSON config does.
func optionError(caddyfileName, jsonPath, format string, args ...any) error {
	return fmt.Errorf("%s (%s): %s", caddyfileName, jsonPath, fmt.Sprintf(format, args...))
}

// provisionOptions fills in defaults, checks every value and turns the
// options into the values the handler works with.
func (h *Handler) provisionOptions() error {
	h.Pool = cmp.Or(h.Pool, defaultPoolName)
	steps := []func() error{h.provisionDispatch, h.provisionCosts, h.provisionWeights, h.provisionHealth, h.provisionAdmin, h.provisionWorkers, h.provisionDiscovery, h.provisionForwardPaths, h.provisionAnswers, h.provisionAdapters, h.provisionHA}
	for _, step := range steps {
		if err := step(); err != nil {
			return err
		}
	}
	lb := &h.LoadBalancing
	lb.HedgeAfter = cmp.Or(lb.HedgeAfter, h.HealthChecks.Passive.StallFactor)
	h.dispatch.HedgeAfter = max(lb.HedgeAfter, 0)
	h.MaxWorkers = cmp.Or(h.MaxWorkers, defaultMaxWorkers)
	if h.MaxWorkers < 0 {
		return optionError("max_workers", "max_workers", "must be positive, got %d", h.MaxWorkers)
	}
	if err := h.provisionBodies(); err != nil {
		return err
	}
	if h.UpstreamTimeout < 0 {
		return optionError("upstream_timeout", "upstream_timeout", "must not be negative, got %s", time.Duration(h.UpstreamTimeout))
	}
	return nil
}

// provisionBodies reads the bounds of request bodies: each, all at once,
// and in time.
func (h *Handler) provisionBodies() error {
	h.MaxBody = cmp.Or(h.MaxBody, defaultMaxBody)
	// By default the reserve of small bodies stays an eighth beside a body
	// of max_body.
	h.MaxBodyTotal = cmp.Or(h.MaxBodyTotal, max(defaultBodyTotal, (h.MaxBody*8+6)/7))
	h.BodyTimeout = cmp.Or(h.BodyTimeout, caddy.Duration(defaultBodyTime))
	switch {
	case h.MaxBody < 0:
		return optionError("max_body", "max_body", "must be positive, got %d", h.MaxBody)
	case h.MaxBodyTotal < h.MaxBody:
		return optionError("max_body_total", "max_body_total", "must be at least max_body (%d bytes), got %d", h.MaxBody, h.MaxBodyTotal)
	case h.BodyTimeout < 0:
		return optionError("body_timeout", "body_timeout", "must be positive, got %s", time.Duration(h.BodyTimeout))
	}
	h.bodies = request.NewBodyBudget(h.MaxBodyTotal, h.MaxBody, bodyBytesHeld.WithLabelValues(h.Pool))
	return nil
}

// provisionDispatch reads the routing and queue options.
func (h *Handler) provisionDispatch() error {
	lb, q, d := &h.LoadBalancing, &h.Queue, &h.dispatch
	lb.Policy = cmp.Or(lb.Policy, scheduler.DefaultStrategy)
	newStrategy, ok := scheduler.Strategies[lb.Policy]
	if !ok {
		return optionError("policy", "load_balancing.policy", "unknown policy %q (want one of %s)", lb.Policy, scheduler.StrategyNames())
	}
	d.Strategy = newStrategy()
	switch {
	case lb.MaxInflight > 0:
		d.MaxInflight = lb.MaxInflight
	case lb.MaxInflight == 0 && lb.Policy == "least_work":
		d.MaxInflight = 1
	case lb.MaxInflight < -1:
		return optionError("max_inflight", "load_balancing.max_inflight", "must be positive or -1 (no limit), got %d", lb.MaxInflight)
	}
	if err := h.provisionAttempts(); err != nil {
		return err
	}
	q.Order = cmp.Or(q.Order, scheduler.DefaultQueueOrder)
	if d.Order, ok = scheduler.QueueOrders[q.Order]; !ok {
		return optionError("queue_order", "queue.order", "unknown order %q (want adaptive, fifo, largest_first or smallest_first)", q.Order)
	}
	if q.Timeout < 0 {
		return optionError("queue_timeout", "queue.timeout", "must not be negative, got %s", time.Duration(q.Timeout))
	}
	d.Timeout = time.Duration(q.Timeout)
	q.MaxJobs = cmp.Or(q.MaxJobs, defaultMaxQueue)
	if q.MaxJobs < 0 {
		return optionError("max_queue", "queue.max_jobs", "must be positive, got %d", q.MaxJobs)
	}
	d.MaxQueue = q.MaxJobs
	if err := h.provisionAbortMemory(); err != nil {
		return err
	}
	return h.provisionPriority()
}

// provisionAbortMemory reads how long aborts are remembered.
func (h *Handler) provisionAbortMemory() error {
	q := &h.Queue
	q.AbortMemory = cmp.Or(q.AbortMemory, caddy.Duration(scheduler.DefaultAbortMemory))
	if q.AbortMemory < -1 {
		return optionError("abort_memory", "queue.abort_memory", "must be a duration, or -1 (off), got %s", time.Duration(q.AbortMemory))
	}
	return nil
}

// provisionPriority reads the priority options.
func (h *Handler) provisionPriority() error {
	q := &h.Queue
	q.MaxPriority = cmp.Or(q.MaxPriority, defaultMaxPrio)
	if q.MaxPriority < 0 {
		return optionError("max_priority", "queue.max_priority", "must be positive, got %d", q.MaxPriority)
	}
	q.PriorityMaxWait = cmp.Or(q.PriorityMaxWait, caddy.Duration(defaultPrioWait))
	if q.PriorityMaxWait < -1 {
		return optionError("priority_max_wait", "queue.priority_max_wait", "must be positive, or off (-1), got %s", time.Duration(q.PriorityMaxWait))
	}
	h.dispatch.MaxPassedOver = max(time.Duration(q.PriorityMaxWait), 0)
	return h.provisionTenants()
}

// provisionTenants reads the tenant options.
func (h *Handler) provisionTenants() error {
	q, d := &h.Queue, &h.dispatch
	if err := h.provisionTenantList(); err != nil {
		return err
	}
	for name, w := range q.TenantWeights {
		if !validTenant(name) {
			return optionError("tenant_weight", "queue.tenant_weights", "%q is not a tenant name: %s", name, tenantRule)
		}
		if h.tenants != nil && !h.tenants[name] && name != scheduler.OtherTenant {
			return optionError("tenant_weight", "queue.tenant_weights", "%q is not on tenants, so no job is ever its: list it, or weigh %q", name, scheduler.OtherTenant)
		}
		if !(w > 0) || math.IsInf(w, 0) {
			return optionError("tenant_weight", "queue.tenant_weights", "the weight of %q must be a positive number, got %v", name, w)
		}
	}
	if q.TenantMaxQueue < 0 {
		return optionError("tenant_max_queue", "queue.tenant_max_queue", "must be positive, got %d", q.TenantMaxQueue)
	}
	if q.MaxTenants != 0 && q.MaxTenants < len(h.tenants) {
		return optionError("max_tenants", "queue.max_tenants", "is %d, fewer than the %d tenants listed: some would share the tenant %q", q.MaxTenants, len(h.tenants), scheduler.OtherTenant)
	}
	q.MaxTenants = cmp.Or(q.MaxTenants, max(scheduler.DefaultMaxTenants, len(h.tenants)))
	if q.MaxTenants < 0 {
		return optionError("max_tenants", "queue.max_tenants", "must be positive, got %d", q.MaxTenants)
	}
	d.TenantWeights, d.TenantMaxQueue, d.MaxTenants = q.TenantWeights, q.TenantMaxQueue, q.MaxTenants
	return nil
}

// provisionTenantList reads the tenants the pool tells apart, if listed.
func (h *Handler) provisionTenantList() error {
	if len(h.Queue.Tenants) == 0 {
		return nil
	}
	if h.Queue.Tenant == "" {
		return optionError("tenants", "queue.tenants", "lists tenants, but no tenant option says where a job's tenant comes from")
	}
	h.tenants = make(map[string]bool, len(h.Queue.Tenants))
	for _, name := range h.Queue.Tenants {
		if !validTenant(name) {
			return optionError("tenants", "queue.tenants", "%q is not a tenant name: %s", name, tenantRule)
		}
		h.tenants[name] = true
	}
	return nil
}

// provisionAttempts reads how jobs run again and are hedged, and the
// speed the first ones are predicted at.
func (h *Handler) provisionAttempts() error {
	lb := &h.LoadBalancing
	lb.MaxAttempts = cmp.Or(lb.MaxAttempts, defaultAttempts)
	if lb.MaxAttempts < 1 {
		return optionError("max_attempts", "load_balancing.max_attempts", "must be positive, got %d", lb.MaxAttempts)
	}
	for _, s := range lb.RetryOn {
		if s < 400 || s > 599 {
			return optionError("retry_on", "load_balancing.retry_on", "%d is not an error status code (400-599)", s)
		}
	}
	if lb.HedgeAfter != 0 && lb.HedgeAfter != -1 && !atLeastOne(lb.HedgeAfter) {
		return optionError("hedge_after", "load_balancing.hedge_after", "must be a number of at least 1, or off, got %g", lb.HedgeAfter)
	}
	lb.InitialSpeed = cmp.Or(lb.InitialSpeed, scheduler.DefaultInitialSpeed)
	if lb.InitialSpeed <= 0 || math.IsInf(lb.InitialSpeed, 0) {
		return optionError("initial_speed", "load_balancing.initial_speed", "must be a positive number, got %g", lb.InitialSpeed)
	}
	h.dispatch.MaxAttempts = lb.MaxAttempts
	return nil
}

// provisionCosts reads the cost model's defaults.
func (h *Handler) provisionCosts() error {
	o, c := &h.Cost, &h.costs
	o.DefaultSize = cmp.Or(o.DefaultSize, request.DefaultSize)
	var err error
	if c.Width, c.Height, err = request.ParseSize(o.DefaultSize); err != nil {
		return optionError("default_size", "cost.default_size", "%q is not WIDTHxHEIGHT like 1024x1024", o.DefaultSize)
	}
	o.DefaultSteps = cmp.Or(o.DefaultSteps, request.DefaultSteps)
	o.DefaultFrames = cmp.Or(o.DefaultFrames, request.DefaultFrames)
	o.CFGFactor = cmp.Or(o.CFGFactor, request.DefaultCFGFactor)
	o.MaxPixels = cmp.Or(o.MaxPixels, request.DefaultMaxPixels)
	switch {
	case o.DefaultSteps < 0:
		return optionError("default_steps", "cost.default_steps", "must be positive, got %d", o.DefaultSteps)
	case o.DefaultFrames < 0:
		return optionError("default_frames", "cost.default_frames", "must be positive, got %d", o.DefaultFrames)
	case !atLeastOne(o.CFGFactor):
		return optionError("cfg_factor", "cost.cfg_factor", "must be a number of at least 1, got %g", o.CFGFactor)
	case o.MaxPixels < 0:
		return optionError("max_pixels", "cost.max_pixels", "must be positive, got %d", o.MaxPixels)
	case c.Width*c.Height > o.MaxPixels:
		return optionError("default_size", "cost.default_size", "%s is more pixels than max_pixels (%d)", o.DefaultSize, o.MaxPixels)
	}
	c.Steps, c.Frames, c.CFGFactor, c.MaxPixels = o.DefaultSteps, o.DefaultFrames, o.CFGFactor, float64(o.MaxPixels)
	return nil
}

// provisionHealth reads the health options.
func (h *Handler) provisionHealth() error {
	a, p := &h.HealthChecks.Active, &h.HealthChecks.Passive
	a.URI = cmp.Or(a.URI, defaultHealthURI)
	a.Interval = cmp.Or(a.Interval, caddy.Duration(defaultHealthInterval))
	a.Timeout = cmp.Or(a.Timeout, caddy.Duration(defaultHealthTimeout))
	a.Fails = cmp.Or(a.Fails, defaultHealthFails)
	a.Passes = cmp.Or(a.Passes, defaultHealthPasses)
	p.MaxFails = cmp.Or(p.MaxFails, defaultMaxFails)
	p.FailWindow = cmp.Or(p.FailWindow, caddy.Duration(defaultFailWindow))
	p.EjectTime = cmp.Or(p.EjectTime, caddy.Duration(defaultEjectTime))
	p.MaxEjectTime = cmp.Or(p.MaxEjectTime, caddy.Duration(defaultMaxEjectTime))
	p.MaxEjectionPercent = cmp.Or(p.MaxEjectionPercent, defaultMaxEjectionPercent)
	p.StallFactor = cmp.Or(p.StallFactor, defaultStallFactor)
	h.HealthChecks.MinReady = cmp.Or(h.HealthChecks.MinReady, 1)
	if err := checkHealth(&h.HealthChecks); err != nil {
		return err
	}
	c := &h.health
	*c = scheduler.HealthConfig{
		URI: a.URI, Interval: time.Duration(a.Interval), Timeout: time.Duration(a.Timeout),
		Fails: a.Fails, Passes: a.Passes, Status: a.ExpectStatus,
		StallFactor: p.StallFactor, MaxFails: p.MaxFails, FailWindow: time.Duration(p.FailWindow),
		EjectTime: time.Duration(p.EjectTime), MaxEjectTime: time.Duration(p.MaxEjectTime),
		MaxEjectionPercent: p.MaxEjectionPercent,
	}
	if a.ExpectBody != "" {
		re, err := regexp.Compile(a.ExpectBody)
		if err != nil {
			return optionError("health_body", "health_checks.active.expect_body", "%v", err)
		}
		c.Body = re
	}
	h.dispatch.Health = c
	h.weights.Health = c
	return nil
}

// checkHealth checks the health options once their defaults are in.
func checkHealth(hc *HealthChecks) error {
	a, p := &hc.Active, &hc.Passive
	switch {
	case !strings.HasPrefix(a.URI, "/"):
		return optionError("health_uri", "health_checks.active.uri", "%q is not a path", a.URI)
	case a.Interval <= 0:
		return optionError("health_interval", "health_checks.active.interval", "must be positive")
	case a.Timeout <= 0:
		return optionError("health_timeout", "health_checks.active.timeout", "must be positive")
	case a.Fails < 1:
		return optionError("health_fails", "health_checks.active.fails", "must be positive, got %d", a.Fails)
	case a.Passes < 1:
		return optionError("health_passes", "health_checks.active.passes", "must be positive, got %d", a.Passes)
	case a.ExpectStatus != 0 && (a.ExpectStatus < 100 || a.ExpectStatus > 599):
		return optionError("health_status", "health_checks.active.expect_status", "%d is not an HTTP status code", a.ExpectStatus)
	case p.MaxFails < 1:
		return optionError("max_fails", "health_checks.passive.max_fails", "must be positive, got %d", p.MaxFails)
	case p.FailWindow <= 0:
		return optionError("fail_window", "health_checks.passive.fail_window", "must be positive")
	case p.EjectTime <= 0:
		return optionError("eject_time", "health_checks.passive.eject_time", "must be positive")
	case p.MaxEjectTime < p.EjectTime:
		return optionError("max_eject_time", "health_checks.passive.max_eject_time", "must be at least eject_time (%s)", time.Duration(p.EjectTime))
	case p.MaxEjectionPercent < 1 || p.MaxEjectionPercent > 100:
		return optionError("max_ejection_percent", "health_checks.passive.max_ejection_percent", "must be 1 to 100, got %d", p.MaxEjectionPercent)
	case !atLeastOne(p.StallFactor):
		return optionError("stall_factor", "health_checks.passive.stall_factor", "must be a number of at least 1, got %g", p.StallFactor)
	case hc.MinReady < 1:
		return optionError("min_ready", "health_checks.min_ready", "must be positive, got %d", hc.MinReady)
	}
	return nil
}

// provisionAdmin reads who may change the fleet.
func (h *Handler) provisionAdmin() error {
	allow, given := []string(nil), h.Admin.Allow
	if len(given) == 0 {
		given = defaultAdminAllow
	}
	for _, a := range given {
		if a == "private_ranges" { // as in Caddy's trusted_proxies
			allow = append(allow, caddyhttp.PrivateRangesCIDR()...)
		} else {
			allow = append(allow, a)
		}
	}
	prefixes, err := parsePrefixes(allow)
	if err != nil {
		return optionError("admin_allow", "admin.allow", "%v", err)
	}
	h.allow = prefixes
	if h.Admin.Token != "" {
		h.token = caddy.NewReplacer().ReplaceAll(h.Admin.Token, "")
		if h.token == "" {
			return optionError("admin_token", "admin.token", "%q expands to an empty token", h.Admin.Token)
		}
	}
	return nil
}

// provisionWorkers puts the listed worker URLs in the form the pool keys
// them by.
func (h *Handler) provisionWorkers() error {
	for i, raw := range h.Workers {
		u, err := workerurl.Parse(raw)
		if err != nil {
			return optionError("workers", "workers", "%q: %v", raw, err)
		}
		h.Workers[i] = u
	}
	return nil
}

// provisionDiscovery reads the discovery options, DNS's and the
// Kubernetes API's. It contacts nothing.
func (h *Handler) provisionDiscovery() error {
	o := &h.Discovery
	for _, k := range o.Kubernetes {
		if err := kubediscovery.Config(k).Check(); err != nil {
			return optionError("workers_kubernetes", "discovery.kubernetes", "%v", err)
		}
	}
	if len(o.A) == 0 && len(o.SRV) == 0 {
		switch {
		case o.Refresh != 0:
			return optionError("dns_refresh", "discovery.refresh", "is set, but no workers_dns or workers_srv names a lookup")
		case len(o.Resolvers) > 0:
			return optionError("dns_resolvers", "discovery.resolvers", "are set, but no workers_dns or workers_srv names a lookup")
		}
		return nil
	}
	o.Refresh = cmp.Or(o.Refresh, caddy.Duration(defaultDNSRefresh))
	if o.Refresh < 0 {
		return optionError("dns_refresh", "discovery.refresh", "must be positive, got %s", time.Duration(o.Refresh))
	}
	for _, a := range o.A {
		if err := workerurl.CheckLookupName(a.Name); err != nil {
			return optionError("workers_dns", "discovery.a", "%q: %v", a.Name, err)
		}
		if a.Port < 1 || a.Port > 65535 {
			return optionError("workers_dns", "discovery.a", "port %d of %s is not a number from 1 to 65535", a.Port, a.Name)
		}
	}
	for _, name := range o.SRV {
		if err := workerurl.CheckLookupName(name); err != nil {
			return optionError("workers_srv", "discovery.srv", "%q: %v", name, err)
		}
	}
	// The check Caddy's upstream sources make of their resolvers, so that
	// it fails here, naming the option and the value.
	for _, r := range o.Resolvers {
		if err := (&reverseproxy.UpstreamResolver{Addresses: []string{r}}).ParseAddresses(); err != nil {
			return optionError("dns_resolvers", "discovery.resolvers", "%q: %v (want host:port, such as 10.96.0.10:53)", r, err)
		}
	}
	return nil
}

// provisionForwardPaths reads which paths go on to workers.
func (h *Handler) provisionForwardPaths() error {
	h.forwards = pathSet{}
	for _, p := range h.ForwardPaths {
		if p == "sglang" {
			h.forwards.add(request.Endpoints.Paths()...)
			continue
		}
		if !strings.HasPrefix(p, "/") || strings.Contains(strings.TrimSuffix(p, "*"), "*") {
			return optionError("forward_paths", "forward_paths", "%q is neither a path, a path prefix ending in * nor sglang", p)
		}
		h.forwards.add(p)
	}
	return nil
}

// provisionAnswers reads how much of the answers is held back.
func (h *Handler) provisionAnswers() error {
	o := &h.Answers
	o.MaxHeld = cmp.Or(o.MaxHeld, defaultMaxHeld)
	o.MaxHeldTotal = cmp.Or(o.MaxHeldTotal, defaultHeldTotal)
	o.StallTimeout = cmp.Or(o.StallTimeout, caddy.Duration(defaultStall))
	switch {
	case o.MaxHeld < -1:
		return optionError("max_held_answer", "answers.max_held", "must be a size, or -1 (off), got %d", o.MaxHeld)
	case o.MaxHeldTotal < 0:
		return optionError("max_held_total", "answers.max_held_total", "must be a size, got %d", o.MaxHeldTotal)
	case o.StallTimeout < 0:
		return optionError("answer_stall_timeout", "answers.stall_timeout", "must be positive, got %s", time.Duration(o.StallTimeout))
	}
	h.attempts.Budget, h.attempts.StallTimeout = answer.NewBudget(o.MaxHeld, o.MaxHeldTotal), time.Duration(o.StallTimeout)
	return nil
}

// atLeastOne reports whether f is a finite number of at least 1.
func atLeastOne(f float64) bool {
	return f >= 1 && !math.IsInf(f, 0)
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
			return nil, fmt.Errorf("%q is neither a CIDR nor an IP address", s)
		}
		out = append(out, netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen()))
	}
	return out, nil
}

// Adapter is a LoRA policy a pool serves.
type Adapter struct {
	// Name is the adapter's lora_nickname, by which requests name it: at
	// most 64 of A-Z a-z 0-9 . _ -.
	Name string `json:"name"`

	// Path is the lora_path its workers load it from, checked as a weight
	// update's model_path is (weights.path_prefixes).
	Path string `json:"path"`

	// Strength is its LoRA strength. Default 1.
	Strength float64 `json:"strength,omitempty"`
}

// Placement is how a pool moves adapters between its workers.
type Placement struct {
	// SwitchPrior is how long a worker is assumed to take to switch
	// adapters before it has switched once; from then on its own
	// switches' time is used. Default 30s.
	SwitchPrior caddy.Duration `json:"switch_prior,omitempty"`

	// MaxSwitches bounds how many times a worker switches adapters in any
	// minute. Default 4.
	MaxSwitches int `json:"max_switches,omitempty"`

	// Turn is how long an adapter keeps its only worker while another
	// adapter with jobs waiting has none. Default 1m.
	Turn caddy.Duration `json:"turn,omitempty"`

	// SwitchTimeout bounds each call that switches a worker's adapter
	// (/v1/set_lora, /v1/unmerge_lora_weights); a read of it
	// (/v1/list_loras) takes at most 5s, or this when shorter. Default 1m.
	SwitchTimeout caddy.Duration `json:"switch_timeout,omitempty"`

	// Retry is how long a worker whose LoRA call failed waits before it
	// is called again. Default 5s.
	Retry caddy.Duration `json:"retry,omitempty"`
}

// provisionAdapters reads the adapters and how they are placed.
func (h *Handler) provisionAdapters() error {
	seen := map[string]bool{}
	for i := range h.Adapters {
		a := &h.Adapters[i]
		switch {
		case !validTenant(a.Name):
			return optionError("adapter", "adapters", "%q is not an adapter name: %s", a.Name, tenantRule)
		case seen[a.Name]:
			return optionError("adapter", "adapters", "%q is declared twice", a.Name)
		case a.Strength < 0 || math.IsNaN(a.Strength) || math.IsInf(a.Strength, 0):
			return optionError("adapter", "adapters", "the strength of %q must be a positive number, got %v", a.Name, a.Strength)
		}
		if err := h.weights.CheckPath(a.Path); err != nil {
			return optionError("adapter", "adapters", "the path of %q: %v", a.Name, err)
		}
		seen[a.Name] = true
	}
	pl := &h.Placement
	pl.SwitchPrior = cmp.Or(pl.SwitchPrior, caddy.Duration(scheduler.DefaultSwitchPrior))
	pl.MaxSwitches = cmp.Or(pl.MaxSwitches, scheduler.DefaultMaxSwitches)
	pl.Turn = cmp.Or(pl.Turn, caddy.Duration(scheduler.DefaultTurn))
	pl.SwitchTimeout = cmp.Or(pl.SwitchTimeout, caddy.Duration(scheduler.DefaultSwitchTimeout))
	pl.Retry = cmp.Or(pl.Retry, caddy.Duration(scheduler.DefaultRetry))
	switch {
	case pl.SwitchPrior < 0:
		return optionError("adapter_switch_prior", "placement.switch_prior", "must be positive, got %s", time.Duration(pl.SwitchPrior))
	case pl.MaxSwitches < 0:
		return optionError("adapter_max_switches", "placement.max_switches", "must be positive, got %d", pl.MaxSwitches)
	case pl.Turn < 0:
		return optionError("adapter_turn", "placement.turn", "must be positive, got %s", time.Duration(pl.Turn))
	case pl.SwitchTimeout < 0:
		return optionError("adapter_switch_timeout", "placement.switch_timeout", "must be positive, got %s", time.Duration(pl.SwitchTimeout))
	case pl.Retry < 0:
		return optionError("adapter_retry", "placement.retry", "must be positive, got %s", time.Duration(pl.Retry))
	}
	return nil
}

// adapters are the handler's adapters as the pool takes them.
func (h *Handler) adapters() []scheduler.Adapter {
	out := make([]scheduler.Adapter, len(h.Adapters))
	for i, a := range h.Adapters {
		out[i] = scheduler.Adapter{Name: a.Name, Path: a.Path, Strength: a.Strength}
	}
	return out
}

// placement is how the handler's pool places adapters.
func (h *Handler) placement() scheduler.PlacementConfig {
	pl := &h.Placement
	return scheduler.PlacementConfig{SwitchPrior: time.Duration(pl.SwitchPrior), MaxSwitches: pl.MaxSwitches, Turn: time.Duration(pl.Turn),
		SwitchTimeout: time.Duration(pl.SwitchTimeout), Retry: time.Duration(pl.Retry)}
}
