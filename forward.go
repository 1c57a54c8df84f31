package diffusionrouter

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.opentelemetry.io/otel/attribute"
	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/answer"
	"github.com/miles-rollout/miles-diffusion-router/internal/attempt"
	"github.com/miles-rollout/miles-diffusion-router/internal/jobkinds"
	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// errRequestID refuses a client's request id that could not go out again
// as it came.
var errRequestID = fmt.Errorf("%s must be at most %d printable ASCII characters", request.IDHeader, request.MaxID)

// requestID returns r's id: the client's, or one the router makes when
// the client sent none.
func requestID(r *http.Request) (string, error) {
	id := r.Header.Get(request.IDHeader)
	if id == "" {
		id = strconv.FormatUint(rand.Uint64()|1<<63, 16) // 16 hex digits
		r.Header.Set(request.IDHeader, id)
		return id, nil
	}
	if !request.ValidID(id) {
		return "", errRequestID
	}
	return id, nil
}

// forward proxies a request to a worker through next. It first gets the
// request a worker from the pool (a generation may wait in the pool's queue
// for one); its attempts then run (see internal/attempt).
func (h *Handler) forward(rec *attempt.Recorder, r *http.Request, route request.Route, next caddyhttp.Handler) error {
	arrived := time.Now()
	id, err := requestID(r)
	if err != nil {
		return answer.WriteError(rec, http.StatusBadRequest, err.Error())
	}
	rec.Header().Set(request.IDHeader, id)
	rec.Tracer = tracerOf(r)
	t, r, status, msg := h.admit(rec, r, route)
	if status != 0 {
		return answer.WriteError(rec, status, msg)
	}
	if t == nil {
		return nil // the client left while waiting
	}
	if t.Job {
		defer h.pool.Untrack(t)
		defer h.releaseBody(t)
	}
	dispatched := time.Now()
	h.metrics.decisions.Inc()
	if ce := h.logger.Check(zap.DebugLevel, "routed"); ce != nil {
		ce.Write(zap.String("request_id", id), zap.String("worker", t.ServedBy()), zap.Float64("cost", t.Cost),
			zap.String("strategy", h.LoadBalancing.Policy), zap.Duration("queue_wait", dispatched.Sub(arrived)))
	}
	if list := h.filterVideoList(rec, r, t); list != nil {
		err = list.Finish(h.attempts.Run(rec, r, t, next))
	} else {
		err = h.attempts.Run(rec, r, t, next)
	}
	if err != nil && rec.Status() == 0 {
		err = h.proxyError(rec, t, err)
	}
	if cause := scheduler.CancelledBy(r.Context()); cause != nil && rec.Status() == 0 {
		err = answer.WriteError(rec, cancelStatus(cause), cause.Error())
	}
	if t.Job {
		h.logJob(id, r, t, rec, dispatched.Sub(arrived), time.Since(dispatched))
	}
	return err
}

// admit reads and costs r and gets it a worker. It returns r as the job
// is to be sent, in its ticket's context. A non-zero status refuses r with
// that status and message (409 for a job aborted, or whose id an abort
// remembers); a nil ticket means the client left. A job is registered by
// its id until the caller's Untrack, so that an abort finds it, and holds
// its body until the caller's releaseBody.
func (h *Handler) admit(rec *attempt.Recorder, r *http.Request, route request.Route) (*scheduler.Ticket, *http.Request, int, string) {
	t, status, msg := h.ticketFor(r, route)
	if status == 0 {
		status, msg = h.readBody(rec, r, t)
	}
	switch status {
	case 0:
	case statusClientGone:
		return nil, r, 0, ""
	default:
		return nil, r, status, msg
	}
	admitted, r, status, msg := h.enqueue(rec, r, t)
	if admitted == nil {
		h.releaseBody(t)
	}
	return admitted, r, status, msg
}

// enqueue registers the job t, whose body is read, and gets it a worker,
// as admit says.
func (h *Handler) enqueue(rec *attempt.Recorder, r *http.Request, t *scheduler.Ticket) (*scheduler.Ticket, *http.Request, int, string) {
	if t.Job {
		r = r.WithContext(t.WithCancel(r.Context()))
		t.RID = r.Header.Get(request.IDHeader)
		if err := h.pool.Track(t); err != nil {
			return nil, r, http.StatusConflict, err.Error()
		}
	}
	if err := h.acquire(rec, r, t); err != nil {
		h.pool.Untrack(t)
		if cause := scheduler.CancelledBy(r.Context()); cause != nil {
			return nil, r, cancelStatus(cause), cause.Error()
		}
		if r.Context().Err() != nil {
			return nil, r, 0, ""
		}
		rec.Header().Set("Retry-After", strconv.Itoa(retryAfter(t)))
		status, msg := queueError(h.pool, t, err)
		return nil, r, status, msg
	}
	return t, r, 0, ""
}

// acquire gets t a worker from the pool, tracing a job's wait for one.
func (h *Handler) acquire(rec *attempt.Recorder, r *http.Request, t *scheduler.Ticket) error {
	if !t.Job {
		return h.pool.Acquire(r.Context(), t)
	}
	ctx, end := traceQueue(r.Context(), rec.Tracer, t)
	err := h.pool.Acquire(ctx, t)
	end(err, attribute.String("diffusion.worker", t.ServedBy()))
	return err
}

// logJob records a finished generation job's metrics, logs it at DEBUG
// with what its client got (rec), and adds what the router did with it to Caddy's access log entry. As
// Caddy's own handlers log nothing per request at INFO, neither does the
// router: a line per job would cost more than routing it. No prompt or
// image data is logged.
func (h *Handler) logJob(id string, r *http.Request, t *scheduler.Ticket, rec *attempt.Recorder, waited, took time.Duration) {
	h.metrics.observeJob(t, rec.Attempts(), waited, took)
	accessLogFields(r, t, rec.Attempts(), waited)
	ce := h.logger.Check(zap.DebugLevel, "job finished")
	if ce == nil {
		return
	}
	ce.Write(
		zap.String("request_id", id),
		zap.String("endpoint", t.Route.Class),
		zap.String("worker", t.ServedBy()),
		zap.Float64("cost", t.Cost),
		zap.Duration("queue_wait", waited),
		zap.Duration("latency", took),
		zap.Int("status", rec.Status()),
		zap.String("weight_version", t.ServedVersion()),
		zap.Int("attempts", rec.Attempts()),
	)
}

// accessLogFields adds t's worker, cost, attempts and queue wait to the
// access log entry of r, when the server writes access logs: each field
// added costs an allocation or two that a server without them need not pay.
func accessLogFields(r *http.Request, t *scheduler.Ticket, attempts int, waited time.Duration) {
	if srv, ok := r.Context().Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server); !ok || srv.Logs == nil {
		return
	}
	extra, ok := r.Context().Value(caddyhttp.ExtraLogFieldsCtxKey).(*caddyhttp.ExtraLogFields)
	if !ok {
		return
	}
	extra.Add(zap.String("worker", t.ServedBy()))
	extra.Add(zap.Float64("cost", t.Cost))
	extra.Add(zap.Int("attempts", attempts))
	extra.Add(zap.Duration("queue_wait", waited))
}

// retryAfter suggests when a refused job might find a worker, in seconds.
func retryAfter(t *scheduler.Ticket) int {
	return max(1, int(t.Config().Timeout.Seconds()))
}

// ticketFor works out which workers may serve r, which goes to route. A
// non-zero status means r must be refused with that status and message.
func (h *Handler) ticketFor(r *http.Request, route request.Route) (*scheduler.Ticket, int, string) {
	t := h.pool.NewTicket(&h.dispatch)
	t.Route, t.Job, t.WantVersion = route, route.Job(r.Method), r.Header.Get(request.VersionHeader)
	if route.Err != nil {
		return nil, http.StatusBadRequest, route.Err.Error()
	}
	stale, err := h.versionPolicyOf(r)
	if err != nil {
		return nil, http.StatusBadRequest, err.Error()
	}
	if t.Job {
		t.Staleness = stale
	}
	if t.Job && h.Queue.Priority != "" {
		if t.Priority, err = h.priorityOf(r); err != nil {
			return nil, http.StatusBadRequest, err.Error()
		}
	}
	if h.Queue.Tenant != "" && (t.Job || route.Poll || jobkinds.ListsVideos(r, route)) {
		if t.Tenant, err = h.tenantOf(r); err != nil {
			return nil, http.StatusBadRequest, err.Error()
		}
	}
	switch {
	case route.Poll:
		return h.pinToJob(t)
	case route.Serves == request.VideoTask:
		t.Task = request.VideoTask
		h.pool.fleet.ProbeUnknown(r.Context())
		if !h.pool.CanServe(request.VideoTask) {
			return nil, http.StatusBadRequest, "No video-capable workers available in current worker pool."
		}
	case route.Serves == request.ImageTask:
		t.Task = request.ImageTask
		h.pool.fleet.ProbeUnknown(r.Context())
		if !h.pool.AnyMakes(request.ImageTask) { // as the Python router does: let a worker answer
			t.Task = request.AnyTask
		}
	case t.Job:
		// Before any update, a worker's weight version is the model id its
		// /v1/models reports: learn it before the worker's first job.
		h.pool.fleet.ProbeUnknown(r.Context())
	}
	return t, 0, ""
}

// priorityOf is r's priority, as the priority option's placeholder gives
// it, clamped to max_priority either way.
func (h *Handler) priorityOf(r *http.Request) (int, error) {
	repl, _ := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	v := strings.TrimSpace(repl.ReplaceAll(h.Queue.Priority, ""))
	if v == "" {
		return 0, nil
	}
	prio, err := strconv.Atoi(v)
	if err != nil {
		return 0, fmt.Errorf("priority %q is not an integer (it comes from %s)", v, h.Queue.Priority)
	}
	return min(max(prio, -h.Queue.MaxPriority), h.Queue.MaxPriority), nil
}

// maxTenantName bounds a tenant's name, which comes from clients and
// goes out again as a metric label.
const maxTenantName = 64

// tenantRule is what a tenant's name must be.
var tenantRule = fmt.Sprintf("at most %d of A-Z a-z 0-9 . _ -", maxTenantName)

// validTenant reports whether name may name a tenant.
func validTenant(name string) bool { return request.ValidName(name, maxTenantName) }

// tenantOf is r's tenant, as the tenant option's placeholder gives it; ""
// (the tenant other) when it gives nothing, or a name the tenants option
// does not list.
func (h *Handler) tenantOf(r *http.Request) (string, error) {
	repl, _ := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	v := strings.TrimSpace(repl.ReplaceAll(h.Queue.Tenant, ""))
	switch {
	case v == "":
		return "", nil
	case !validTenant(v):
		return "", fmt.Errorf("tenant %.64q is not a tenant name: %s (it comes from %s)", v, tenantRule, h.Queue.Tenant)
	case h.tenants != nil && !h.tenants[v]:
		return "", nil
	}
	return v, nil
}

// pinToJob pins t to the worker that made the job its route names. A
// non-zero status refuses the request with that status and message: a job
// of another tenant's is as unknown as one never made.
func (h *Handler) pinToJob(t *scheduler.Ticket) (*scheduler.Ticket, int, string) {
	owners, unknown := h.pool.Videos(), "Unknown video_id"
	if t.Route.Kind == request.ImagePoll {
		owners, unknown = h.pool.Images(), "Unknown image_id"
	}
	worker, ok := owners.Worker(t.Route.JobID, t.Tenant)
	if !ok {
		return nil, http.StatusNotFound, unknown
	}
	t.Pin = worker
	return t, 0, ""
}

// statusClientGone is readBody's status for a client that left: nobody
// reads an answer.
const statusClientGone = -1

// readBody caps the request body at max_body. A generation's body is read
// whole, once, to cost the job, so a bad one fails here with a message
// naming the field instead of on a worker; other bodies stream through.
func (h *Handler) readBody(w http.ResponseWriter, r *http.Request, t *scheduler.Ticket) (int, string) {
	if r.ContentLength > h.MaxBody {
		// Without this, Go's server first reads up to 256 KiB of the body
		// it is about to refuse, which a client that sent only the
		// headers never sends: the 413 would not go out.
		w.Header().Set("Connection", "close")
		return http.StatusRequestEntityTooLarge, tooLarge(h.MaxBody)
	}
	if r.Body == nil || r.Body == http.NoBody {
		r.Body = http.NoBody
	}
	r.Body = http.MaxBytesReader(w, r.Body, h.MaxBody)
	if !t.Job {
		return 0, ""
	}
	body, err := h.holdBody(w, r)
	if err != nil {
		return h.bodyRefused(w, err)
	}
	t.Body = body
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	f, err := request.ReadFields(body, r.Header.Get("Content-Type"))
	if err == nil {
		t.Cost, err = t.Route.Cost(h.costs, f)
	}
	if err == nil && (h.AdapterFrom != "" || h.pool.PlacesAdapters()) {
		err = h.pool.ResolveAdapter(t, h.adapterOf(r, f))
	}
	if err != nil {
		h.releaseBody(t)
		return http.StatusBadRequest, err.Error()
	}
	return 0, ""
}

// holdBody reads a job's body whole, its memory taken from max_body_total
// as the bytes arrive, within body_timeout; the caller gives it back
// (releaseBody) once the job has ended. The connection's read deadline
// ends a read that is blocked on a silent sender at body_timeout.
func (h *Handler) holdBody(w http.ResponseWriter, r *http.Request) ([]byte, error) {
	deadline := time.Now().Add(time.Duration(h.BodyTimeout))
	rc := http.NewResponseController(w)
	if rc.SetReadDeadline(deadline) == nil {
		defer rc.SetReadDeadline(time.Time{})
	}
	return h.bodies.Read(r.Context(), r.Body, r.ContentLength, deadline)
}

// releaseBody gives the memory of t's body back to max_body_total.
func (h *Handler) releaseBody(t *scheduler.Ticket) { h.bodies.Release(len(t.Body)) }

// bodyRefused is the answer to a job whose body could not be read whole.
// The rest of such a body stays unread, so its connection is closed.
func (h *Handler) bodyRefused(w http.ResponseWriter, err error) (int, string) {
	switch {
	case request.OverMaxBody(err):
		w.Header().Set("Connection", "close")
		return http.StatusRequestEntityTooLarge, tooLarge(h.MaxBody)
	case errors.Is(err, request.ErrNoRoom):
		w.Header().Set("Connection", "close")
		w.Header().Set("Retry-After", strconv.Itoa(int(request.RoomWait.Seconds())))
		h.metrics.bodiesRefused.WithLabelValues("budget").Inc()
		return http.StatusServiceUnavailable, fmt.Sprintf("%v (%d bytes)", err, h.MaxBodyTotal)
	case errors.Is(err, request.ErrBodyTimeout):
		w.Header().Set("Connection", "close")
		h.metrics.bodiesRefused.WithLabelValues("timeout").Inc()
		return http.StatusRequestTimeout, fmt.Sprintf("%v (%s)", err, time.Duration(h.BodyTimeout))
	case errors.Is(err, context.Canceled):
		return statusClientGone, "" // while its body waited for room
	}
	return http.StatusBadRequest, "reading request body: " + err.Error()
}

// adapterOf is the adapter r's job names: adapter_from's placeholder, or
// the body's model field.
func (h *Handler) adapterOf(r *http.Request, f request.Fields) string {
	if h.AdapterFrom == "" {
		return f.Model()
	}
	repl, _ := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	return strings.TrimSpace(repl.ReplaceAll(h.AdapterFrom, ""))
}

func tooLarge(limit int64) string {
	return fmt.Sprintf("request body is larger than max_body (%d bytes)", limit)
}

// proxyError answers a request whose proxying failed before any response
// was written, with a JSON error a client can act on. It returns a
// non-nil error only when that answer could not be written.
func (h *Handler) proxyError(w http.ResponseWriter, t *scheduler.Ticket, err error) error {
	status := http.StatusBadGateway
	if he, ok := errors.AsType[caddyhttp.HandlerError](err); ok && he.StatusCode != 0 {
		status = he.StatusCode
	}
	var msg string
	switch {
	case status == 499:
		return nil // the client went away; nobody reads an answer
	case t.Cancelled() != nil:
		return nil // forward answers with the cause
	case errors.Is(err, scheduler.ErrAsleep):
		w.Header().Set("Retry-After", strconv.Itoa(retryAfter(t)))
		status, msg := queueError(h.pool, t, err)
		return answer.WriteError(w, status, msg)
	case errors.Is(err, attempt.ErrUpstreamTimeout):
		status, msg = http.StatusGatewayTimeout, fmt.Sprintf("%v (%s)", attempt.ErrUpstreamTimeout, h.attempts.UpstreamTimeout)
	case request.OverMaxBody(err):
		w.Header().Set("Connection", "close") // the rest of the body stays unread
		status, msg = http.StatusRequestEntityTooLarge, tooLarge(h.MaxBody)
	case status == http.StatusServiceUnavailable:
		_, msg = queueError(h.pool, t, scheduler.ErrNoWorker)
	case t.Route.Poll:
		msg = fmt.Sprintf("Worker request failed: job %s was made by %s, which did not answer: %v", t.Route.JobID, t.Pin, cause(err))
	case t.Job && t.Route.Rerun == request.RerunUnsent && !neverSent(err):
		msg = fmt.Sprintf("Worker request failed after %s was sent the job: %v. It may have created it, so the job is not run again on another worker, where it would run twice; list or poll %s's jobs before sending it again", t.ServedBy(), cause(err), t.ServedBy())
	default:
		msg = "Worker request failed: " + cause(err).Error()
	}
	h.logger.Warn("proxying to worker failed", zap.Int("status", status), zap.Error(err))
	return answer.WriteError(w, status, msg)
}

// cause is what went wrong in err, without the trace of the handler that
// saw it: reverse_proxy's errors name its Go type and source line, which
// are no client's concern.
func cause(err error) error {
	if he, ok := errors.AsType[caddyhttp.HandlerError](err); ok && he.Err != nil {
		return he.Err
	}
	return err
}

// pathSet is a set of paths and path prefixes (written with a trailing *).
// An empty set has every path.
type pathSet struct {
	exact    map[string]bool
	prefixes []string
}

func (s *pathSet) add(paths ...string) {
	if s.exact == nil {
		s.exact = map[string]bool{}
	}
	for _, p := range paths {
		if prefix, ok := strings.CutSuffix(p, "*"); ok {
			s.prefixes = append(s.prefixes, prefix)
		} else {
			s.exact[p] = true
		}
	}
}

// has reports whether path is in the set.
func (s pathSet) has(path string) bool {
	if s.exact == nil || s.exact[path] {
		return true
	}
	return slices.ContainsFunc(s.prefixes, func(p string) bool { return strings.HasPrefix(path, p) })
}

// filterVideoList cuts the video list r asks for to t's tenant's jobs,
// while tenants are on; nil when it does not.
func (h *Handler) filterVideoList(rec *attempt.Recorder, r *http.Request, t *scheduler.Ticket) *jobkinds.TenantList {
	if h.Queue.Tenant == "" {
		return nil
	}
	return jobkinds.FilterVideoList(rec, r, t, h.pool.Videos())
}
