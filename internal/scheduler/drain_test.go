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

// A job whose client left, or that an abort ended, runs on in its worker
// until its predicted end, when the pool lets go of it: nobody waits on
// it, so it never hangs. A drain waits for it, however far past the stall
// limit at the speed the pool has learned since, rather than leave its
// worker out of the update (it did: priced at the initial speed, the job
// held its worker 50 s, while the stall check, at the speed learned
// meanwhile, took it for hung after 25).
func TestDrainWaitsForAJobWhoseClientLeft(t *testing.T) {
	p, clock := poolOf(t, 2)
	t.Cleanup(func() { _ = p.Close() })
	cfg := config(LeastWork{}, 1)
	left, _ := choose(t, p, cfg, 50) // 50 s at the initial speed
	left.Sent = true
	p.Release(left, Abandoned)
	quick, _ := choose(t, p, cfg, 1)
	clock.advance(100 * time.Millisecond)
	p.Release(quick, Succeeded) // 10 units a second: the job left is 5 s of work
	clock.advance(time.Minute)  // past the stall limit at either speed
	if marked := p.CheckStalls(testHealth); len(marked) > 0 {
		t.Fatalf("the worker of a job whose client left was taken for stalled: %v", marked)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if hung, err := p.WaitIdle(ctx, p.URLs(), time.Minute, testHealth); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a drain beside a job whose client left ended with %v, %v; want it to wait for the job", hung, err)
	}
	p.endGhost(left) // its predicted end
	if hung, err := p.WaitIdle(context.Background(), p.URLs(), time.Minute, testHealth); err != nil || len(hung) > 0 {
		t.Fatalf("a drain once the job ended: hung %v, %v; want none", hung, err)
	}
}
