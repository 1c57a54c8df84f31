package fleet

import (
	"context"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// The fleet sees the scheduler's pool through views of its parts: the
// weights its operations move the workers through, the capabilities its
// probes learn, and the record its store keeps. The scheduler's pool is
// each; a test may give a fake.

// Operated is what the fleet's operations and probes use of the pool.
type Operated interface {
	Weights
	Capabilities
}

// Background runs a pool's goroutines, which end with it.
type Background interface {
	Name() string
	Go(what string, f func(ctx context.Context))
}

// Weights is the workers' weights and states as the fleet's operations
// move them: updates and their catch-ups, sleep and wake, a trainer's
// pause, and the drains before them.
type Weights interface {
	Background
	BeginUpdate(u scheduler.Update) (targets, done []string)
	FinishUpdate(url, version string, ok, answered bool)
	EndUpdate(u scheduler.Update, succeeded bool)
	AnyBehind() bool
	TakeBehind() []string
	BeginCatchUp(url string) (scheduler.CatchUp, bool)
	Verified(plan scheduler.CatchUp, matched, answered bool)
	LeaveOut(urls []string)
	SetStates(urls []string, s scheduler.State)
	Moved(urls []string, s scheduler.State)
	InState(s scheduler.State) ([]string, error)
	Awake() []string
	NotHeldBack() ([]string, error)
	HoldJobs()
	ReleaseJobs()
	PauseWorkers(urls []string) (paused, already []string, err error)
	ContinueWorkers(urls []string) (continued []string, err error)
	DeclareTargets() ([]string, error)
	DeclareVersion(d scheduler.Declaration)
	WaitIdle(ctx context.Context, urls []string, timeout time.Duration, health *scheduler.HealthConfig) (hung []string, err error)
}

// Capabilities is what the fleet's probes learn of each worker: the
// tasks it serves, or that it is down.
type Capabilities interface {
	AllProbed() bool
	Unprobed(now time.Time, interval time.Duration) []string
	SetCapabilities(url string, taskTypes []string, modelID string)
	SetDown(url string, err error)
}

// Recorded is the pool's state as its record keeps it: written when it
// changes, read back at start, mirrored from the active router of a group.
type Recorded interface {
	Background
	Record() scheduler.Record
	Restore(rec scheduler.Record) (joined int, adopted bool)
	Mirror(rec scheduler.Record) (joined, left int)
	Inherit(rec scheduler.Record) (joined, left int)
	Changed()
	Changes() <-chan struct{}
	Stats() scheduler.Stats
}
