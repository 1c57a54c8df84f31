package diffusionrouter_test

import (
	"net/url"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// TestExternalProxyWithoutTicket runs the long form: diffusion_router with
// `reverse_proxy external`, then the site's own reverse_proxy wired to the
// pool. Requests under /direct/ skip the router's handler, so they reach
// the proxy with no ticket: the upstream source offers every serving
// worker and the selection policy picks one of them at random.
func TestExternalProxyWithoutTicket(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a"}, fakeworker.Config{Name: "b"}, fakeworker.Config{Name: "c"})
	r := testrouter.Start(t, `route {
	@routed not path /direct/*
	diffusion_router @routed external-pool {
		workers `+testrouter.URLs(ws)+`
		reverse_proxy external
	}
	uri strip_prefix /direct
	reverse_proxy {
		dynamic diffusion external-pool
		lb_policy diffusion external-pool
	}
}`)

	// directly sends n image requests past the handler and counts them by
	// the worker that served them.
	directly := func(n int) map[string]int {
		t.Helper()
		served := map[string]int{}
		for range n {
			rp := r.Post("/direct/v1/images/generations", testrouter.SmallImage)
			testrouter.ExpectStatus(t, "generation without a ticket", rp, 200)
			if data, _ := rp.JSON(t)["data"].([]any); len(data) != 1 {
				t.Fatalf("generation without a ticket answered %.200s", rp.Body)
			}
			served[rp.Header.Get("X-Fake-Worker")]++
		}
		return served
	}

	// A request through the handler still gets its worker from the pool.
	rp := r.Post("/v1/images/generations", testrouter.SmallImage)
	testrouter.ExpectStatus(t, "generation through the router", rp, 200)
	if w := rp.Header.Get("X-Fake-Worker"); w != "a" && w != "b" && w != "c" {
		t.Fatalf("generation through the router served by %q", w)
	}

	// Random among three: each of 60 requests misses a given worker with
	// probability 2/3, so that one gets none with probability 2e-11.
	served := directly(60)
	if served["a"] == 0 || served["b"] == 0 || served["c"] == 0 || len(served) != 3 {
		t.Fatalf("60 requests without a ticket were served %v; want some by each of a, b and c", served)
	}
	jobs := func() map[string]any {
		out := map[string]any{}
		for u, w := range r.Workers() {
			out[u] = w["active_requests"]
		}
		return out
	}
	for u, n := range jobs() {
		if n != 0.0 {
			t.Fatalf("%s shows %v active requests after requests without a ticket ended", u, n)
		}
	}

	// A worker marked dead gets none.
	mark := func(i int, dead bool) {
		t.Helper()
		body := `{"is_dead":false}`
		if dead {
			body = `{"is_dead":true}`
		}
		rp := testrouter.Do(t, "PUT", r.Base+"/workers/"+url.QueryEscape(ws[i].URL()), strings.NewReader(body))
		testrouter.ExpectStatus(t, "mark "+ws[i].URL()+" "+body, rp, 200)
	}
	mark(1, true)
	bJobs := ws[1].Stats().Jobs
	served = directly(40)
	if served["b"] != 0 || served["a"] == 0 || served["c"] == 0 || len(served) != 2 {
		t.Fatalf("with b dead, 40 requests without a ticket were served %v; want some by each of a and c, none by b", served)
	}
	if n := ws[1].Stats().Jobs; n != bJobs {
		t.Fatalf("the dead worker b ran %d jobs", n-bJobs)
	}

	// With no worker serving, the proxy has no upstream: 503.
	mark(0, true)
	mark(2, true)
	before := ws[0].Stats().Jobs + ws[1].Stats().Jobs + ws[2].Stats().Jobs
	rp = r.Post("/direct/v1/images/generations", testrouter.SmallImage)
	testrouter.ExpectStatus(t, "generation without a ticket, every worker dead", rp, 503)
	if after := ws[0].Stats().Jobs + ws[1].Stats().Jobs + ws[2].Stats().Jobs; after != before {
		t.Fatal("a dead worker was sent a job")
	}

	// Brought back, a worker serves again.
	mark(1, false)
	if served := directly(5); served["b"] != 5 {
		t.Fatalf("with only b serving, 5 requests were served %v", served)
	}
}
