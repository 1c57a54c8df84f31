package control

import (
	_ "embed"
	"net/http"
	"strconv"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/answer"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// dashboardPage is the status page: one self-contained HTML file, no CDN
// and no build step, so it works on an offline cluster.
//
//go:embed dashboard.html
var dashboardPage []byte

// serveDashboard is GET /dashboard.
func serveDashboard(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-cache")
	_, _ = w.Write(dashboardPage)
}

// priorityCounts are the jobs waiting by priority, keyed by the priority
// as JSON keys are: text.
func priorityCounts(byPriority map[int]int) map[string]int {
	out := make(map[string]int, len(byPriority))
	for prio, n := range byPriority {
		out[strconv.Itoa(prio)] = n
	}
	return out
}

// serveDashboardData is GET /dashboard/data: the pool now, polled by the
// status page, which draws its charts from successive answers.
func (a *API) serveDashboardData(w http.ResponseWriter, _ *http.Request) {
	workers := a.Pool.Snapshot()
	out := make([]workerJSON, len(workers))
	servingWorkers := 0
	for i, wk := range workers {
		out[i] = newWorkerJSON(wk)
		if wk.State == scheduler.Serving {
			servingWorkers++
		}
	}
	stats := a.Pool.Stats()
	_ = answer.WriteJSON(w, http.StatusOK, a.withHA(map[string]any{
		"tenants":            a.Pool.Tenants(),
		"adapters":           a.Pool.Adapters(),
		"pool":               a.Pool.Name(),
		"policy":             a.Policy,
		"time":               time.Now().UnixMilli(),
		"queued":             stats.Queued,
		"queued_by_priority": priorityCounts(stats.ByPriority),
		"aborted":            a.Pool.AbortStats(),
		"completed_jobs":     stats.Completed,
		"serving_workers":    servingWorkers,
		"total_workers":      len(workers),
		"weight_version":     stats.Version,
		"workers":            out,
	}))
}
