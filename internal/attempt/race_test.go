package attempt

import (
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/answer"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// hedged is a fleet of n workers whose jobs get a copy once they overrun
// twice their prediction.
func hedged(t *testing.T, n int) *testFleet {
	f := newFleet(t, n)
	f.cfg.HedgeAfter = 2
	return f
}

// overrun moves the clock past any job's prediction once entered is
// closed: the job's attempt is on its worker.
func (f *testFleet) overrun(entered chan struct{}) {
	go func() {
		<-entered
		f.clock.Advance(time.Hour)
	}()
}

// joinOnce has the worker at url join once ready is closed, and moves
// the clock past the due time of the job's next copy.
func (f *testFleet) joinOnce(ready chan struct{}, url string) {
	go func() {
		<-ready
		f.join(url)
		f.clock.Advance(time.Hour)
	}()
}

// A hung attempt gets a copy on the idle worker once it overruns; the
// copy's answer is the client's, the attempt ends, and the copy's worker
// goes free.
func TestAHungAttemptIsOvertakenByACopy(t *testing.T) {
	f := hedged(t, 2)
	j := f.job("hung")
	first := j.t.ServedBy()
	entered := make(chan struct{})
	f.serve(first, hangs(entered))
	f.serve(f.other(first), answers(http.StatusOK, imageAnswer))
	f.overrun(entered)

	if err := f.runJob(j); err != nil {
		t.Fatal(err)
	}
	expectAnswer(t, j, http.StatusOK, imageAnswer)
	if j.t.ServedBy() != f.other(first) {
		t.Fatalf("answered by %s; want the copy's worker", j.t.ServedBy())
	}
	if info, _ := f.pool.Worker(first); info.Failures != 1 {
		t.Fatalf("the overtaken worker has %d failures; want 1: it overran its prediction many times", info.Failures)
	}
	expectCount(t, f.run.Metrics.Hedges, "launched", 1)
	expectCount(t, f.run.Metrics.Hedges, "won", 1)
	if info, _ := f.pool.Worker(f.other(first)); info.Inflight != 0 {
		t.Fatalf("the copy's worker holds %d jobs; want 0", info.Inflight)
	}
}

// failsOnceCopied is a worker whose attempt fails with a 502 as its copy
// runs: it waits until the copy began, and lets the copy go on as it
// answers. entered is closed as its job arrives.
func failsOnceCopied(entered, copied, failing chan struct{}) worker {
	return func(w http.ResponseWriter, r *http.Request) error {
		close(entered)
		<-copied
		close(failing)
		return answers(http.StatusBadGateway, `{"error":"upstream"}`)(w, r)
	}
}

// An attempt that fails as its copy runs leaves no worker claimed: the
// attempt kept its worker for a re-run that the copy's win, just after,
// makes needless, and that worker must go free all the same. The client
// gets the copy's answer.
func TestACopyWinningAsTheAttemptFailsFreesEveryWorker(t *testing.T) {
	for range 20 {
		f := hedged(t, 2)
		j := f.job("copy-wins")
		first := j.t.ServedBy()
		entered, copied, failing := make(chan struct{}), make(chan struct{}), make(chan struct{})
		f.serve(first, failsOnceCopied(entered, copied, failing))
		f.serve(f.other(first), func(w http.ResponseWriter, r *http.Request) error {
			close(copied)
			<-failing
			return answers(http.StatusOK, imageAnswer)(w, r)
		})
		f.overrun(entered)

		if err := f.runJob(j); err != nil {
			t.Fatal(err)
		}
		expectAnswer(t, j, http.StatusOK, imageAnswer)
		expectCount(t, f.run.Metrics.Reruns, "status", 0) // the copy answered
		f.expectIdle()
	}
}

// A copy that wins while the attempt is still running, its answer
// streaming to the client, ends the attempt: the attempt's own answer,
// a 502 that comes after, is nobody's, runs the job nowhere, and its
// worker is released as overtaken.
func TestAnAttemptFailingAfterItsCopyWonRunsNothingAgain(t *testing.T) {
	f := hedged(t, 2)
	f.run.Budget = answer.NewBudget(-1, 0) // answers stream: the copy wins as its answer begins
	j := f.job("copy-won-first")
	first := j.t.ServedBy()
	entered, won := make(chan struct{}), make(chan struct{})
	f.serve(first, func(w http.ResponseWriter, r *http.Request) error {
		close(entered)
		<-won
		return answers(http.StatusBadGateway, `{"error":"upstream"}`)(w, r)
	})
	f.serve(f.other(first), func(w http.ResponseWriter, r *http.Request) error {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		close(won)
		_, err := w.Write([]byte(imageAnswer))
		return err
	})
	f.overrun(entered)

	if err := f.runJob(j); err != nil {
		t.Fatal(err)
	}
	expectAnswer(t, j, http.StatusOK, imageAnswer)
	expectCount(t, f.run.Metrics.Reruns, "status", 0)
	if info, _ := f.pool.Worker(first); info.Failures != 1 {
		t.Fatalf("the overtaken worker has %d failures; want 1", info.Failures)
	}
	if info, _ := f.pool.Worker(f.other(first)); info.Inflight != 0 {
		t.Fatalf("the copy's worker holds %d jobs; want 0", info.Inflight)
	}
}

// A job still within hedge_after times its prediction gets no copy, even
// with a worker idle: a copy would double its GPU work for nothing.
func TestAJobWithinItsPredictionGetsNoCopy(t *testing.T) {
	f := hedged(t, 2)
	j := f.job("in-time")
	// Past health_timeout, the earliest look, within 2 times the
	// prediction (a job of cost 1 at the assumed 1 unit/s: 2 s).
	f.serve(j.t.ServedBy(), f.answersAfter(1500*time.Millisecond))
	f.serve(f.other(j.t.ServedBy()), answers(http.StatusOK, `{"created":2,"data":[]}`))

	if err := f.runJob(j); err != nil {
		t.Fatal(err)
	}
	expectAnswer(t, j, http.StatusOK, imageAnswer)
	expectCount(t, f.run.Metrics.Hedges, "launched", 0)
}

// With hedging off (hedge_after off) a job stays on its worker however
// long it overruns, though another worker is idle.
func TestHedgingOffGivesAHungJobNoCopy(t *testing.T) {
	f := newFleet(t, 2)
	j := f.job("alone")
	f.serve(j.t.ServedBy(), f.answersAfter(time.Hour))
	idle := f.other(j.t.ServedBy())
	f.serve(idle, func(http.ResponseWriter, *http.Request) error {
		t.Errorf("a copy reached the idle worker %s with hedging off", idle)
		return nil
	})

	if err := f.runJob(j); err != nil {
		t.Fatal(err)
	}
	expectAnswer(t, j, http.StatusOK, imageAnswer)
	expectCount(t, f.run.Metrics.Hedges, "launched", 0)
}

// One client request costs the fleet at most max_attempts GPU jobs,
// copies and re-runs together: here each attempt overruns until a copy
// of it starts, then fails. The third, the last max_attempts (3) allows,
// overruns too, and fails once no copy came within a while; a copy beyond
// the budget would come at once.
func TestCopiesAndRerunsShareMaxAttempts(t *testing.T) {
	f := hedged(t, 6)
	j := f.job("fails-everywhere")
	var mu sync.Mutex
	var entries []string
	started := [...]chan struct{}{make(chan struct{}), make(chan struct{}), make(chan struct{}), make(chan struct{})}
	failing := func(w http.ResponseWriter, r *http.Request) error {
		mu.Lock()
		i := len(entries)
		entries = append(entries, scheduler.TicketFrom(r.Context()).ServedBy())
		mu.Unlock()
		if i+1 < len(started) {
			close(started[i])
			f.clock.Advance(time.Hour) // overdue: a copy is due
			wait := time.After(10 * time.Second)
			if i == 2 {
				wait = time.After(50 * time.Millisecond)
			}
			select {
			case <-started[i+1]:
			case <-wait:
				if i < 2 {
					t.Errorf("attempt %d overran, yet no copy of it started", i+1)
				}
			case <-r.Context().Done():
			}
		}
		return answers(http.StatusInternalServerError, `{"error":"boom"}`)(w, r)
	}
	for _, u := range f.urls {
		f.serve(u, failing)
	}

	if err := f.runJob(j); err != nil {
		t.Fatal(err)
	}
	if j.client.Code != http.StatusInternalServerError {
		t.Fatalf("client got %d %q; want the last attempt's 500", j.client.Code, j.client.Body.String())
	}
	mu.Lock()
	defer mu.Unlock()
	if len(entries) != 3 {
		t.Fatalf("one request ran %d GPU jobs (%v); max_attempts is 3", len(entries), entries)
	}
	expectCount(t, f.run.Metrics.Hedges, "launched", 2)
	f.expectIdle()
}

// A client that leaves after the attempt failed, while its copy still
// runs, frees the worker the attempt kept for a re-run: no re-run comes.
func TestAClientLeavingWhileTheCopyRunsFreesTheAttemptsWorker(t *testing.T) {
	f := hedged(t, 2)
	j := f.job("client-leaves")
	first := j.t.ServedBy()
	entered, copied, failing := make(chan struct{}), make(chan struct{}), make(chan struct{})
	f.serve(first, failsOnceCopied(entered, copied, failing))
	copyDone := make(chan struct{})
	f.serve(f.other(first), func(w http.ResponseWriter, r *http.Request) error {
		defer close(copyDone)
		close(copied)
		<-r.Context().Done()
		return r.Context().Err()
	})
	f.overrun(entered)
	ended := f.startJob(j)
	<-failing
	eventually(t, "the failed attempt's worker is free while its copy runs", func() bool {
		info, _ := f.pool.Worker(first)
		return info.Inflight == 0
	})
	j.leave()

	if err := <-ended; err != nil {
		t.Fatal(err)
	}
	<-copyDone
	expectCount(t, f.run.Metrics.Reruns, "status", 0) // its client left
	if info, _ := f.pool.Worker(first); info.Inflight != 0 {
		t.Fatalf("the failed attempt's worker holds %d jobs; want 0", info.Inflight)
	}
}

// An abort that comes once a copy's answer won, while that answer still
// streams to the client, ends nothing: the job has its answer, and the
// client gets it whole.
func TestAnAbortAfterACopyWonLetsItsAnswerEnd(t *testing.T) {
	f := hedged(t, 2)
	f.run.Budget = answer.NewBudget(-1, 0) // answers stream: the copy wins as its answer begins
	j := f.job("abort-after-win")
	first := j.t.ServedBy()
	entered, won, aborted := make(chan struct{}), make(chan struct{}), make(chan struct{})
	f.serve(first, hangs(entered))
	f.serve(f.other(first), func(w http.ResponseWriter, r *http.Request) error {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write([]byte(imageAnswer[:10]))
		close(won)
		<-aborted
		if err := r.Context().Err(); err != nil {
			return err // as reverse_proxy ends an answer whose request ended
		}
		_, err := w.Write([]byte(imageAnswer[10:]))
		return err
	})
	f.overrun(entered)
	go func() {
		<-won
		f.pool.Abort(scheduler.Abort{RID: "abort-after-win", By: "test"})
		close(aborted)
	}()

	if err := f.runJob(j); err != nil {
		t.Fatal(err)
	}
	expectAnswer(t, j, http.StatusOK, imageAnswer)
	if cause := j.t.Cancelled(); cause != nil {
		t.Fatalf("the job answered by its copy reads as cancelled: %v", cause)
	}
	if info, _ := f.pool.Worker(f.other(first)); info.Inflight != 0 {
		t.Fatalf("the copy's worker holds %d jobs; want 0", info.Inflight)
	}
}

// A copy that fails leaves the job on the worker it was to overtake,
// which may hang for good: the job gets another copy, on a worker that
// has not failed it, while max_attempts leaves room. Here the only other
// worker fails the first copy, and the second goes to a worker that
// joined meanwhile.
func TestAFailedCopyIsFollowedByAnother(t *testing.T) {
	f := hedged(t, 2)
	j := f.job("copy-fails")
	hung := j.t.ServedBy()
	failing, good := f.other(hung), "http://10.0.0.9:30000"
	entered, failed := make(chan struct{}), make(chan struct{})
	f.serve(hung, hangs(entered))
	copies := 0
	f.serve(failing, func(w http.ResponseWriter, r *http.Request) error {
		copies++
		defer close(failed)
		return answers(http.StatusBadGateway, `{"error":"upstream"}`)(w, r)
	})
	f.serve(good, answers(http.StatusOK, imageAnswer))
	f.overrun(entered)
	f.joinOnce(failed, good)

	if err := f.runJob(j); err != nil {
		t.Fatal(err)
	}
	expectAnswer(t, j, http.StatusOK, imageAnswer)
	if j.t.ServedBy() != good || copies != 1 {
		t.Fatalf("answered by %s, the failing worker ran %d copies; want the good worker, and 1", j.t.ServedBy(), copies)
	}
	expectCount(t, f.run.Metrics.Hedges, "launched", 2)
}

// A copy that hangs in its turn gets a copy of its own while max_attempts
// leaves room: here the job's worker and its first copy's never answer,
// and the second copy goes to a worker that joined meanwhile.
func TestACopyThatHangsGetsACopyOfItsOwn(t *testing.T) {
	f := hedged(t, 2)
	j := f.job("copy-hangs")
	hung := j.t.ServedBy()
	hungToo, good := f.other(hung), "http://10.0.0.9:30000"
	entered, copied := make(chan struct{}), make(chan struct{})
	f.serve(hung, hangs(entered))
	f.serve(hungToo, hangs(copied))
	f.serve(good, answers(http.StatusOK, imageAnswer))
	f.overrun(entered)
	f.joinOnce(copied, good)

	if err := f.runJob(j); err != nil {
		t.Fatal(err)
	}
	expectAnswer(t, j, http.StatusOK, imageAnswer)
	if j.t.ServedBy() != good {
		t.Fatalf("answered by %s; want the worker that joined", j.t.ServedBy())
	}
}

// Aborting a job ends its copies too: here the job's worker and its
// copy's both hang, and the job ends at the abort, its cause the abort's,
// rather than waiting for a copy that never ends.
func TestAbortEndsTheCopiesOfAJob(t *testing.T) {
	f := hedged(t, 2)
	j := f.job("abort-copies")
	hung := j.t.ServedBy()
	entered, copied := make(chan struct{}), make(chan struct{})
	f.serve(hung, hangs(entered))
	f.serve(f.other(hung), hangs(copied))
	f.overrun(entered)
	go func() {
		<-copied
		f.pool.Abort(scheduler.Abort{RID: "abort-copies", By: "test"})
	}()

	_ = f.runJob(j) // the attempt ended with its context's error
	if j.rec.Status() != 0 {
		t.Fatalf("%d written; want nothing, for the caller to answer with the abort", j.rec.Status())
	}
	if _, aborted := j.t.Cancelled().(*scheduler.AbortedError); !aborted {
		t.Fatalf("the job's cause: %v; want the abort", j.t.Cancelled())
	}
}
