package diffusionrouter_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// tenantSite is a router over ws whose jobs name their tenant in
// X-Tenant, with /metrics beside it; its tests hold a job on the worker
// (see heldSpeed).
func tenantSite(ws []*fakeworker.Worker, extra string) string {
	return testrouter.MetricsSite("diffusion_router tenant-pool {\n workers " + testrouter.URLs(ws) +
		"\n tenant {http.request.header.X-Tenant}\n" + heldSpeed + extra + "}")
}

// tenantAnswer is what one job's client got.
type tenantAnswer struct {
	tenant string
	steps  int // its cost, in units: a 1024x1024 image of that many steps
	status int
	body   string
}

// sendTenantJob sends a 1024x1024 image job of steps steps for tenant and
// reports what its client got.
func sendTenantJob(r *testrouter.Router, tenant string, steps int, done chan<- tenantAnswer) {
	a := tenantAnswer{tenant: tenant, steps: steps}
	a.status, a.body = postImage(r, steps, "X-Tenant", tenant)
	done <- a
}

func TestTenantsShareTheWorkerByCostNotRequests(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{UnitMs: 20})
	r := testrouter.Start(t, tenantSite(ws, ""))
	pool := map[string]string{"pool": "tenant-pool"}
	done := make(chan tenantAnswer, 64)
	release := ws[0].Hold()
	t.Cleanup(release)
	go sendTenantJob(r, "warmup", 1, done) // holds the worker while the others queue
	testrouter.WaitFor(t, func() bool { return testrouter.Value(t, r, "caddy_diffusion_worker_inflight_jobs", pool) > 0 })
	for range 30 {
		go sendTenantJob(r, "many-small", 1, done)
	}
	for range 6 {
		go sendTenantJob(r, "few-large", 5, done)
	}
	testrouter.WaitFor(t, func() bool { return testrouter.Value(t, r, "caddy_diffusion_queue_length", pool) >= 36 })
	release()
	work := map[string]int{}
	var order []string
	for range 37 {
		a := <-done
		if a.status != 200 {
			t.Fatalf("%s's job: %d %s", a.tenant, a.status, a.body)
		}
		if a.tenant == "warmup" {
			continue
		}
		order = append(order, fmt.Sprintf("%s:%d", a.tenant, a.steps))
		if work["many-small"]+work["few-large"] < 30 { // the first half of the work
			work[a.tenant] += a.steps
		}
	}
	t.Logf("in the first half of the work: many-small %d units, few-large %d", work["many-small"], work["few-large"])
	if s, l := work["many-small"], work["few-large"]; s < 10 || l < 10 {
		t.Fatalf("in the first half of the work many-small got %d units and few-large %d; want 15 each, within a large job (order %v)", s, l, order)
	}
}

func TestTenantMaxQueueRefusesOnlyThatTenant(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{UnitMs: 20})
	r := testrouter.Start(t, tenantSite(ws, "tenant_max_queue 2\n"))
	pool := map[string]string{"pool": "tenant-pool"}
	done := make(chan tenantAnswer, 8)
	release := ws[0].Hold()
	t.Cleanup(release)
	go sendTenantJob(r, "a", 1, done) // holds the worker
	testrouter.WaitFor(t, func() bool { return testrouter.Value(t, r, "caddy_diffusion_worker_inflight_jobs", pool) > 0 })
	go sendTenantJob(r, "a", 1, done)
	go sendTenantJob(r, "a", 1, done)
	testrouter.WaitFor(t, func() bool { return testrouter.Value(t, r, "caddy_diffusion_queue_length", pool) >= 2 })
	go sendTenantJob(r, "a", 1, done)
	refused := <-done
	if refused.status != 429 || !strings.Contains(refused.body, `tenant \"a\"`) || !strings.Contains(refused.body, "tenant_max_queue") {
		t.Fatalf("a's third waiting job got %d %s; want 429 naming tenant a and tenant_max_queue", refused.status, refused.body)
	}
	go sendTenantJob(r, "b", 1, done)
	testrouter.WaitFor(t, func() bool { return testrouter.Value(t, r, "caddy_diffusion_queue_length", pool) >= 3 })
	release()
	for range 4 {
		if a := <-done; a.status != 200 {
			t.Fatalf("%s's job got %d %s; want 200: b is under its own limit, a's first three were admitted", a.tenant, a.status, a.body)
		}
	}
}

func TestBadTenantNamesAreRefused(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{})
	r := testrouter.Start(t, tenantSite(ws, ""))
	job := `{"response_format":"b64_json","prompt":"x","size":"8x8"}`
	for _, bad := range []string{"a b", "a/b", "é", strings.Repeat("x", 65), "a\"b"} {
		rp := r.Post("/v1/images/generations", job, "X-Tenant", bad)
		testrouter.ExpectStatus(t, "tenant "+bad, rp, 400)
		if msg := rp.ErrorText(t); !strings.Contains(msg, "not a tenant name") || !strings.Contains(msg, "A-Z a-z 0-9 . _ -") {
			t.Errorf("tenant %q: error %q does not give the rule of tenant names", bad, msg)
		}
	}
	for _, ok := range []string{"", "team-1", "eval.run_7", strings.Repeat("x", 64)} {
		rp := r.Post("/v1/images/generations", job, "X-Tenant", ok)
		testrouter.ExpectStatus(t, fmt.Sprintf("tenant %q", ok), rp, 200)
	}
	if n := ws[0].Stats().Jobs; n != 4 {
		t.Errorf("the worker served %d jobs; want the 4 with a valid tenant", n)
	}
}

func TestTenantsBeyondMaxTenantsShareOther(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{UnitMs: 20})
	r := testrouter.Start(t, tenantSite(ws, "max_tenants 2\n"))
	pool := map[string]string{"pool": "tenant-pool"}
	done := make(chan tenantAnswer, 16)
	release := ws[0].Hold()
	t.Cleanup(release)
	go sendTenantJob(r, "t0", 1, done) // holds the worker
	testrouter.WaitFor(t, func() bool { return testrouter.Value(t, r, "caddy_diffusion_worker_inflight_jobs", pool) > 0 })
	for i := range 10 {
		go sendTenantJob(r, fmt.Sprint("t", i), 1, done)
	}
	testrouter.WaitFor(t, func() bool { return testrouter.Value(t, r, "caddy_diffusion_queue_length", pool) >= 10 })
	labels := map[string]float64{}
	for _, m := range testrouter.Scrape(t, r, "caddy_diffusion_tenant_queue_length") {
		labels[m.Labels["tenant"]] += m.Value
	}
	if len(labels) != 3 || labels["other"] < 8 {
		t.Fatalf("tenants waiting by label %v; want three labels (other and two tenants), other with the 8 or more jobs of the tenants beyond max_tenants 2", labels)
	}
	backlog := map[string]float64{}
	for _, m := range testrouter.Scrape(t, r, "caddy_diffusion_tenant_backlog_seconds") {
		backlog[m.Labels["tenant"]] = m.Value
	}
	if len(backlog) != 3 || backlog["other"] <= 0 {
		t.Fatalf("tenant backlogs %v; want one per tracked tenant, other's above 0", backlog)
	}
	tenants, _ := r.Get("/workers").JSON(t)["tenants"].([]any)
	if len(tenants) != 3 {
		t.Fatalf("/workers shows tenants %v; want other and two", tenants)
	}
	release()
	for range 11 {
		if a := <-done; a.status != 200 {
			t.Fatalf("%s's job got %d %s", a.tenant, a.status, a.body)
		}
	}
}

// A client that splits its jobs over invented tenant names, to take 63 of
// 64 shares, gets one share with tenants listed: every name off the list
// is the tenant other.
func TestInventedTenantNamesShareOneShare(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{UnitMs: 20})
	r := testrouter.Start(t, tenantSite(ws, "tenants team-a team-b\n"))
	pool := map[string]string{"pool": "tenant-pool"}
	done := make(chan tenantAnswer, 128)
	release := ws[0].Hold()
	t.Cleanup(release)
	go sendTenantJob(r, "team-b", 1, done) // holds the worker while the others queue
	testrouter.WaitFor(t, func() bool { return testrouter.Value(t, r, "caddy_diffusion_worker_inflight_jobs", pool) > 0 })
	for i := range 63 {
		go sendTenantJob(r, fmt.Sprint("mallory-", i), 1, done)
	}
	for range 20 {
		go sendTenantJob(r, "team-a", 1, done)
	}
	testrouter.WaitFor(t, func() bool { return testrouter.Value(t, r, "caddy_diffusion_queue_length", pool) >= 83 })
	var names []string
	for _, tn := range r.Get("/workers").JSON(t)["tenants"].([]any) {
		names = append(names, tn.(map[string]any)["name"].(string))
	}
	if !slices.Equal(names, []string{"other", "team-b", "team-a"}) {
		t.Errorf("/workers shows tenants %v; want other, team-b and team-a: the invented names are other", names)
	}
	release()
	served := map[bool]int{} // of the first 40 jobs after the warm-up: team-a's, and the others'
	for range 84 {
		a := <-done
		if a.status != 200 {
			t.Fatalf("%s's job: %d %s", a.tenant, a.status, a.body)
		}
		if a.tenant != "team-b" && served[true]+served[false] < 40 {
			served[a.tenant == "team-a"]++
		}
	}
	t.Logf("of the first 40 jobs, team-a had %d and 63 invented names %d", served[true], served[false])
	if served[true] < 15 {
		t.Fatalf("of the first 40 jobs team-a had %d; want about half, 20: 63 invented names take one share, not 63 of 64", served[true])
	}
}
