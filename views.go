package diffusionrouter

import (
	"context"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/attempt"
	"github.com/miles-rollout/miles-diffusion-router/internal/jobkinds"
	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// The root sees its pool through views of the parts it uses, as
// internal/control and internal/fleet do: a request's way through it, what
// a loaded config declares, the health checks, and what metrics and
// status show. poolref.go alone makes the scheduler's pool and hands it to
// each; a test may give a fake of one view.

// jobs is a request's way through the pool: its ticket and a worker for
// it (here), then its attempts, re-runs and hedged copies (attempt.Pool),
// and the video and image jobs the pool remembers (jobkinds.Pool).
type jobs interface {
	attempt.Pool
	jobkinds.Pool
	NewTicket(cfg *scheduler.Config) *scheduler.Ticket
	Track(t *scheduler.Ticket) error
	Untrack(t *scheduler.Ticket)
	Acquire(ctx context.Context, t *scheduler.Ticket) error
	ResolveAdapter(t *scheduler.Ticket, name string) error
	PlacesAdapters() bool
	CanServe(k request.Task) bool
	AnyMakes(k request.Task) bool
	ServingDials() []string
}

// configured is what a loaded config declares in the pool, and what its
// DNS lookups find.
type configured interface {
	Declare(urls []string)
	Undeclare(urls []string)
	DeclareAdapters(adapters []scheduler.Adapter, cfg scheduler.PlacementConfig)
	UndeclareAdapters(adapters []scheduler.Adapter)
	DeclareLookups(source string, keys []string)
	UndeclareLookups(keys []string)
	SetFound(key string, found []scheduler.Found, maxWorkers int) scheduler.FoundChange
	SetFailing(key string, failing bool)
	SetInitialSpeed(speed float64)
	UseSwitcher(s scheduler.Switcher)
}

// probed is the pool as its health checks judge the workers.
type probed interface {
	URLs() []string
	Unverified() []string
	Reverify()
	RecordProbe(url string, err error, cfg *scheduler.HealthConfig) scheduler.HealthChange
	CheckStalls(cfg *scheduler.HealthConfig) []string
}

// observed is what metrics, logs and the status show of the pool.
type observed interface {
	Name() string
	Stats() scheduler.Stats
	Snapshot() []scheduler.WorkerInfo
	ServingCount() int
	Tenants() []scheduler.TenantStats
	Adapters() []scheduler.AdapterStats
	AbortStats() scheduler.AbortStats
	HeldBack() map[string]uint64
	Backlog() time.Duration
	LookupsInSync() map[string]bool
}
