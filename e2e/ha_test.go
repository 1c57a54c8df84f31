package e2e

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/etcdtest"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/memstore"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

const haLeaseTTL = 2 * time.Second

// haRouter is the site of a router of the pool "ha-pool" in the group
// elected through etcd; block is the `ha etcd` block's options.
func haRouter(etcd *etcdtest.Server, workers []*fakeworker.Worker, block string) string {
	return testrouter.MetricsSite(fmt.Sprintf("diffusion_router ha-pool {\n workers %s\n health_interval 200ms\n ha etcd %s {\n lease_ttl %s\n %s\n }\n}",
		testrouter.URLs(workers), etcd.Endpoint, haLeaseTTL, block))
}

// standing is the "ha" member of an answer: who leads the group and
// whether this router does.
type standing struct {
	Leading bool    `json:"leading"`
	Leader  *string `json:"leader"`
}

func standingOf(t *testing.T, rp testrouter.Reply) standing {
	t.Helper()
	var body struct{ HA *standing }
	if err := json.Unmarshal(rp.Body, &body); err != nil || body.HA == nil {
		t.Fatalf("status %d, no ha standing in %.300s", rp.Status, rp.Body)
	}
	return *body.HA
}

func (s standing) names(leader string) bool { return s.Leader != nil && *s.Leader == leader }

// haLeader reads the caddy_diffusion_ha_leader of ha-pool.
func haLeader(t *testing.T, r *testrouter.Router) float64 {
	t.Helper()
	for _, m := range testrouter.Scrape(t, r, "caddy_diffusion_ha_leader") {
		if m.Labels["pool"] == "ha-pool" {
			return m.Value
		}
	}
	t.Fatal("no caddy_diffusion_ha_leader series for ha-pool")
	return 0
}

// leads reports whether r answers /readyz 200 as the group's leader.
func leads(t *testing.T, r *testrouter.Router) bool {
	rp := r.Get("/readyz")
	return rp.Status == http.StatusOK && standingOf(t, rp).Leading
}

// defaultIdentity is what a router on port advertises by default.
func defaultIdentity(t *testing.T, port int) string {
	host, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("http://%s:%d", host, port)
}

// expectStandbyRefusal checks a standby's answer to a request it does not
// serve: 503, Retry-After: 1, and the active router named.
func expectStandbyRefusal(t *testing.T, what string, rp testrouter.Reply, leader string) {
	t.Helper()
	testrouter.ExpectStatus(t, what, rp, http.StatusServiceUnavailable)
	if ra := rp.Header.Get("Retry-After"); ra != "1" {
		t.Errorf("%s: Retry-After %q, want 1", what, ra)
	}
	body := rp.JSON(t)
	if msg, _ := body["error"].(string); body["leader"] != leader || !strings.Contains(msg, "standby") || !strings.Contains(msg, leader) {
		t.Errorf("%s: body %s; want an error naming the active router %s", what, rp.Body, leader)
	}
}

// startStandbyProcess runs a second router of ha-pool as a Caddy process
// of its own: routers of one pool in one process share the pool.
func startStandbyProcess(t *testing.T, etcd *etcdtest.Server, workers []*fakeworker.Worker) (*testrouter.Router, *caddyProcess) {
	t.Helper()
	return startHAProcess(t, buildCaddy(t), etcd, workers)
}

// startHAProcess runs a router of ha-pool on bin, a Caddy built by
// buildCaddy, as a process of its own that the test may kill.
func startHAProcess(t *testing.T, bin string, etcd *etcdtest.Server, workers []*fakeworker.Worker) (*testrouter.Router, *caddyProcess) {
	t.Helper()
	dir := t.TempDir()
	r := testrouter.Attach(t, testrouter.Port(t))
	caddyfile := fmt.Sprintf("{\n admin off\n persist_config off\n auto_https off\n default_bind 127.0.0.1\n storage file_system %s\n}\n:%d {\n%s\n}\n",
		filepath.Join(dir, "storage"), r.Port, haRouter(etcd, workers, "advertise "+r.Base))
	if err := os.WriteFile(filepath.Join(dir, "Caddyfile"), []byte(caddyfile), 0o600); err != nil {
		t.Fatal(err)
	}
	return r, startCaddy(t, bin, dir, r)
}

// Two routers of one pool: the first leads and serves, the second stands
// by, naming it; when the leader's Caddy stops, the standby leads within
// the lease and serves.
func TestStandbyNamesTheLeaderAndTakesOver(t *testing.T) {
	if testing.Short() {
		t.Skip("builds Caddy and runs it as a process")
	}
	etcd := etcdtest.Start(t)
	workers := testrouter.StartWorkers(t, fakeworker.Config{Name: "w1"}, fakeworker.Config{Name: "w2"})
	a := testrouter.Start(t, haRouter(etcd, workers, ""))
	testrouter.WaitFor(t, func() bool { return leads(t, a) })
	leader := defaultIdentity(t, a.Port)
	if s := standingOf(t, a.Get("/readyz")); !s.names(leader) {
		t.Fatalf("the leader names %v as leader; want its default identity %s", s.Leader, leader)
	}
	testrouter.ExpectStatus(t, "job on the leader", a.Post("/v1/images/generations", testrouter.SmallImage), http.StatusOK)

	b, bProcess := startStandbyProcess(t, etcd, workers)
	testrouter.WaitFor(t, func() bool { return standingOf(t, b.Get("/health")).names(leader) })
	ready := b.Get("/readyz")
	testrouter.ExpectStatus(t, "standby's /readyz", ready, http.StatusServiceUnavailable)
	if body := ready.JSON(t); body["standby"] != true || body["ready"] != false {
		t.Errorf("standby's /readyz says %s; want ready false, standby true", ready.Body)
	}
	expectStandbyRefusal(t, "image job on the standby", b.Post("/v1/images/generations", testrouter.SmallImage), leader)
	expectStandbyRefusal(t, "worker registration on the standby", b.Post("/workers", `{"url":"http://127.0.0.1:1"}`), leader)
	expectStandbyRefusal(t, "weight update on the standby", b.Post("/update_weights_from_disk", `{"model_path":"/ckpt/1"}`), leader)
	for _, r := range []struct {
		name    string
		router  *testrouter.Router
		leading bool
	}{{"leader", a, true}, {"standby", b, false}} {
		for _, path := range []string{"/health", "/workers", "/dashboard/data"} {
			if s := standingOf(t, r.router.Get(path)); s.Leading != r.leading || !s.names(leader) {
				t.Errorf("%s's %s: leading %v, leader %v; want %v, %s", r.name, path, s.Leading, s.Leader, r.leading, leader)
			}
		}
	}
	if got, want := haLeader(t, a), 1.0; got != want {
		t.Errorf("the leader's caddy_diffusion_ha_leader is %v, want %v", got, want)
	}
	if got, want := haLeader(t, b), 0.0; got != want {
		t.Errorf("the standby's caddy_diffusion_ha_leader is %v, want %v", got, want)
	}
	for u, w := range b.Workers() {
		if w["last_probe"] != nil {
			bProcess.fail("the standby probed %s at %v; a standby calls no worker", u, w["last_probe"])
		}
	}

	stopped := time.Now()
	if err := caddy.Stop(); err != nil { // the leader's Caddy context ends
		t.Fatal(err)
	}
	if !testkit.WaitUntil(haLeaseTTL+time.Second, func() bool { return haLeader(t, b) == 1 }) {
		bProcess.fail("the standby did not lead within lease_ttl + 1s of the leader stopping")
	}
	t.Logf("the standby led %v after the leader stopped", time.Since(stopped).Round(time.Millisecond))
	testrouter.WaitFor(t, func() bool { return leads(t, b) })
	rp := b.Post("/v1/images/generations", testrouter.SmallImage)
	testrouter.ExpectStatus(t, "job on the new leader", rp, http.StatusOK)
	if by := rp.Header.Get("X-Fake-Worker"); by != "w1" && by != "w2" {
		t.Fatalf("the new leader's job was served by %q", by)
	}
	for u, w := range b.Workers() {
		if w["last_probe"] == nil {
			t.Errorf("the new leader sent work without probing %s", u)
		}
	}
	if s := standingOf(t, b.Get("/health")); !s.Leading || !s.names(b.Base) {
		t.Fatalf("the new leader's /health: leading %v, leader %v; want itself, %s", s.Leading, s.Leader, b.Base)
	}
}

// A leader cut off from etcd stops taking jobs once its lease runs out,
// answering as a standby, and finishes the job it holds.
func TestLeaderCutOffFromEtcdFinishesItsJobs(t *testing.T) {
	etcd := etcdtest.Start(t)
	// testrouter.SmallImage costs 0.125: 12.5 s on this worker, past the lease.
	workers := testrouter.StartWorkers(t, fakeworker.Config{Name: "slow", UnitMs: 100000})
	r := testrouter.Start(t, haRouter(etcd, workers, "advertise http://router-a:8080"))
	testrouter.WaitFor(t, func() bool { return leads(t, r) })
	held := testrouter.BusyWith(t, r, workers[0].URL(), testrouter.SmallImage)
	etcd.Stop()
	if !testkit.WaitUntil(haLeaseTTL+5*time.Second, func() bool { return r.Get("/readyz").Status == http.StatusServiceUnavailable }) {
		t.Fatal("the leader still says it is ready well past its lease after etcd stopped")
	}
	rp := r.Post("/v1/images/generations", testrouter.SmallImage)
	testrouter.ExpectStatus(t, "new job once the lease is lost", rp, http.StatusServiceUnavailable)
	if rp.Header.Get("Retry-After") != "1" || !strings.Contains(rp.ErrorText(t), "standby") {
		t.Fatalf("new job once the lease is lost: %v %s; want Retry-After 1 and a standby's error", rp.Header, rp.Body)
	}
	if got := haLeader(t, r); got != 0 {
		t.Errorf("caddy_diffusion_ha_leader is %v after the lease was lost, want 0", got)
	}
	testrouter.ExpectStatus(t, "the job held when the lease was lost", <-held, http.StatusOK)
}

// etcdKV is a key of etcd as its JSON gateway shows it, base64 and all.
type etcdKV struct {
	Key            string `json:"key"`
	Value          []byte `json:"value,omitempty"`
	CreateRevision string `json:"create_revision"`
}

// etcdRange reads the keys from key up to rangeEnd ("": key alone) from
// etcd's JSON gateway.
func etcdRange(t *testing.T, etcd *etcdtest.Server, key, rangeEnd string) []etcdKV {
	t.Helper()
	b64 := base64.StdEncoding.EncodeToString
	query := map[string]string{"key": b64([]byte(key))}
	if rangeEnd != "" {
		query["range_end"] = b64([]byte(rangeEnd))
	}
	body, _ := json.Marshal(query)
	resp, err := http.Post(etcd.Endpoint+"/v3/kv/range", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out struct{ Kvs []etcdKV }
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatal(err)
	}
	return out.Kvs
}

// electionKeys is the keys of ha-pool's election, with the revisions they
// were created at, as text to compare.
func electionKeys(t *testing.T, etcd *etcdtest.Server) string {
	t.Helper()
	keys, _ := json.Marshal(etcdRange(t, etcd, "/diffusion-router/election/ha-pool/", "/diffusion-router/election/ha-pool0"))
	return string(keys)
}

// A reload that leaves `ha` as it was keeps the campaign: the leader's key
// in etcd is the one it had, and it leads throughout. One that changes it
// campaigns again; one that drops it resigns.
func TestReloadKeepsTheLead(t *testing.T) {
	etcd := etcdtest.Start(t)
	workers := testrouter.StartWorkers(t, fakeworker.Config{Name: "w1"})
	site := haRouter(etcd, workers, "advertise http://router-a:8080")
	r := testrouter.Start(t, site)
	testrouter.WaitFor(t, func() bool { return leads(t, r) })
	before := electionKeys(t, etcd)
	if !strings.Contains(before, "create_revision") {
		t.Fatalf("no election key in etcd: %s", before)
	}
	r.Load(site + "\n# reloaded")
	if !leads(t, r) {
		t.Fatal("the router does not lead right after a reload")
	}
	if after := electionKeys(t, etcd); after != before {
		t.Fatalf("election keys %s after the reload; want %s, the campaign kept", after, before)
	}
	testrouter.ExpectStatus(t, "job after the reload", r.Post("/v1/images/generations", testrouter.SmallImage), http.StatusOK)

	// A reload that changes `ha` campaigns again, with the new identity.
	r.Load(haRouter(etcd, workers, "advertise http://router-b:8080"))
	testrouter.WaitFor(t, func() bool { return leads(t, r) && standingOf(t, r.Get("/readyz")).names("http://router-b:8080") })
	if after := electionKeys(t, etcd); after == before || !strings.Contains(after, "create_revision") {
		t.Fatalf("election keys %s after a reload that changed ha; want a new campaign's, not %s", after, before)
	}
	// One that drops it resigns: the router is the pool's only one again.
	r.Load(testrouter.MetricsSite("diffusion_router ha-pool {\n workers " + testrouter.URLs(workers) + "\n}"))
	ready := r.Get("/readyz")
	testrouter.ExpectStatus(t, "/readyz without ha", ready, http.StatusOK)
	if ready.JSON(t)["ha"] != nil {
		t.Fatalf("/readyz shows ha after a reload that dropped it: %s", ready.Body)
	}
	if keys := electionKeys(t, etcd); strings.Contains(keys, "create_revision") {
		t.Fatalf("election keys %s left in etcd after a reload that dropped ha", keys)
	}
	testrouter.ExpectStatus(t, "job without ha", r.Post("/v1/images/generations", testrouter.SmallImage), http.StatusOK)
}

// etcdValue reads key from etcd; "" when it is not there.
func etcdValue(t *testing.T, etcd *etcdtest.Server, key string) string {
	t.Helper()
	kvs := etcdRange(t, etcd, key, "")
	if len(kvs) == 0 {
		return ""
	}
	return string(kvs[0].Value)
}

// haRecordKey is where ha-pool's record lives in etcd: Caddy storage's
// key under the default key_prefix.
const haRecordKey = "/diffusion-router/diffusion_router/ha-pool/fleet.json"

// fleetSeen is what /workers shows of the workers and the fleet's weights.
func fleetSeen(t *testing.T, r *testrouter.Router) (sources map[string]string, version string) {
	t.Helper()
	sources = map[string]string{}
	for u, w := range r.Workers() {
		sources[u], _ = w["source"].(string)
	}
	version, _ = r.Get("/health").JSON(t)["weight_version"].(string)
	return sources, version
}

// The fleet's record lives in etcd: the standby mirrors what the leader
// registers and updates, and carries it on once it leads.
func TestStandbyTakesOverTheFleetAsTheLeaderLeftIt(t *testing.T) {
	if testing.Short() {
		t.Skip("builds Caddy and runs it as a process")
	}
	etcd := etcdtest.Start(t)
	workers := testrouter.StartWorkers(t, fakeworker.Config{Name: "w1"}, fakeworker.Config{Name: "joiner"})
	configured, joiner := workers[:1], workers[1].URL()
	a := testrouter.Start(t, haRouter(etcd, configured, ""))
	testrouter.WaitFor(t, func() bool { return leads(t, a) })
	testrouter.ExpectStatus(t, "registration on the leader", a.Post("/workers", `{"url":"`+joiner+`"}`), http.StatusOK)
	testrouter.WaitFor(t, func() bool { return a.Workers()[joiner]["state"] == "serving" })
	testrouter.ExpectStatus(t, "update on the leader", a.Post("/update_weights_from_disk", `{"model_path":"/ckpt/7","weight_version":"step-7"}`), http.StatusOK)
	testrouter.WaitFor(t, func() bool { return strings.Contains(etcdValue(t, etcd, haRecordKey), "step-7") })

	b, bProcess := startStandbyProcess(t, etcd, configured)
	mirrored := func() bool {
		sources, version := fleetSeen(t, b)
		return sources[joiner] == "registered" && version == "step-7"
	}
	if !testkit.WaitUntil(10*time.Second, mirrored) {
		sources, version := fleetSeen(t, b)
		bProcess.fail("the standby shows workers %v on %q; want the leader's registered worker and step-7", sources, version)
	}
	testrouter.ExpectStatus(t, "deregistration on the leader", testrouter.Do(t, "DELETE", a.Base+"/workers/"+url.QueryEscape(joiner), nil), http.StatusOK)
	if !testkit.WaitUntil(10*time.Second, func() bool { s, _ := fleetSeen(t, b); _, still := s[joiner]; return !still }) {
		bProcess.fail("the standby still shows the worker the leader removed")
	}
	testrouter.ExpectStatus(t, "registration again", a.Post("/workers", `{"url":"`+joiner+`"}`), http.StatusOK)
	testrouter.WaitFor(t, mirrored)

	if err := caddy.Stop(); err != nil {
		t.Fatal(err)
	}
	testrouter.WaitFor(t, func() bool { return leads(t, b) })
	if !mirrored() {
		sources, version := fleetSeen(t, b)
		t.Fatalf("the new leader has workers %v on %q; want the fleet as the leader left it", sources, version)
	}
	served := map[string]bool{}
	testrouter.WaitFor(t, func() bool {
		rp := b.Post("/v1/images/generations", testrouter.SmallImage)
		served[rp.Header.Get("X-Fake-Worker")] = rp.Status == http.StatusOK
		return served["w1"] && served["joiner"]
	})
	// The new leader writes the record from now on.
	testrouter.ExpectStatus(t, "hold back on the new leader", testrouter.Do(t, "PUT", b.Base+"/workers/"+url.QueryEscape(joiner), strings.NewReader(`{"is_dead":true}`)), http.StatusOK)
	testrouter.WaitFor(t, func() bool { return strings.Contains(etcdValue(t, etcd, haRecordKey), `"is_dead":true`) })
}

// A router whose pool joins a group with no record in etcd yet takes its
// fleet from Caddy's storage and writes it to etcd; from then on the
// record lives in etcd alone.
func TestFirstLeaderSeedsTheRecordFromStorage(t *testing.T) {
	etcd := etcdtest.Start(t)
	workers := testrouter.StartWorkers(t, fakeworker.Config{Name: "w1"}, fakeworker.Config{Name: "kept"})
	store := memstore.New()
	seed, _ := json.Marshal(map[string]any{
		"workers":        []testrouter.StoredWorker{{URL: workers[1].URL(), Registered: true, WeightVersion: "step-3"}},
		"weight_version": "step-3",
		"updates":        []map[string]any{{"path": "/update_weights_from_disk", "weight_version": "step-3", "body": map[string]string{"model_path": "/ckpt/3"}}},
	})
	store.Put("diffusion_router/ha-pool/fleet.json", seed)
	r := testrouter.StartWith(t, testrouter.UseStorage(store), haRouter(etcd, workers[:1], ""))
	testrouter.WaitFor(t, func() bool { return leads(t, r) })
	if sources, version := fleetSeen(t, r); sources[workers[1].URL()] != "registered" || version != "step-3" {
		t.Fatalf("the first leader has workers %v on %q; want the worker and weights of Caddy's storage", sources, version)
	}
	testrouter.WaitFor(t, func() bool {
		v := etcdValue(t, etcd, haRecordKey)
		return strings.Contains(v, workers[1].URL()) && strings.Contains(v, "step-3")
	})
	written := len(store.Stored())
	testrouter.ExpectStatus(t, "hold back", testrouter.Do(t, "PUT", r.Base+"/workers/"+url.QueryEscape(workers[1].URL()), strings.NewReader(`{"is_dead":true}`)), http.StatusOK)
	testrouter.WaitFor(t, func() bool { return strings.Contains(etcdValue(t, etcd, haRecordKey), `"is_dead":true`) })
	if n := len(store.Stored()); n != written {
		t.Fatalf("Caddy's storage got %d writes of the record with ha on; want none", n-written)
	}
}

// etcd stopped and started again: the router stands by while it cannot
// renew its lease, then leads again with the fleet as the record holds it.
func TestRouterLeadsAgainOnceEtcdIsBack(t *testing.T) {
	etcd := etcdtest.Start(t)
	workers := testrouter.StartWorkers(t, fakeworker.Config{Name: "w1"}, fakeworker.Config{Name: "joiner"})
	r := testrouter.Start(t, haRouter(etcd, workers[:1], "advertise http://router-a:8080"))
	testrouter.WaitFor(t, func() bool { return leads(t, r) })
	joiner := workers[1].URL()
	testrouter.ExpectStatus(t, "registration", r.Post("/workers", `{"url":"`+joiner+`"}`), http.StatusOK)
	testrouter.WaitFor(t, func() bool { return strings.Contains(etcdValue(t, etcd, haRecordKey), joiner) })

	etcd.Stop()
	if !testkit.WaitUntil(haLeaseTTL+5*time.Second, func() bool { return r.Get("/readyz").Status == http.StatusServiceUnavailable }) {
		t.Fatal("the router still says it is ready well past its lease after etcd stopped")
	}
	testrouter.ExpectStatus(t, "job while etcd is down", r.Post("/v1/images/generations", testrouter.SmallImage), http.StatusServiceUnavailable)

	if err := etcd.Restart(); err != nil {
		t.Fatal(err)
	}
	if !testkit.WaitUntil(30*time.Second, func() bool { return leads(t, r) }) {
		t.Fatal("the router did not lead again within 30 s of etcd's return")
	}
	if sources, _ := fleetSeen(t, r); sources[joiner] != "registered" {
		t.Fatalf("after etcd's return the router has workers %v; want the registered one kept", sources)
	}
	served := map[string]bool{}
	testrouter.WaitFor(t, func() bool {
		rp := r.Post("/v1/images/generations", testrouter.SmallImage)
		served[rp.Header.Get("X-Fake-Worker")] = rp.Status == http.StatusOK
		return served["w1"] && served["joiner"]
	})
}
