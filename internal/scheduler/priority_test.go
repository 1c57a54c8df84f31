package scheduler

import (
	"context"
	"testing"
	"time"
)

// enqueueAt queues a job of priority prio behind p's busy workers; its
// result arrives on the channel.
func enqueueAt(t *testing.T, p *Pool, cfg *Config, prio int) (*Ticket, chan error) {
	t.Helper()
	tk := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 1, Priority: prio}}
	done := make(chan error, 1)
	n := queued(p)
	go func() { done <- p.Acquire(context.Background(), tk) }()
	waitQueued(t, p, n+1)
	return tk, done
}

// served releases running and reports which of the waiting jobs got its
// worker.
func served(t *testing.T, p *Pool, running *Ticket, waiting map[string]chan error) string {
	t.Helper()
	p.Release(running, End{Worker: Succeeded})
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		for name, done := range waiting {
			select {
			case err := <-done:
				if err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				delete(waiting, name)
				return name
			default:
			}
		}
	}
	t.Fatal("no waiting job got the worker")
	return ""
}

func TestHigherPriorityGoesFirstThenQueueOrder(t *testing.T) {
	p, _ := poolOf(t, 1)
	cfg := config(LeastWork{}, 1)
	running, _ := choose(t, p, cfg, 1)
	tickets := map[string]*Ticket{}
	waiting := map[string]chan error{}
	for _, j := range []struct {
		name string
		prio int
	}{{"batch-1", 0}, {"batch-2", 0}, {"urgent-1", 5}, {"low", -3}, {"urgent-2", 5}} {
		tickets[j.name], waiting[j.name] = enqueueAt(t, p, cfg, j.prio)
	}
	var order []string
	for len(waiting) > 0 {
		name := served(t, p, running, waiting)
		order = append(order, name)
		running = tickets[name]
	}
	want := []string{"urgent-1", "urgent-2", "batch-1", "batch-2", "low"}
	for i := range want {
		if order[i] != want[i] {
			t.Fatalf("served %v; want %v", order, want)
		}
	}
}

func TestAJobPassedOverForTooLongGoesNext(t *testing.T) {
	p, clock := poolOf(t, 1)
	cfg := config(LeastWork{}, 1)
	cfg.MaxPassedOver = 10 * time.Second
	running, _ := choose(t, p, cfg, 1)
	tickets := map[string]*Ticket{}
	waiting := map[string]chan error{}
	tickets["low"], waiting["low"] = enqueueAt(t, p, cfg, 0)
	tickets["urgent-1"], waiting["urgent-1"] = enqueueAt(t, p, cfg, 1)
	clock.advance(5 * time.Second)
	if got := served(t, p, running, waiting); got != "urgent-1" {
		t.Fatalf("after 5 s %s was served; want urgent-1: low has not waited 10 s", got)
	}
	tickets["urgent-2"], waiting["urgent-2"] = enqueueAt(t, p, cfg, 1)
	clock.advance(5 * time.Second)
	if got := served(t, p, tickets["urgent-1"], waiting); got != "low" {
		t.Fatalf("after 10 s %s was served; want low, passed over for 10 s", got)
	}
	if got := served(t, p, tickets["low"], waiting); got != "urgent-2" {
		t.Fatalf("then %s was served; want urgent-2", got)
	}
}

func TestWithoutALimitLowPriorityWaitsForHigher(t *testing.T) {
	p, clock := poolOf(t, 1)
	cfg := config(LeastWork{}, 1)
	running, _ := choose(t, p, cfg, 1)
	waiting := map[string]chan error{}
	_, waiting["low"] = enqueueAt(t, p, cfg, 0)
	_, waiting["urgent"] = enqueueAt(t, p, cfg, 1)
	clock.advance(time.Hour)
	if got := served(t, p, running, waiting); got != "urgent" {
		t.Fatalf("%s was served; want urgent: MaxPassedOver 0 sets no limit", got)
	}
}
