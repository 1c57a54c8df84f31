package fleet

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
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
func (f *Fleet) fetchModels(ctx context.Context, workerURL string) (models, error) {
	var m models
	body, err := f.Get(ctx, workerURL+"/v1/models", maxModelsBody)
	if err != nil {
		return m, err
	}
	if err := json.Unmarshal(body, &m); err != nil {
		return m, fmt.Errorf("invalid models payload: %v", err)
	}
	return m, nil
}

// ModelList asks one worker for the entries of its model list, whole, and
// learns from them what it can generate.
func (f *Fleet) ModelList(ctx context.Context, workerURL string) ([]map[string]any, error) {
	m, err := f.fetchModels(ctx, workerURL)
	if err != nil {
		return nil, err
	}
	f.pool.SetCapabilities(workerURL, m.taskTypes(), m.modelID())
	return m.Data, nil
}

// Get reads a worker's answer to a GET of u, which must be 200 and at
// most limit bytes, within probeTimeout.
func (f *Fleet) Get(ctx context.Context, u string, limit int64) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, err
	}
	resp, err := f.client.Do(req)
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

// Probe learns what one worker can generate from its /v1/models. A worker
// that does not answer stays unknown and is asked again later.
func (f *Fleet) Probe(ctx context.Context, workerURL string) error {
	_, err := f.ModelList(ctx, workerURL)
	if err != nil {
		f.logger.Debug("capability probe failed", zap.String("worker", workerURL), zap.Error(err))
	}
	return err
}

// ProbeUnknown probes, in parallel, the workers whose capabilities are not
// known yet, and waits for those probes and any other request's still
// under way: the workers a config lists are probed on first need rather
// than at provisioning, which must not dial out, and a batch of jobs that
// arrives together must not be judged by the first one's probe half done
// (a video job would be told no worker makes videos). Once every worker is
// known it costs an atomic load, not the pool's lock: it runs on every
// image and video request.
func (f *Fleet) ProbeUnknown(ctx context.Context) {
	if f.pool.AllProbed() {
		return
	}
	due := f.pool.Unprobed(time.Now(), reprobeInterval)
	f.probes.mu.Lock()
	for _, u := range due {
		done := make(chan struct{})
		f.probes.running[u] = done
		// Its own context: it serves every request that waits for it,
		// whichever of them leaves.
		scheduler.GoSafely(&f.probes.wg, f.logger, "capability probe of "+u, func() { f.probeFor(context.WithoutCancel(ctx), u, done) })
	}
	waits := slices.Collect(maps.Values(f.probes.running))
	f.probes.mu.Unlock()
	for _, done := range waits {
		select {
		case <-done:
		case <-ctx.Done():
			return
		}
	}
}

// probes are the capability probes of ProbeUnknown under way.
type probes struct {
	mu      sync.Mutex
	running map[string]chan struct{} // by worker URL; closed as the probe ends
	wg      sync.WaitGroup
}

// probeFor probes the worker at url for the requests that wait on done.
func (f *Fleet) probeFor(ctx context.Context, url string, done chan struct{}) {
	defer func() {
		f.probes.mu.Lock()
		delete(f.probes.running, url)
		f.probes.mu.Unlock()
		close(done)
	}()
	_ = f.Probe(ctx, url)
}

// Welcome learns what a worker that just joined can generate. One that
// does not answer stays, but out until its health probes pass: a worker
// nobody can reach must not draw jobs only to fail them. A probe cut short
// by ctx says nothing of the worker.
func (f *Fleet) Welcome(ctx context.Context, workerURL string) {
	if err := f.Probe(ctx, workerURL); err != nil && ctx.Err() == nil {
		f.pool.SetDown(workerURL, err)
	}
}
