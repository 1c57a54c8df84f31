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
	p.Release(hungJob, End{Worker: Abandoned})
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
	left.NoteSent()
	p.Release(left, End{Worker: Abandoned})
	quick, _ := choose(t, p, cfg, 1)
	clock.advance(100 * time.Millisecond)
	p.Release(quick, End{Worker: Succeeded}) // 10 units a second: the job left is 5 s of work
	clock.advance(time.Minute)               // past the stall limit at either speed
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

// A worker that gave no answer to an update and is found again waits for
// its catch-up as stale: it shows updating only while the catch-up calls
// it (it showed updating from the probe on, for as long as no request came
// to start its catch-up). An update that starts meanwhile leaves it to its
// catch-up, which replays that update too, and a wake does not make it
// serve on its old weights.
func TestWorkerWaitingForItsCatchUpIsStale(t *testing.T) {
	p, _ := poolOf(t, 2)
	up := Update{Path: DiskUpdatePath, Version: "step-1", Mode: ModeDrain, Body: []byte(`{"model_path":"/ckpt/1"}`)}
	p.BeginUpdate(up)
	p.FinishUpdate("http://a:1", up.Version, true, true)
	p.FinishUpdate("http://b:1", up.Version, false, false) // down
	p.EndUpdate(up, true)

	p.RecordProbe("http://b:1", nil, testHealth) // back, on its old weights
	if st := infoOf(t, p, "http://b:1").State; st != Stale || !p.AnyBehind() {
		t.Fatalf("a worker found again after it missed an update is %v, waiting to catch up: %v; want stale, waiting", st, p.AnyBehind())
	}
	if got := p.TakeBehind(); !slices.Equal(got, []string{"http://b:1"}) {
		t.Fatalf("workers to catch up: %v", got)
	}
	if targets, _ := p.BeginUpdate(Update{Path: DiskUpdatePath, Version: "step-2", Mode: ModeDrain}); !slices.Equal(targets, []string{"http://a:1"}) {
		t.Fatalf("an update beside a worker waiting for its catch-up goes to %v; want a alone", targets)
	}
	p.EndUpdate(Update{}, false)
	p.Moved([]string{"http://b:1"}, Serving) // a wake, which every worker not held back is sent
	if st := infoOf(t, p, "http://b:1").State; st != Stale {
		t.Fatalf("a worker whose catch-up waits for its turn is %v after a wake; want stale", st)
	}
	if _, ok := p.BeginCatchUp("http://b:1"); !ok {
		t.Fatal("the catch-up found nothing to do")
	}
	if st := infoOf(t, p, "http://b:1").State; st != Updating {
		t.Fatalf("a worker whose catch-up calls it is %v; want updating", st)
	}
	p.FinishUpdate("http://b:1", up.Version, true, true)
	if info := infoOf(t, p, "http://b:1"); info.State != Serving || info.Version != "step-1" {
		t.Fatalf("the worker caught up is %v on %q", info.State, info.Version)
	}
	if _, ok := p.BeginCatchUp("http://b:1"); ok {
		t.Fatal("a second catch-up of a worker up to date found something to do")
	}
}
