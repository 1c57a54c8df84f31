package testrouter

import (
	"fmt"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
)

// StartWorkers starts fake sglang-diffusion workers on free ports of
// 127.0.0.1 that stop when the test ends. A config without UnitMs gets 1, so
// that jobs take milliseconds.
func StartWorkers(t testing.TB, cfgs ...fakeworker.Config) []*fakeworker.Worker {
	t.Helper()
	workers := make([]*fakeworker.Worker, len(cfgs))
	for i, c := range cfgs {
		if c.UnitMs == 0 {
			c.UnitMs = 1
		}
		w, err := fakeworker.Start(c)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(w.Close)
		workers[i] = w
	}
	return workers
}

// URLs joins the workers' base URLs with spaces, as a Caddyfile's workers
// line lists them.
func URLs(workers []*fakeworker.Worker) string {
	urls := make([]string, len(workers))
	for i, w := range workers {
		urls[i] = w.URL()
	}
	return strings.Join(urls, " ")
}

// Member is one fake worker of a fleet.
type Member struct {
	Name  string
	Speed float64
	*fakeworker.Worker
}

// Fleet is fake workers, in the order of their speeds, for programs that
// run without a testing.T; tests use StartWorkers.
type Fleet []Member

// StartFleet starts one fake worker per speed on a free port of 127.0.0.1,
// named w1, w2, ... A job of cost c keeps a worker busy for
// c × unitMs / speed milliseconds.
func StartFleet(speeds []float64, unitMs float64) (Fleet, error) {
	var f Fleet
	for i, s := range speeds {
		name := fmt.Sprintf("w%d", i+1)
		w, err := fakeworker.Start(fakeworker.Config{Name: name, Speed: s, UnitMs: unitMs})
		if err != nil {
			f.Close()
			return nil, err
		}
		f = append(f, Member{name, s, w})
	}
	return f, nil
}

// URLs returns the workers' base URLs, in fleet order.
func (f Fleet) URLs() []string {
	urls := make([]string, len(f))
	for i, w := range f {
		urls[i] = w.URL()
	}
	return urls
}

// Stats returns each worker's counters, in fleet order.
func (f Fleet) Stats() []fakeworker.Stats {
	out := make([]fakeworker.Stats, len(f))
	for i, w := range f {
		out[i] = w.Stats()
	}
	return out
}

// Restart starts a fresh worker with m's config on m's address, as a
// supervisor starts a dead worker process again: the same URL, none of the
// old worker's state. It closes m's worker first, if that is still open.
func (m Member) Restart() (Member, error) {
	m.Close()
	cfg := m.Config()
	cfg.Addr = strings.TrimPrefix(m.URL(), "http://")
	w, err := fakeworker.Start(cfg)
	if err != nil {
		return m, err
	}
	m.Worker = w
	return m, nil
}

// Close stops every worker.
func (f Fleet) Close() {
	for _, w := range f {
		w.Close()
	}
}
