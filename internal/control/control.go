package control

import (
	"bytes"
	"cmp"
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/answer"
	"github.com/miles-rollout/miles-diffusion-router/internal/fleet"
	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/strictjson"
	"github.com/miles-rollout/miles-diffusion-router/internal/workerurl"
)

// mux routes the endpoints the router answers itself, with the
// shapes of the Python sglang-diffusion router and of miles' router API.
// Every other path goes to a worker.
func (a *API) mux() *http.ServeMux {
	mux := http.NewServeMux()
	type route struct {
		pattern string
		handler http.HandlerFunc
	}
	routes := []route{
		{"GET /health", a.serveHealth},
		{"GET /readyz", a.serveReady},
		{"GET /healthz", serveAlive},
		{"GET /workers", a.serveWorkers},
		{"POST /workers", a.admin(a.serveAddWorker)},
		{"GET /workers/{id...}", a.serveWorker},
		{"PUT /workers/{id...}", a.admin(a.serveUpdateWorker)},
		{"DELETE /workers/{id...}", a.admin(a.serveDeleteWorker)},
		{"POST /add_worker", a.admin(a.serveAddWorker)},
		{"POST /remove_worker", a.admin(a.serveRemoveWorker)},
		{"GET /list_workers", a.serveListWorkers},
		{"GET /v1/models", a.serveModels},
		{"GET /engine_metrics", a.serveEngineMetrics},
		{"POST /update_weights_from_tensor", serveTensorUpdate},
		{"POST /v1/set_lora", a.admin(a.serveLora)},
		{"POST /v1/merge_lora_weights", a.admin(a.serveLora)},
		{"POST /v1/unmerge_lora_weights", a.admin(a.serveLora)},
		{"POST /get_weights_checksum", a.admin(a.serveChecksum)},
		{"POST /update_weights_from_disk", a.admin(a.serveUpdateWeights)},
		{"POST /release_memory_occupation", a.admin(a.serveSleep)},
		{"POST /resume_memory_occupation", a.admin(a.serveWake)},
		{"POST /pause_generation", a.admin(a.servePause)},
		{"POST /continue_generation", a.admin(a.serveContinue)},
		{"POST /update_weight_version", a.admin(a.serveDeclare)},
		{"GET /get_weight_version", a.serveWeightVersion},
		{"GET /fleet_operation", a.serveOperation},
		{"POST /abort_request", a.admin(a.serveAbort)},
	}
	if a.Dashboard {
		routes = append(routes, route{"GET /dashboard", serveDashboard}, route{"GET /dashboard/data", a.serveDashboardData})
	}
	paths := map[string]bool{}
	for _, rt := range routes {
		mux.HandleFunc(rt.pattern, rt.handler)
		_, path, _ := strings.Cut(rt.pattern, " ")
		paths[path] = true
	}
	// Any other method on a control path is refused here rather than sent
	// to a worker that would not know the path either.
	for path := range paths {
		mux.HandleFunc(path, serveMethodNotAllowed)
	}
	return mux
}

// serveTensorUpdate refuses POST /update_weights_from_tensor: its payload
// holds tensor handles that are valid on one engine's node only, so no
// router can send one payload to several engines.
func serveTensorUpdate(w http.ResponseWriter, _ *http.Request) {
	_ = answer.WriteError(w, http.StatusBadRequest, "update_weights_from_tensor carries tensor handles valid on one engine's node only: send it to each engine directly, not through the router")
}

func serveMethodNotAllowed(w http.ResponseWriter, r *http.Request) {
	_ = answer.WriteError(w, http.StatusMethodNotAllowed, fmt.Sprintf("method %s is not allowed on %s", r.Method, r.URL.Path))
}

// admin wraps an endpoint that changes the fleet: only clients in
// admin_allow, or with the admin token, may call it.
func (a *API) admin(next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if !a.trusted(r) {
			client, err := a.ClientIP(r)
			a.Logger.Warn("refused control call", zap.String("path", r.URL.Path), zap.String("client", client), zap.NamedError("client_address", err))
			_ = answer.WriteError(w, http.StatusForbidden, "control endpoints need a client address in admin_allow or a valid admin token")
			return
		}
		next(w, r)
	}
}

// bearerToken is the token of a Bearer Authorization header. The scheme
// is case-insensitive (RFC 9110, 11.1), so clients that send "bearer"
// are admitted too; the token itself is compared exactly.
func bearerToken(authorization string) (string, bool) {
	scheme, token, ok := strings.Cut(authorization, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	return strings.TrimLeft(token, " "), true
}

// trusted reports whether r may change the fleet.
func (a *API) trusted(r *http.Request) bool {
	if a.Token != "" {
		got, ok := bearerToken(r.Header.Get("Authorization"))
		if ok && subtle.ConstantTimeCompare([]byte(got), []byte(a.Token)) == 1 {
			return true
		}
	}
	if a.AllowIsDefault && a.Proxied(r) {
		return false
	}
	client, err := a.ClientIP(r)
	if err != nil {
		return false
	}
	addr, err := netip.ParseAddr(client)
	if err != nil {
		return false
	}
	addr = addr.Unmap()
	for _, p := range a.Allow {
		if p.Contains(addr) {
			return true
		}
	}
	return false
}

// workerJSON is a worker as the Python router shows it, plus the state this
// router adds.
type workerJSON struct {
	WorkerID            string   `json:"worker_id"`
	DisplayID           string   `json:"display_id"`
	URL                 string   `json:"url"`
	ActiveRequests      int      `json:"active_requests"`
	IsDead              bool     `json:"is_dead"`
	IsSleeping          bool     `json:"is_sleeping"`
	WeightVersion       string   `json:"weight_version"`
	WeightVersionSource string   `json:"weight_version_source"` // reported, router, declared, verified or unknown; "" while no version is known
	ConsecutiveFailures int      `json:"consecutive_failures"`
	VideoSupport        *bool    `json:"video_support"`
	State               string   `json:"state"`
	Source              string   `json:"source"`
	Namespace           string   `json:"namespace,omitempty"` // its pod's, when the Kubernetes API found it
	Pod                 string   `json:"pod,omitempty"`
	TaskTypes           []string `json:"task_types"`
	RequestsServed      uint64   `json:"requests_served"`
	Failures            uint64   `json:"failures"`
	ProbeFailures       int      `json:"probe_failures"`
	LastProbe           *string  `json:"last_probe"`    // RFC 3339; null: never probed
	EjectedUntil        *string  `json:"ejected_until"` // RFC 3339; null: not ejected
	Probation           bool     `json:"probation"`     // back after an ejection: one job at a time until one given on probation succeeds
	PausedSince         *string  `json:"paused_since"`  // RFC 3339; null: not paused
	LastError           string   `json:"last_error"`
	Speed               float64  `json:"speed"` // cost units per second
	SpeedLearned        bool     `json:"speed_learned"`
	PredictedWork       float64  `json:"predicted_work_seconds"`
	PredictionError     float64  `json:"prediction_error"`
	Adapter             *string  `json:"adapter,omitempty"`       // while adapters are declared: the one it holds, "" for the base weights
	AdapterState        string   `json:"adapter_state,omitempty"` // ready, unknown, stray or "switching to <adapter>"
	SwitchSeconds       float64  `json:"switch_seconds,omitempty"`
	AdapterFailures     int      `json:"adapter_failures,omitempty"` // its LoRA calls that failed in a row
	AdapterError        string   `json:"adapter_error,omitempty"`    // why the last of them failed
	AdapterOut          string   `json:"adapter_out,omitempty"`      // why placement leaves it out after them: unreadable, switches failing
}

func newWorkerJSON(w scheduler.WorkerInfo) workerJSON {
	_, hostPort, _ := strings.Cut(w.URL, "://") // the URL's host[:port], as the Python router shows it
	return workerJSON{
		WorkerID:            url.QueryEscape(w.URL),
		DisplayID:           hostPort,
		URL:                 w.URL,
		ActiveRequests:      w.Inflight,
		IsDead:              w.State == scheduler.Dead,
		IsSleeping:          w.Lifecycle == scheduler.Sleeping || w.State == scheduler.Sleeping,
		WeightVersion:       w.Version,
		WeightVersionSource: w.VersionFrom,
		ConsecutiveFailures: w.ConsecFails,
		VideoSupport:        request.VideoSupport(w.TaskTypes),
		State:               w.State.String(),
		Source:              w.Source,
		Namespace:           w.Namespace,
		Pod:                 w.Pod,
		TaskTypes:           w.TaskTypes,
		RequestsServed:      w.Served,
		Failures:            w.Failures,
		ProbeFailures:       w.ProbeFails,
		LastProbe:           timeJSON(w.LastProbe),
		EjectedUntil:        timeJSON(w.EjectedTill),
		Probation:           w.Probation,
		PausedSince:         timeJSON(w.PausedSince),
		LastError:           w.LastError,
		Speed:               w.Speed,
		SpeedLearned:        w.SpeedLearned,
		PredictedWork:       w.WorkLeft / w.Speed,
		PredictionError:     w.PredictionError,
		Adapter:             heldAdapter(w),
		AdapterState:        w.AdapterState,
		SwitchSeconds:       w.SwitchTime,
		AdapterFailures:     w.AdapterFailures,
		AdapterError:        w.AdapterError,
		AdapterOut:          w.AdapterOut,
	}
}

// heldAdapter is the adapter w holds, nil while the pool places none.
func heldAdapter(w scheduler.WorkerInfo) *string {
	if w.AdapterState == "" {
		return nil
	}
	return &w.Adapter
}

// timeJSON is t in RFC 3339, or nil for the zero time.
func timeJSON(t time.Time) *string {
	if t.IsZero() {
		return nil
	}
	s := t.UTC().Format(time.RFC3339Nano)
	return &s
}

func (a *API) serveHealth(w http.ResponseWriter, _ *http.Request) {
	workers := a.Pool.Snapshot()
	var inState [scheduler.StateCount]int
	adapterOut, unreadable := 0, 0
	for _, wk := range workers {
		inState[wk.State]++
		if wk.AdapterOut != "" {
			adapterOut++
		}
		if wk.State == scheduler.Serving && wk.AdapterOut == scheduler.OutUnreadable {
			unreadable++ // it passes its probes, yet serves nothing
		}
	}
	healthy := inState[scheduler.Serving] - unreadable
	status, code := "healthy", http.StatusOK
	// A pause is the trainer's, not a fault; a terminating worker serves
	// while none other does.
	if healthy == 0 && inState[scheduler.Paused] == 0 && inState[scheduler.Terminating] == 0 {
		status, code = "unhealthy", http.StatusServiceUnavailable
	}
	stats := a.Pool.Stats()
	_ = answer.WriteJSON(w, code, a.withHA(map[string]any{
		"status":                 status,
		"healthy_workers":        healthy,
		"total_workers":          len(workers),
		"dead_workers":           inState[scheduler.Dead],
		"sleeping_workers":       inState[scheduler.Sleeping],
		"stale_workers":          inState[scheduler.Stale],
		"unhealthy_workers":      inState[scheduler.Unhealthy],
		"ejected_workers":        inState[scheduler.Ejected],
		"suspect_workers":        inState[scheduler.Suspect],
		"paused_workers":         inState[scheduler.Paused],
		"not_ready_workers":      inState[scheduler.NotReady],
		"terminating_workers":    inState[scheduler.Terminating],
		"adapter_failed_workers": adapterOut,
		"queued_requests":        stats.Queued,
		"queued_by_priority":     priorityCounts(stats.ByPriority),
		"aborted":                a.Pool.AbortStats(),
		"weight_version":         stats.Version,
		"updating_to":            stats.UpdatingTo,
	}))
}

// serveReady is /readyz, for a load balancer in front of several routers:
// 200 when the router is its pool's active one and at least min_ready
// workers serve. A standby answers 503, so that nothing is sent to it. A
// worker a trainer paused counts as serving: the load balancer must not
// drop the active router while the trainer moves the weights.
func (a *API) serveReady(w http.ResponseWriter, _ *http.Request) {
	serving, paused := a.Pool.ServingCount(), a.Pool.PausedCount()
	standby := a.HA != nil && !a.HA.Leading()
	code := http.StatusOK
	if serving+paused < a.MinReady || standby {
		code = http.StatusServiceUnavailable
	}
	reply := a.withHA(map[string]any{"ready": code == http.StatusOK, "serving_workers": serving, "paused_workers": paused, "min_ready": a.MinReady})
	if standby {
		reply["standby"] = true
	}
	_ = answer.WriteJSON(w, code, reply)
}

// serveAlive is /healthz: the router process is alive.
func serveAlive(w http.ResponseWriter, _ *http.Request) {
	_ = answer.WriteJSON(w, http.StatusOK, map[string]string{"status": "alive"})
}

func (a *API) serveWorkers(w http.ResponseWriter, _ *http.Request) {
	workers := a.Pool.Snapshot()
	out := make([]workerJSON, len(workers))
	for i, wk := range workers {
		out[i] = newWorkerJSON(wk)
	}
	resp := a.withHA(map[string]any{"workers": out, "queued_by_priority": priorityCounts(a.Pool.Stats().ByPriority), "aborted": a.Pool.AbortStats()})
	if tenants := a.Pool.Tenants(); len(tenants) > 0 {
		resp["tenants"] = tenants
	}
	if adapters := a.Pool.Adapters(); len(adapters) > 0 {
		resp["adapters"] = adapters
	}
	_ = answer.WriteJSON(w, http.StatusOK, resp)
}

func (a *API) serveListWorkers(w http.ResponseWriter, _ *http.Request) {
	workers := a.Pool.Snapshot()
	urls := make([]string, len(workers))
	for i, wk := range workers {
		urls[i] = wk.URL
	}
	_ = answer.WriteJSON(w, http.StatusOK, map[string]any{"urls": urls})
}

// serveAddWorker registers a worker named by ?url=, ?worker_url= or a JSON
// body {"url"} / {"worker_url"}, and learns what it can generate.
func (a *API) serveAddWorker(w http.ResponseWriter, r *http.Request) {
	u, err := a.workerURLFrom(r)
	if err != nil {
		_ = answer.WriteError(w, http.StatusBadRequest, err.Error())
		return
	}
	info, created, err := a.Pool.Register(u, a.MaxWorkers)
	if err != nil {
		_ = answer.WriteError(w, http.StatusTooManyRequests, fmt.Sprintf("%v (%d)", err, a.MaxWorkers))
		return
	}
	if created {
		a.Logger.Info("worker registered", zap.String("worker", info.URL))
		a.Fleet.Welcome(r.Context(), info.URL)
		a.Fleet.StartCatchUps(a.Weights)
		info, _ = a.Pool.Worker(info.URL)
	}
	_ = answer.WriteJSON(w, http.StatusOK, a.durable(r.Context(), map[string]any{"status": "success", "worker": newWorkerJSON(info)}))
}

// storageWait bounds how long a control call waits for its change to be
// written: storage that hangs must not hold the caller.
const storageWait = 5 * time.Second

// durable writes the fleet's record after a control call changed it, and
// tells the caller in answer when that failed: "persisted": false and a
// warning. The change took effect all the same, and is written as soon as
// storage works again; only a restart before then would lose it.
func (a *API) durable(ctx context.Context, answer map[string]any) map[string]any {
	ctx, cancel := context.WithTimeout(ctx, storageWait)
	defer cancel()
	switch err := a.Store.Persist(ctx); {
	case errors.Is(err, fleet.ErrNotWriter):
		a.Logger.Warn("a change to the fleet took effect on a router that does not lead its pool's group", zap.Error(err))
		answer["persisted"] = false
		answer["warning"] = "the change took effect on this router, which does not lead its pool's group: the group's record, which the active router writes, does not hold it, and the active router does not know it"
	case err != nil:
		a.Logger.Warn("a change to the fleet is not written to storage yet", zap.Error(err))
		answer["persisted"] = false
		answer["warning"] = "the change took effect but is not written to storage yet, so a restart now would lose it: " + err.Error()
	}
	return answer
}

// workerURLFrom reads a worker URL from the query or the JSON body, and
// returns it in canonical form if it may be a worker.
func (a *API) workerURLFrom(r *http.Request) (string, error) {
	raw, err := rawWorkerURL(r)
	if err != nil {
		return "", err
	}
	u, err := workerurl.Parse(raw)
	if err == nil && a.Guard.RefusesURL(u) {
		err = workerurl.ErrAdmin
	}
	return u, err
}

// rawWorkerURL reads a worker URL from the query or the JSON body.
func rawWorkerURL(r *http.Request) (string, error) {
	q := r.URL.Query()
	for _, name := range []string{"url", "worker_url"} {
		// Python routers read the last of a repeated parameter, Go's Get
		// the first: a second one is refused rather than guessed at.
		if n := len(q[name]); n > 1 {
			return "", fmt.Errorf("%s is given %d times; give the worker's URL once", name, n)
		}
	}
	if u := cmp.Or(q.Get("url"), q.Get("worker_url")); u != "" {
		return u, nil
	}
	body, err := decodeJSONBody(r)
	if err != nil {
		return "", err
	}
	for _, name := range []string{"url", "worker_url"} {
		switch v := strictjson.Member(body, name).(type) {
		case string:
			if v != "" {
				return v, nil
			}
		case nil:
		default:
			return "", fmt.Errorf("%s must be a string", name)
		}
	}
	return "", errors.New("worker_url is required (use query ?url=... or JSON body)")
}

// MaxBody bounds the JSON bodies of control calls; the router refuses a
// longer one before it reads it.
const MaxBody = 1 << 20

// decodeJSONBody reads an optional JSON object body (nil when empty), by
// exact key: a body that names a key twice, in any case, is refused, and
// no struct tag's case-insensitive matching is ever involved.
func decodeJSONBody(r *http.Request) (map[string]json.RawMessage, error) {
	body, err := io.ReadAll(io.LimitReader(r.Body, MaxBody))
	if err != nil {
		return nil, fmt.Errorf("reading body: %v", err)
	}
	if len(bytes.TrimSpace(body)) == 0 {
		return nil, nil
	}
	members, err := strictjson.Object(body)
	if errors.Is(err, strictjson.ErrNotObject) {
		return nil, errors.New("Request body must be a JSON object")
	}
	return members, err
}

// workerFromPath finds the worker named by /workers/{id}, answering the
// client itself when there is none.
func (a *API) workerFromPath(w http.ResponseWriter, r *http.Request) (scheduler.WorkerInfo, bool) {
	u, err := workerurl.Parse(r.PathValue("id"))
	if err != nil {
		_ = answer.WriteError(w, http.StatusBadRequest, err.Error())
		return scheduler.WorkerInfo{}, false
	}
	info, ok := a.Pool.Worker(u)
	if !ok {
		_ = answer.WriteError(w, http.StatusNotFound, "Worker not found")
	}
	return info, ok
}

func (a *API) serveWorker(w http.ResponseWriter, r *http.Request) {
	if info, ok := a.workerFromPath(w, r); ok {
		_ = answer.WriteJSON(w, http.StatusOK, map[string]any{"worker": newWorkerJSON(info)})
	}
}

// serveUpdateWorker takes {"is_dead": bool} to hold a worker back or let it
// serve again, either ending a trainer's pause of it, and
// {"refresh_video_support": true} to probe it anew.
func (a *API) serveUpdateWorker(w http.ResponseWriter, r *http.Request) {
	info, ok := a.workerFromPath(w, r)
	if !ok {
		return
	}
	update, err := decodeJSONBody(r)
	if err != nil {
		_ = answer.WriteError(w, http.StatusBadRequest, err.Error())
		return
	}
	isDead, refresh, err := parseWorkerUpdate(update)
	if err != nil {
		_ = answer.WriteError(w, http.StatusBadRequest, err.Error())
		return
	}
	if refresh {
		_ = a.Fleet.Probe(r.Context(), info.URL)
		info, _ = a.Pool.Worker(info.URL)
	}
	reply := map[string]any{"status": "success"}
	if isDead != nil {
		paused := !info.PausedSince.IsZero()
		info, _ = a.Pool.SetDead(info.URL, *isDead) // and ends a pause
		a.Logger.Info("worker marked by operator", zap.String("worker", info.URL), zap.Bool("dead", *isDead), zap.Bool("pause_ended", paused))
		reply = a.durable(r.Context(), reply)
	}
	reply["worker"] = newWorkerJSON(info)
	_ = answer.WriteJSON(w, http.StatusOK, reply)
}

// parseWorkerUpdate checks a PUT /workers/{id} body field by field, as the
// Python router does.
func parseWorkerUpdate(update map[string]json.RawMessage) (isDead *bool, refresh bool, err error) {
	if len(update) == 0 {
		return nil, false, errors.New("At least one field is required: is_dead, refresh_video_support")
	}
	for field, raw := range update {
		if field != "is_dead" && field != "refresh_video_support" {
			return nil, false, fmt.Errorf("Unsupported fields: %s", field)
		}
		var v bool
		if string(raw) == "null" || json.Unmarshal(raw, &v) != nil { // null would leave v false: a revival nobody asked for
			return nil, false, fmt.Errorf("%s must be a boolean", field)
		}
		if field == "is_dead" {
			isDead = &v
		} else {
			refresh = v
		}
	}
	return isDead, refresh, nil
}

func (a *API) serveDeleteWorker(w http.ResponseWriter, r *http.Request) {
	if info, ok := a.workerFromPath(w, r); ok {
		a.removeWorker(w, r, info.URL)
	}
}

// serveRemoveWorker is miles' POST /remove_worker?url=.
func (a *API) serveRemoveWorker(w http.ResponseWriter, r *http.Request) {
	u, err := a.workerURLFrom(r)
	if err != nil {
		_ = answer.WriteError(w, http.StatusBadRequest, err.Error())
		return
	}
	a.removeWorker(w, r, u)
}

func (a *API) removeWorker(w http.ResponseWriter, r *http.Request, workerURL string) {
	if !a.Pool.Remove(workerURL) {
		_ = answer.WriteError(w, http.StatusNotFound, "Worker not found")
		return
	}
	a.Logger.Info("worker removed", zap.String("worker", workerURL))
	_ = answer.WriteJSON(w, http.StatusOK, a.durable(r.Context(), map[string]any{"status": "success", "worker_id": url.QueryEscape(workerURL)}))
}
