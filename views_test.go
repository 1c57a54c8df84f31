package diffusionrouter

import (
	"strings"
	"testing"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// named is a pool that tells its name and nothing else: any other method
// panics (the embedded view is nil).
type named struct {
	observed
	name string
}

func (n named) Name() string { return n.name }

// The answer to a job that got no worker reads the pool through its
// observed view, which a fake gives here.
func TestQueueErrorNamesThePoolAndItsBound(t *testing.T) {
	sched := scheduler.New(t.Name(), zap.NewNop())
	t.Cleanup(func() { _ = sched.Close() })
	tk := sched.NewTicket(&scheduler.Config{MaxQueue: 7})
	status, msg := queueError(named{name: "rollout"}, tk, scheduler.ErrQueueFull)
	if status != 429 || !strings.Contains(msg, `pool "rollout" is full`) || !strings.Contains(msg, "max_queue 7") {
		t.Fatalf("a full queue answers %d %q; want 429 naming the pool and max_queue", status, msg)
	}
}
