package diffusionrouter

import (
	"testing"
)

// poolOf returns a pool with workers a:1, b:1, ... and their upstreams.
func poolOf(t *testing.T, n int) (*Pool, []string) {
	t.Helper()
	p := newPool(t.Name())
	var dials, urls []string
	for i := range n {
		host := string(rune('a' + i))
		urls = append(urls, "http://"+host+":1")
		dials = append(dials, host+":1")
	}
	p.declare(urls)
	return p, dials
}

// choose acquires a worker for a new job ticket and returns its dial address.
func choose(p *Pool, s strategy, dials []string) (*ticket, string) {
	t := &ticket{pool: p, strategy: s, job: true}
	u := p.acquire(t, upstreamsFor(dials...))
	if u == nil {
		return t, ""
	}
	return t, u.Dial
}

func TestLeastRequestPicksLeastLoaded(t *testing.T) {
	p, dials := poolOf(t, 3)
	var held []*ticket
	counts := map[string]int{}
	for range 9 {
		tk, d := choose(p, leastRequest{}, dials)
		counts[d]++
		held = append(held, tk)
	}
	for _, d := range dials {
		if counts[d] != 3 {
			t.Fatalf("9 concurrent jobs on 3 workers gave %v; want 3 each", counts)
		}
	}
	// Free two slots on b: the next two jobs must go there.
	for _, tk := range held {
		if tk.servedBy == "http://b:1" && p.byDial["b:1"].inflight > 1 {
			p.release(tk, true)
		}
	}
	for range 2 {
		if _, d := choose(p, leastRequest{}, dials); d != "b:1" {
			t.Fatalf("job went to %s; want b:1, the least loaded", d)
		}
	}
}

func TestLeastRequestSpreadsTies(t *testing.T) {
	p, dials := poolOf(t, 4)
	seen := map[string]bool{}
	for range 200 {
		tk, d := choose(p, leastRequest{}, dials)
		seen[d] = true
		p.release(tk, true)
	}
	if len(seen) != 4 {
		t.Fatalf("idle workers chosen: %v; want all 4 to share ties", seen)
	}
}

func TestRoundRobinCycles(t *testing.T) {
	p, dials := poolOf(t, 3)
	var got []string
	for range 6 {
		tk, d := choose(p, roundRobin{}, dials)
		got = append(got, d)
		p.release(tk, true)
	}
	for i := range 3 {
		if got[i] != got[i+3] || got[i] == got[(i+1)%3] {
			t.Fatalf("round robin order %v does not cycle through 3 workers", got)
		}
	}
}

func TestRandomUsesEveryWorker(t *testing.T) {
	p, dials := poolOf(t, 3)
	seen := map[string]int{}
	for range 300 {
		tk, d := choose(p, randomPick{}, dials)
		seen[d]++
		p.release(tk, true)
	}
	if len(seen) != 3 {
		t.Fatalf("random picked %v", seen)
	}
}

func TestSelectSkipsWorkersThatMayNotServe(t *testing.T) {
	p, dials := poolOf(t, 3)
	p.setDead("http://a:1", true)
	p.setCapabilities("http://b:1", []string{"T2I"})
	p.setCapabilities("http://c:1", []string{"T2V"})

	video := &ticket{pool: p, strategy: leastRequest{}, task: videoTask, job: true}
	for range 5 {
		if u := p.acquire(video, upstreamsFor(dials...)); u == nil || u.Dial != "c:1" {
			t.Fatalf("video job went to %v; want c:1, the only serving video worker", u)
		}
		p.release(video, true)
	}
	image := &ticket{pool: p, strategy: leastRequest{}, task: imageTask, job: true}
	for range 5 {
		if u := p.acquire(image, upstreamsFor(dials...)); u == nil || u.Dial != "b:1" {
			t.Fatalf("image job went to %v; want b:1, the only serving image worker", u)
		}
		p.release(image, true)
	}
	pinned := &ticket{pool: p, strategy: leastRequest{}, pin: "http://b:1"}
	if u := p.acquire(pinned, upstreamsFor(dials...)); u == nil || u.Dial != "b:1" {
		t.Fatalf("pinned request went to %v; want b:1", u)
	}
	if p.byDial["b:1"].inflight != 0 {
		t.Fatal("a video poll was counted as a job in flight")
	}
	p.release(pinned, true)

	deadPin := &ticket{pool: p, strategy: leastRequest{}, pin: "http://a:1"}
	if u := p.acquire(deadPin, upstreamsFor(dials...)); u != nil {
		t.Fatalf("request pinned to a dead worker was sent to %s", u.Dial)
	}
}

func TestRetryAvoidsFailedWorker(t *testing.T) {
	p, dials := poolOf(t, 2)
	tk, first := choose(p, leastRequest{}, dials)
	// reverse_proxy calls Select again after a failed connection.
	second := p.acquire(tk, upstreamsFor(dials...))
	if second == nil || second.Dial == first {
		t.Fatalf("retry went to %v after %s failed", second, first)
	}
	if third := p.acquire(tk, upstreamsFor(dials...)); third != nil {
		t.Fatalf("retry went back to %s; every worker has failed", third.Dial)
	}
	for _, d := range dials {
		w := p.byDial[d]
		if w.inflight != 0 || w.failures != 1 || w.consecFails != 1 {
			t.Fatalf("%s: inflight=%d failures=%d consecutive=%d; want 0, 1, 1", d, w.inflight, w.failures, w.consecFails)
		}
	}
	p.release(tk, true) // nothing held: a no-op
}

func TestSelectWithoutTicketUsesPool(t *testing.T) {
	p, dials := poolOf(t, 2)
	s := &Selector{poolRef{pool: p}}
	r := newRequest(t)
	if u := s.Select(upstreamsFor(dials...), r, nil); u == nil {
		t.Fatal("no worker chosen for a request without a ticket")
	}
	for _, d := range dials {
		if p.byDial[d].inflight != 0 {
			t.Fatal("a request without a ticket was counted; nothing would release it")
		}
	}
}
