package fleet

import (
	"context"
	"testing"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// retriedUpdate is a pool whose workers are all on the update the
// router inherited: BeginUpdate finds them done. Any other method panics
// (the embedded Operated is nil), which shows what Update calls.
type retriedUpdate struct {
	Operated
	done  []string
	ended []bool
}

func (p *retriedUpdate) BeginUpdate(scheduler.Update) (targets, done []string) { return nil, p.done }

func (p *retriedUpdate) EndUpdate(_ scheduler.Update, succeeded bool) {
	p.ended = append(p.ended, succeeded)
}

// The retry of an inherited update whose workers are all on it calls no
// worker (the fake has no addresses to call), answers each as done, and
// ends the update as a success.
func TestRetriedUpdateWithEveryWorkerOnItCallsNone(t *testing.T) {
	pool := &retriedUpdate{done: []string{"http://a:1", "http://b:1"}}
	f := New(pool, zap.NewNop())
	u := scheduler.Update{Path: scheduler.DiskUpdatePath, ModelPath: "/ckpt/2", Version: "/ckpt/2", Mode: scheduler.ModeDrain}
	results, err := f.Update(context.Background(), u, &Config{})
	if err != nil {
		t.Fatal(err)
	}
	if len(results) != 2 || !results[0].OK || results[0].StatusCode != 200 || results[1].WorkerURL != "http://b:1" {
		t.Fatalf("results %+v; want both workers done, 200", results)
	}
	if len(pool.ended) != 1 || !pool.ended[0] {
		t.Fatalf("EndUpdate calls %v; want one, a success", pool.ended)
	}
}
