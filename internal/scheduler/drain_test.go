package scheduler

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"
)

// A drain waits for jobs, but not for one taken for stalled: its worker is
// returned as hung, and after the update is brought to the fleet's weights
// only once that job has ended.
func TestDrainDoesNotWaitForAHungJob(t *testing.T) {
	p, clock := poolOf(t, 2)
	cfg := config(LeastWork{}, 1)
	hungJob, _ := choose(t, p, cfg, 1) // predicted 1 s at the initial speed
	choose(t, p, cfg, 1)

	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := p.WaitIdle(ctx, p.URLs(), time.Minute, testHealth); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a drain beside jobs within their predictions ended: %v", err)
	}

	clock.advance(time.Duration(testHealth.StallFactor+1) * time.Second)
	hung, err := p.WaitIdle(context.Background(), []string{hungJob.ServedBy()}, time.Minute, testHealth)
	if err != nil || !slices.Equal(hung, []string{hungJob.ServedBy()}) {
		t.Fatalf("drain beside a job %s over its prediction: hung %v, %v", time.Duration(testHealth.StallFactor+1)*time.Second, hung, err)
	}

	p.LeaveOut(hung)
	p.RecordProbe(hungJob.ServedBy(), nil, testHealth)
	if st := infoOf(t, p, hungJob.ServedBy()).Lifecycle; st != Stale {
		t.Fatalf("a worker left out is %v while its hung job runs; want stale", st)
	}
	p.Release(hungJob, Abandoned)
	clock.advance(time.Hour) // past the abandoned job's predicted end
	p.RecordProbe(hungJob.ServedBy(), nil, testHealth)
	if st := infoOf(t, p, hungJob.ServedBy()).Lifecycle; st != Serving {
		t.Fatalf("a worker left out is %v once its job ended and a probe passed; want serving", st)
	}
}
