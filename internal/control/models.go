package control

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// Capability probes: a worker that does not answer delays at most one
// request per reprobeInterval.
const (
	probeTimeout    = 5 * time.Second
	reprobeInterval = 30 * time.Second
)

// models is a worker's answer to GET /v1/models. Entries are kept whole so
// the router's union passes every field on.
type models struct {
	Data []map[string]any `json:"data"`
}

func (m models) taskTypes() []string {
	var out []string
	for _, e := range m.Data {
		if t, ok := e["task_type"].(string); ok && !slices.Contains(out, t) {
			out = append(out, t)
		}
	}
	return out
}

// modelID is the id of the worker's first model: sglang serves one.
func (m models) modelID() string {
	if len(m.Data) == 0 {
		return ""
	}
	id, _ := m.Data[0]["id"].(string)
	return id
}

// maxModelsBody bounds a worker's /v1/models answer: a list of the one
// model a sglang-diffusion worker serves is a kilobyte or two.
const maxModelsBody = 1 << 20

// fetchModels asks one worker for its model list.
func (a *API) fetchModels(ctx context.Context, workerURL string) (models, error) {
	var m models
	body, err := a.get(ctx, workerURL+"/v1/models", maxModelsBody)
	if err != nil {
		return m, err
	}
	if err := json.Unmarshal(body, &m); err != nil {
		return m, fmt.Errorf("invalid models payload: %v", err)
	}
	return m, nil
}

// get reads a worker's answer to a GET of u, which must be 200 and at
// most limit bytes, within probeTimeout.
func (a *API) get(ctx context.Context, u string, limit int64) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, err
	}
	resp, err := a.Pool.Client().Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("status=%d", resp.StatusCode)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, limit+1))
	if err == nil && int64(len(body)) > limit {
		err = fmt.Errorf("answer larger than %d bytes", limit)
	}
	return body, err
}

// probe learns what one worker can generate from its /v1/models. A worker
// that does not answer stays unknown and is asked again later.
func (a *API) probe(ctx context.Context, workerURL string) error {
	m, err := a.fetchModels(ctx, workerURL)
	if err != nil {
		a.Logger.Debug("capability probe failed", zap.String("worker", workerURL), zap.Error(err))
		return err
	}
	a.Pool.SetCapabilities(workerURL, m.taskTypes(), m.modelID())
	return nil
}

// ProbeUnknown probes, in parallel, the workers whose capabilities are not
// known yet: the workers a config lists are probed on first need rather
// than at provisioning, which must not dial out. Once every worker is known
// it costs an atomic load, not the pool's lock: it runs on every image and
// video request.
func (a *API) ProbeUnknown(ctx context.Context) {
	if a.Pool.AllProbed() {
		return
	}
	urls := a.Pool.Unprobed(time.Now(), reprobeInterval)
	var wg sync.WaitGroup
	for _, u := range urls {
		scheduler.GoSafely(&wg, a.Logger, "capability probe of "+u, func() { _ = a.probe(ctx, u) })
	}
	wg.Wait()
}

// serveModels answers GET /v1/models with the union of the serving
// workers' lists, deduplicated by model id. Anyone may ask, and each
// union costs a call to every worker, so it is a shared answer.
func (a *API) serveModels(w http.ResponseWriter, r *http.Request) {
	var urls []string
	for _, wk := range a.Pool.Snapshot() {
		if wk.State != scheduler.Dead && wk.State != scheduler.Sleeping {
			urls = append(urls, wk.URL)
		}
	}
	status, contentType, body := a.Models.get(strings.Join(urls, " "), func() (int, string, []byte) {
		status, answer := a.modelUnion(context.WithoutCancel(r.Context()), urls)
		body, _ := json.Marshal(answer)
		return status, "application/json", body
	})
	w.Header().Set("Content-Type", contentType)
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// sharedLifetime is how long an answer made from every worker's is kept.
const sharedLifetime = 2 * time.Second

// SharedAnswer is an answer that costs a call to every worker: anyone may
// ask for it, so it is kept for sharedLifetime and callers that come while
// one is made wait for it rather than make their own.
type SharedAnswer struct {
	mu          sync.Mutex // held while an answer is made
	key         string     // what it was made from
	made        time.Time
	status      int
	contentType string
	body        []byte
}

// get returns the answer for key, making it anew when there is none for
// key younger than sharedLifetime.
func (s *SharedAnswer) get(key string, make func() (status int, contentType string, body []byte)) (int, string, []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if key != s.key || time.Since(s.made) >= sharedLifetime {
		s.status, s.contentType, s.body = make()
		s.key, s.made = key, time.Now()
	}
	return s.status, s.contentType, s.body
}

// modelUnion asks the workers (those not held back or asleep) for their
// model lists and merges them.
func (a *API) modelUnion(ctx context.Context, urls []string) (int, any) {
	if len(urls) == 0 {
		return http.StatusServiceUnavailable, map[string]string{"error": "No healthy workers available in the pool"}
	}
	lists := make([]models, len(urls))
	errs := make([]error, len(urls))
	var wg sync.WaitGroup
	for i, u := range urls {
		scheduler.GoSafely(&wg, a.Logger, "model list of "+u, func() { lists[i], errs[i] = a.fetchModels(ctx, u) })
	}
	wg.Wait()

	merged := []map[string]any{}
	seen := map[string]bool{}
	details := map[string]string{}
	for i, m := range lists {
		if errs[i] != nil {
			details[urls[i]] = errs[i].Error()
			continue
		}
		a.Pool.SetCapabilities(urls[i], m.taskTypes(), m.modelID())
		for _, e := range m.Data {
			if key := modelKey(e); !seen[key] {
				seen[key] = true
				merged = append(merged, e)
			}
		}
	}
	if len(details) == len(urls) {
		return http.StatusBadGateway, map[string]any{"error": "Failed to fetch models from workers", "details": details}
	}
	return http.StatusOK, map[string]any{"object": "list", "data": merged}
}

// modelKey identifies a model entry: its id, or the whole entry when it
// has none.
func modelKey(e map[string]any) string {
	if id, ok := e["id"].(string); ok && id != "" {
		return id
	}
	b, _ := json.Marshal(e)
	return string(b)
}
