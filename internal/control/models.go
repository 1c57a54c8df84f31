package control

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

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
	lists := make([][]map[string]any, len(urls))
	errs := make([]error, len(urls))
	var wg sync.WaitGroup
	for i, u := range urls {
		scheduler.GoSafely(&wg, a.Logger, "model list of "+u, func() { lists[i], errs[i] = a.Fleet.ModelList(ctx, u) })
	}
	wg.Wait()

	merged := []map[string]any{}
	seen := map[string]bool{}
	details := map[string]string{}
	for i, entries := range lists {
		if errs[i] != nil {
			details[urls[i]] = errs[i].Error()
			continue
		}
		for _, e := range entries {
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
