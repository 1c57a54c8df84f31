package control

import (
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// Pool is what the control API reads and changes of the scheduler's pool:
// its roster, the adapters it places and the jobs it aborts, each a view
// of its own. The scheduler's pool is one; a test may give a fake.
type Pool interface {
	Roster
	Placement
	Aborter
}

// Roster is the pool's workers as the control API lists, registers,
// removes and holds them back, with the figures /health reports.
type Roster interface {
	Name() string
	Snapshot() []scheduler.WorkerInfo
	Worker(url string) (scheduler.WorkerInfo, bool)
	Register(url string, maxWorkers int) (scheduler.WorkerInfo, bool, error)
	Remove(url string) bool
	SetDead(url string, dead bool) (scheduler.WorkerInfo, bool)
	ServingCount() int
	PausedCount() int
	Stats() scheduler.Stats
	Version() string
	Tenants() []scheduler.TenantStats
}

// Placement is the LoRA adapters the pool places, as the control API
// lists and publishes them.
type Placement interface {
	AdaptersOn() bool
	Adapters() []scheduler.AdapterStats
	AdapterNames() []string
	AdapterPath(name string) string
	Publish(name, path string, strength float64) (holders []string, version string, err error)
	WaitSwitched(stop <-chan struct{}, urls []string, name string, timeout time.Duration) map[string]scheduler.SwitchResult
}

// Aborter ends the jobs a client names, and counts what it ended.
type Aborter interface {
	Abort(ab scheduler.Abort) scheduler.AbortCounts
	AbortStats() scheduler.AbortStats
}
