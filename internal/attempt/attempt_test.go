package attempt

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// A job its worker answers 502 runs again on another worker; the client
// gets that worker's answer alone, and neither worker stays claimed.
func TestABadGatewayRunsTheJobAgainElsewhere(t *testing.T) {
	f := newFleet(t, 2)
	j := f.job("bad-gateway")
	first := j.t.ServedBy()
	f.serve(first, answers(http.StatusBadGateway, `{"error":"upstream"}`))
	f.serve(f.other(first), answers(http.StatusOK, imageAnswer))

	if err := f.runJob(j); err != nil {
		t.Fatal(err)
	}
	expectAnswer(t, j, http.StatusOK, imageAnswer)
	if j.t.ServedBy() == first || j.rec.Attempts() != 2 {
		t.Fatalf("served by %s in %d attempts; want the other worker, in 2", j.t.ServedBy(), j.rec.Attempts())
	}
	expectCount(t, f.run.Metrics.Reruns, "status", 1)
	f.expectIdle()
}

// A 2xx answer that breaks off while it is held reached no client: the
// job runs again, and the worker that broke it is counted as failed.
func TestAnAnswerCutShortRunsAgain(t *testing.T) {
	f := newFleet(t, 2)
	j := f.job("cut-short")
	first := j.t.ServedBy()
	f.serve(first, breaksOff)
	f.serve(f.other(first), answers(http.StatusOK, imageAnswer))

	if err := f.runJob(j); err != nil {
		t.Fatal(err)
	}
	expectAnswer(t, j, http.StatusOK, imageAnswer)
	expectCount(t, f.run.Metrics.Reruns, "cut_short", 1)
	expectCount(t, f.run.Metrics.Broken, "held", 1)
	if info, _ := f.pool.Worker(first); info.Failures != 1 {
		t.Fatalf("the worker that broke its answer has %d failures; want 1", info.Failures)
	}
	f.expectIdle()
}

// An answer held back that stops coming ends its attempt once the clock
// passes the stall bound, and the job runs on another worker.
func TestAStalledAnswerRunsAgainElsewhere(t *testing.T) {
	f := newFleet(t, 2)
	j := f.job("stalled")
	first := j.t.ServedBy()
	wrote := make(chan struct{})
	f.serve(first, stalls(wrote))
	f.serve(f.other(first), answers(http.StatusOK, imageAnswer))

	f.runPastStall(j, wrote)
	expectCount(t, f.run.Metrics.Reruns, "stalled", 1)
	f.expectIdle()
}

// A job whose answer stalled on a worker never goes back to it, though
// the answer's start had freed that worker's slot: when the only other
// worker then answers 500, the job's third attempt runs there again.
func TestAJobNeverReturnsToAWorkerThatStalledOnIt(t *testing.T) {
	f := newFleet(t, 2)
	j := f.job("stalled-then-500")
	stalled := j.t.ServedBy()
	other := f.other(stalled)
	wrote := make(chan struct{})
	f.serve(stalled, firstThen(stalls(wrote), answers(http.StatusOK, imageAnswer)))
	f.serve(other, firstThen(answers(http.StatusInternalServerError, `{"error":"CUDA error"}`), answers(http.StatusOK, imageAnswer)))

	f.runPastStall(j, wrote)
	if got := j.t.ServedBy(); got != other {
		t.Errorf("the job's last attempt ran on %s; want %s, not the worker that stalled on it", got, other)
	}
	expectCount(t, f.run.Metrics.Reruns, "stalled", 1)
	expectCount(t, f.run.Metrics.Reruns, "status", 1)
	f.expectIdle()
}

// An answer that keeps coming never stalls, however long it takes in all:
// each byte starts answer_stall_timeout again.
func TestAnAnswerThatKeepsComingNeverStalls(t *testing.T) {
	f := newFleet(t, 1)
	j := f.job("slow-answer")
	pieces := []string{imageAnswer[:10], imageAnswer[10:20], imageAnswer[20:]}
	wrote, advanced := make(chan struct{}), make(chan struct{})
	f.serve(j.t.ServedBy(), func(w http.ResponseWriter, r *http.Request) error {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(imageAnswer)))
		w.WriteHeader(http.StatusOK)
		for _, p := range pieces {
			if _, err := w.Write([]byte(p)); err != nil {
				return err
			}
			wrote <- struct{}{}
			<-advanced
			if err := r.Context().Err(); err != nil {
				return err
			}
		}
		return nil
	})
	go func() {
		for range pieces {
			<-wrote
			f.clock.Advance(f.run.StallTimeout * 2 / 3) // twice the bound in all
			advanced <- struct{}{}
		}
	}()

	if err := f.runJob(j); err != nil {
		t.Fatal(err)
	}
	expectAnswer(t, j, http.StatusOK, imageAnswer)
	expectCount(t, f.run.Metrics.Reruns, "stalled", 0)
}

// A job whose only worker stalls gets a 504 that says so: it never goes
// back to the worker that stalled.
func TestAStalledAnswerWithNoOtherWorkerIsA504(t *testing.T) {
	f := newFleet(t, 1)
	j := f.job("stalled-alone")
	wrote := make(chan struct{})
	f.serve(j.t.ServedBy(), stalls(wrote))
	go func() {
		<-wrote
		f.clock.Advance(f.run.StallTimeout)
	}()

	if err := f.runJob(j); err != nil {
		t.Fatal(err)
	}
	if j.client.Code != http.StatusGatewayTimeout || !strings.Contains(j.client.Body.String(), "stalled") || j.rec.Attempts() != 1 {
		t.Fatalf("client got %d %s after %d attempts; want a 504 that says the answer stalled, after 1", j.client.Code, j.client.Body, j.rec.Attempts())
	}
	f.expectIdle()
}

// A job that every worker answers asleep ends with ErrAsleep and nothing
// written, for the caller to answer 503.
func TestAJobEveryWorkerSleepsThroughEndsAsleep(t *testing.T) {
	f := newFleet(t, 2)
	j := f.job("asleep")
	for _, u := range f.urls {
		f.serve(u, answers(http.StatusInternalServerError, `{"message":"`+string(asleepMessage)+`"}`))
	}

	if err := f.runJob(j); !errors.Is(err, scheduler.ErrAsleep) || j.rec.Status() != 0 {
		t.Fatalf("Run: %v with %d written; want ErrAsleep and nothing", err, j.rec.Status())
	}
	f.expectIdle()
}

// A job whose first worker could not be reached runs on another; one
// whose every attempt fails so ends with the proxy's error, nothing
// written, after max_attempts workers.
func TestUnreachableWorkersUseUpMaxAttempts(t *testing.T) {
	f := newFleet(t, 3)
	j := f.job("unreachable")
	for _, u := range f.urls {
		f.serve(u, func(http.ResponseWriter, *http.Request) error { return errDial })
	}

	if err := f.runJob(j); !errors.Is(err, errDial) || j.rec.Status() != 0 {
		t.Fatalf("Run: %v with %d written; want the dial error and nothing", err, j.rec.Status())
	}
	if j.rec.Attempts() != f.cfg.MaxAttempts {
		t.Fatalf("%d attempts; want max_attempts, %d", j.rec.Attempts(), f.cfg.MaxAttempts)
	}
	f.expectIdle()
}

// An attempt that outlives upstream_timeout ends with ErrUpstreamTimeout,
// which runs no job again: the next worker would take as long.
func TestUpstreamTimeoutEndsTheJob(t *testing.T) {
	f := newFleet(t, 2)
	f.run.UpstreamTimeout = time.Millisecond
	j := f.job("timeout")
	for _, u := range f.urls {
		f.serve(u, hangs(nil))
	}

	if err := f.runJob(j); !errors.Is(err, ErrUpstreamTimeout) || j.rec.Attempts() != 1 {
		t.Fatalf("Run: %v after %d attempts; want ErrUpstreamTimeout after 1", err, j.rec.Attempts())
	}
	f.expectIdle()
}

// What an attempt's end says of its worker decides how an ejection it
// caused ends: a worker that could not be reached, or that closed the
// connection before any byte of an answer, was down, and its passed
// probes let it back (health_passes 1 here); one that answered badly (a
// 5xx, an answer malformed or cut short, none in time) stays out while
// its probes pass. So whether the job runs again or not.
func TestOnlyAWorkerThatWasDownIsLetBackByItsProbes(t *testing.T) {
	reset := &net.OpError{Op: "read", Net: "tcp", Err: os.NewSyscallError("read", syscall.ECONNRESET)}
	timeout := &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}
	for _, c := range []struct {
		name   string
		worker worker
		down   bool
	}{
		{"refused", fails(errDial), true},
		{"closed before answering", fails(io.EOF), true},
		{"reset before answering", fails(reset), true},
		{"answered 502", answers(http.StatusBadGateway, `{"error":"upstream"}`), false},
		{"answer malformed", fails(io.ErrUnexpectedEOF), false},
		{"no answer in time", fails(timeout), false},
		{"answer cut short", breaksOff, false},
	} {
		for _, maxAttempts := range []int{1, 2} {
			t.Run(fmt.Sprintf("%s, max_attempts %d", c.name, maxAttempts), func(t *testing.T) {
				f := newFleet(t, 2)
				f.cfg.MaxAttempts = maxAttempts
				f.cfg.Health = &scheduler.HealthConfig{Timeout: time.Second, StallFactor: 5, Passes: 1,
					MaxFails: 1, FailWindow: time.Minute, EjectTime: time.Minute, MaxEjectTime: time.Minute, MaxEjectionPercent: 100}
				j := f.job(c.name)
				first := j.t.ServedBy()
				f.serve(first, c.worker)
				f.serve(f.other(first), answers(http.StatusOK, imageAnswer))
				_ = f.runJob(j)
				if info, _ := f.pool.Worker(first); info.State != scheduler.Ejected {
					t.Fatalf("the worker that failed the job is %v; want ejected", info.State)
				}
				back := f.pool.RecordProbe(first, nil, f.cfg.Health) == scheduler.BackUp
				if info, _ := f.pool.Worker(first); back != c.down || (info.State == scheduler.Ejected) == c.down {
					t.Fatalf("after a passed probe the worker is %v (back up: %v); want it back only if it was down (%v)", info.State, back, c.down)
				}
				f.expectIdle()
			})
		}
	}
}

// fails is a worker whose attempts end with the proxy's error err,
// nothing answered.
func fails(err error) worker {
	return func(http.ResponseWriter, *http.Request) error { return err }
}

// breaksOff is a worker whose 200 breaks off after its first bytes.
func breaksOff(w http.ResponseWriter, _ *http.Request) error {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(imageAnswer)))
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write([]byte(imageAnswer[:10]))
	panic(http.ErrAbortHandler) // as reverse_proxy aborts an answer that broke off
}
