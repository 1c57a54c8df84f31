package fleet

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
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

// A router that no longer leads its group calls no worker: a catch-up
// started while it led gives up once it may no longer call.
func TestCatchUpCallsNoWorkerOnceTheRouterNoLongerLeads(t *testing.T) {
	for _, leads := range []bool{true, false} {
		var calls atomic.Int32
		worker := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			calls.Add(1)
			_, _ = w.Write([]byte(`{"success":true,"message":"ok"}`))
		}))
		p := scheduler.New(t.Name(), zap.NewNop())
		core, logs := observer.New(zap.InfoLevel)
		f := New(p, zap.New(core))
		f.OnlyWhile(func() bool { return leads })
		u := scheduler.Update{Path: scheduler.DiskUpdatePath, Version: "step-1", Mode: scheduler.ModeDrain, Body: []byte(`{"model_path":"/ckpt/1"}`)}
		p.Register("http://10.0.0.1:1", 10)
		p.BeginUpdate(u)
		p.FinishUpdate("http://10.0.0.1:1", "step-1", true, true)
		p.EndUpdate(u, true)
		p.Register(worker.URL, 10) // joins after the update: behind
		f.StartCatchUps(&Config{Timeout: 10 * time.Second})
		settled := func() bool { return calls.Load() == 1 }
		if !leads {
			settled = func() bool { return logs.FilterMessageSnippet("catch-up not run").Len() == 1 }
		}
		if !testkit.WaitUntil(10*time.Second, settled) {
			t.Fatalf("leading %v: the catch-up neither called the worker nor gave up", leads)
		}
		_ = p.Close() // waits for the catch-up
		worker.Close()
		if want := map[bool]int32{true: 1, false: 0}[leads]; calls.Load() != want {
			t.Errorf("leading %v: the catch-up called the worker %d times; want %d", leads, calls.Load(), want)
		}
	}
}
