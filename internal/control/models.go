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
	status, contentType, body := a.Models.get(r.Context(), strings.Join(urls, " "), modelsLifetime, func() (int, string, []byte) {
		status, answer := a.modelUnion(context.WithoutCancel(r.Context()), urls)
		body, _ := json.Marshal(answer)
		return status, "application/json", body
	})
	w.Header().Set("Content-Type", contentType)
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// modelsLifetime is how long a union of the workers' model lists is kept.
const modelsLifetime = 2 * time.Second

// SharedAnswer is an answer that costs a call to every worker: anyone may
// ask for it, so it is made at most once per lifetime, and callers that
// come while one is made wait for it rather than make their own. Its
// zero value is ready to use.
type SharedAnswer struct {
	// Now is the clock that dates answers; nil: the wall clock.
	Now func() time.Time

	mu   sync.Mutex
	last *sharedCall // the answer made last, or being made
}

// sharedCall is one making of a shared answer.
type sharedCall struct {
	key         string        // what it is made from
	began       time.Time     // when its calls to the workers began
	done        chan struct{} // closed once it is made
	status      int
	contentType string
	body        []byte
}

// get returns the answer for key: the one being made, whatever its key
// (one round of calls to the workers at a time), or the last one made
// if it was made from key less than lifetime ago; otherwise it makes one
// by build, which calls the workers. A caller whose ctx ends while it
// waits stops waiting (its client left, and reads no answer); the answer
// is made all the same.
func (s *SharedAnswer) get(ctx context.Context, key string, lifetime time.Duration, build func() (status int, contentType string, body []byte)) (int, string, []byte) {
	now := time.Now
	if s.Now != nil {
		now = s.Now
	}
	s.mu.Lock()
	c := s.last
	if c == nil || c.made() && (c.key != key || now().Sub(c.began) >= lifetime) {
		c = &sharedCall{key: key, began: now(), done: make(chan struct{})}
		s.last = c
		s.mu.Unlock()
		defer close(c.done) // even if build panics: the callers waiting on it would wait on
		c.status, c.contentType, c.body = build()
		return c.status, c.contentType, c.body
	}
	s.mu.Unlock()
	select {
	case <-c.done:
		return c.status, c.contentType, c.body
	case <-ctx.Done():
		return http.StatusServiceUnavailable, "application/json", []byte(`{"error":"the client left"}` + "\n")
	}
}

// made reports whether c's answer is made.
func (c *sharedCall) made() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
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
