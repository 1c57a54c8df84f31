package diffusionrouter_test

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	diffusionrouter "github.com/miles-rollout/miles-diffusion-router"
	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// statusEndpointsAnswer checks that every status endpoint still answers
// with JSON (200, or 503 when no worker serves), and returns the worker
// list.
func statusEndpointsAnswer(t *testing.T, r *testrouter.Router) []any {
	t.Helper()
	for _, path := range []string{"/health", "/readyz", "/dashboard/data", "/list_workers"} {
		rp := r.Get(path)
		if rp.Status != http.StatusOK && rp.Status != http.StatusServiceUnavailable {
			t.Fatalf("GET %s answered %d: %.200s", path, rp.Status, rp.Body)
		}
		rp.JSON(t)
	}
	rp := r.Get("/workers")
	testrouter.ExpectStatus(t, "GET /workers", rp, http.StatusOK)
	return rp.JSON(t)["workers"].([]any)
}

func TestHostileWorkerURLsAreRefused(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	for _, raw := range []string{
		"http://169%252500", "http://169.254.169.254", "http://metadata.google.internal.", "http://metadata",
		"http://[fd00:ec2::254]", "http://100.100.100.200", "http://instance-data.ec2.internal",
		"http://[::169.254.169.254]", "http://2852039166", "http://0xa9fea9fe", "http://0251.0376.0251.0376",
		"http://0.0.0.0:2019", "http://user:pw@10.0.0.1", "http://10.0.0.1/v1", "ftp://10.0.0.1",
	} {
		rp := r.Post("/add_worker?url="+url.QueryEscape(raw), "")
		testrouter.ExpectStatus(t, "add_worker "+raw, rp, http.StatusBadRequest)
		if !strings.Contains(rp.ErrorText(t), "worker_url") {
			t.Errorf("add_worker %s: error %q does not say what is wrong with worker_url", raw, rp.ErrorText(t))
		}
		// The same URL, unescaped, as miles sends it.
		testrouter.ExpectStatus(t, "add_worker unescaped "+raw, r.Post("/add_worker?url="+raw, ""), http.StatusBadRequest)
	}
	for _, raw := range []string{"http://10.0.0.1:30000/#", "http://10.0.0.1:30000#x"} {
		rp := r.Post("/workers", `{"url":"`+raw+`"}`)
		testrouter.ExpectStatus(t, "register "+raw, rp, http.StatusBadRequest)
		if msg := rp.ErrorText(t); !strings.Contains(msg, "fragment") {
			t.Errorf("register %s: error %q does not name the fragment", raw, msg)
		}
	}
	if workers := statusEndpointsAnswer(t, r); len(workers) != 1 {
		t.Fatalf("after the refusals the pool has %d workers; want the 1 it had", len(workers))
	}
	testrouter.ExpectStatus(t, "generation after the refusals", r.Post("/v1/images/generations", `{"prompt":"a","size":"64x64","response_format":"b64_json"}`), http.StatusOK)

	_, err := testrouter.AdaptSite(testrouter.Port(t), "", "diffusion_router {\n workers http://169%252500\n}")
	if err != nil {
		t.Fatalf("the Caddyfile's syntax is fine and should adapt: %v", err)
	}
	cfg, _ := testrouter.AdaptSite(testrouter.Port(t), "", "diffusion_router {\n workers http://169%252500\n}")
	if err := caddy.Validate(mustConfig(t, cfg)); err == nil || !strings.Contains(err.Error(), "workers (workers)") {
		t.Fatalf("caddy validate of a config listing http://169%%252500: %v; want an error naming workers", err)
	}
}

func mustConfig(t *testing.T, raw []byte) *caddy.Config {
	t.Helper()
	var cfg caddy.Config
	if err := json.Unmarshal(raw, &cfg); err != nil {
		t.Fatal(err)
	}
	return &cfg
}

// startRouterWithAdmin is startRouter with Caddy's admin API on
// 127.0.0.1:adminPort.
func startRouterWithAdmin(t *testing.T, adminPort int, site string) *testrouter.Router {
	t.Helper()
	port := testrouter.Port(t)
	raw, err := testrouter.AdaptSite(port, testrouter.OwnStorage(t), site)
	if err != nil {
		t.Fatal(err)
	}
	var cfg map[string]any
	if err := json.Unmarshal(raw, &cfg); err != nil {
		t.Fatal(err)
	}
	cfg["admin"] = map[string]any{"listen": fmt.Sprintf("127.0.0.1:%d", adminPort)}
	raw, _ = json.Marshal(cfg)
	if err := caddy.Load(raw, true); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	return testrouter.Attach(t, port)
}

func TestCaddyAdminAPIIsNeverAWorker(t *testing.T) {
	adminPort := testrouter.Port(t)
	ws := testrouter.StartWorkers(t, fakeworker.Config{})
	r := startRouterWithAdmin(t, adminPort, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	admin := fmt.Sprintf("127.0.0.1:%d", adminPort)
	testrouter.WaitFor(t, func() bool { c, err := net.Dial("tcp", admin); c.Close(); return err == nil })

	for _, raw := range []string{"http://" + admin, fmt.Sprintf("http://localhost:%d", adminPort), fmt.Sprintf("http://localhost.:%d", adminPort)} {
		rp := r.Post("/add_worker?url="+raw, "")
		testrouter.ExpectStatus(t, "registering Caddy's admin API "+raw, rp, http.StatusBadRequest)
		if !strings.Contains(rp.ErrorText(t), "admin API") {
			t.Errorf("%s: error %q does not say why", raw, rp.ErrorText(t))
		}
	}

	// A name that leads there is refused when it is dialled: the
	// transport of the generated reverse_proxy checks every connection.
	tr := new(diffusionrouter.DiffusionTransport)
	ctx, err := caddy.ProvisionContext(&caddy.Config{Admin: &caddy.AdminConfig{Listen: admin}})
	if err != nil {
		t.Fatal(err)
	}
	if err := tr.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequest("GET", "http://"+admin+"/config/", nil)
	if resp, err := tr.Transport.RoundTrip(req); err == nil || !strings.Contains(err.Error(), "blocked") {
		if resp != nil {
			resp.Body.Close()
		}
		t.Fatalf("the diffusion transport reached Caddy's admin API: %v", err)
	}
	req, _ = http.NewRequest("GET", ws[0].URL()+"/health", nil)
	if resp, err := tr.Transport.RoundTrip(req); err != nil {
		t.Fatalf("the diffusion transport refused a worker: %v", err)
	} else {
		resp.Body.Close()
	}
	if statusEndpointsAnswer(t, r); len(r.Get("/list_workers").JSON(t)["urls"].([]any)) != 1 {
		t.Fatal("a refused registration changed the pool")
	}
}

func TestWorkersSeeTheirOwnHost(t *testing.T) {
	var host atomic.Value
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host.Store(r.Host)
		_, _ = w.Write([]byte(`{}`))
	}))
	t.Cleanup(srv.Close)
	for name, cf := range map[string]string{
		"short form": "diffusion_router {\n workers " + srv.URL + "\n}",
		// reverse_proxy applies header_up to the client's Host: the short
		// form sets the worker's again.
		"short form with header_up": "diffusion_router {\n workers " + srv.URL + "\n reverse_proxy {\n header_up X-Rollout yes\n }\n}",
		"long form": "route {\n diffusion_router {\n workers " + srv.URL + "\n reverse_proxy external\n }\n" +
			" reverse_proxy {\n dynamic diffusion\n lb_policy diffusion\n transport diffusion\n }\n}",
	} {
		r := testrouter.Start(t, cf)
		testrouter.Do(t, "GET", r.Base+"/any/path", nil, "Host", "127.0.0.1:2019")
		if got, want := host.Load(), strings.TrimPrefix(srv.URL, "http://"); got != want {
			t.Errorf("%s: the worker saw Host %v; want its own %s, never the client's", name, got, want)
		}
	}
}

func TestMaxWorkers(t *testing.T) {
	r := testrouter.Start(t, "diffusion_router {\n max_workers 2\n}")
	for i, want := range []int{200, 200, 429} {
		rp := r.Post(fmt.Sprintf("/add_worker?url=http://10.9.9.%d:30000", i+1), "")
		testrouter.ExpectStatus(t, fmt.Sprintf("registration %d", i+1), rp, want)
	}
	if n := len(r.Get("/list_workers").JSON(t)["urls"].([]any)); n != 2 {
		t.Fatalf("%d workers registered; want max_workers, 2", n)
	}
	// A known worker registers again without counting twice.
	testrouter.ExpectStatus(t, "registering a known worker", r.Post("/add_worker?url=http://10.9.9.1:30000", ""), 200)
}

func TestTooLargeContentLengthIsRefusedAtOnce(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n max_body 1MB\n}")
	for _, path := range []string{"/v1/images/generations", "/update_weights_from_disk", "/any/path"} {
		conn, err := net.Dial("tcp", strings.TrimPrefix(r.Base, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n", path)
		_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		buf := make([]byte, 512)
		n, err := conn.Read(buf)
		conn.Close()
		if err != nil || !strings.HasPrefix(string(buf[:n]), "HTTP/1.1 413") || !strings.Contains(string(buf[:n]), "larger than") {
			t.Fatalf("POST %s with only headers: %q, %v; want a 413 JSON error before any body", path, buf[:n], err)
		}
	}
	if ws[0].Stats().Jobs != 0 {
		t.Fatal("a refused request reached the worker")
	}
}

func TestModelListsAreBounded(t *testing.T) {
	huge := strings.Repeat(" ", 3<<20)
	var asked atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		asked.Add(1)
		_, _ = w.Write([]byte(`{"object":"list","data":[{"id":"m","task_type":"T2I"}]` + huge + `}`))
	}))
	t.Cleanup(srv.Close)
	r := testrouter.Start(t, "diffusion_router {\n workers "+srv.URL+"\n}")
	rp := r.Get("/v1/models")
	testrouter.ExpectStatus(t, "a 3 MB model list", rp, http.StatusBadGateway)
	if !strings.Contains(string(rp.Body), "larger than") {
		t.Fatalf("answer %s does not say the list was too large", rp.Body)
	}
	before := asked.Load()
	for range 5 {
		r.Get("/v1/models")
	}
	if asked.Load() != before {
		t.Fatalf("5 more model lists within the cache's lifetime asked the worker %d more times; want none", asked.Load()-before)
	}
}

func TestAbsurdCostIsRefused(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	for _, body := range []string{
		`{"prompt":"a","size":"4096x4096","num_inference_steps":10000000}`,
		`{"prompt":"a","n":10,"num_inference_steps":100000000}`,
	} {
		rp := r.Post("/v1/images/generations", body)
		testrouter.ExpectStatus(t, body, rp, http.StatusBadRequest)
		if !strings.Contains(rp.ErrorText(t), "more than any GPU could run") {
			t.Errorf("%s: error %q", body, rp.ErrorText(t))
		}
	}
	if ws[0].Stats().Jobs != 0 {
		t.Fatal("a refused job reached the worker")
	}
	testrouter.ExpectStatus(t, "a sane job after them", r.Post("/v1/images/generations", `{"prompt":"a","size":"64x64","response_format":"b64_json"}`), http.StatusOK)
}

// TestOversizedImagesAreRefused: a 99999x99999 image passed the cost cap
// and held a worker for minutes, as sglang-diffusion takes any positive
// size. Beyond max_pixels it is a 400 naming the option, before any worker.
func TestOversizedImagesAreRefused(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	for _, body := range []string{
		`{"prompt":"a","size":"99999x99999","response_format":"b64_json"}`,
		`{"prompt":"a","width":8192,"height":8192,"response_format":"b64_json"}`,
	} {
		rp := r.Post("/v1/images/generations", body)
		testrouter.ExpectStatus(t, body, rp, http.StatusBadRequest)
		if msg := rp.ErrorText(t); !strings.Contains(msg, "max_pixels") {
			t.Errorf("%s: error %q does not name max_pixels", body, msg)
		}
	}
	if ws[0].Stats().Jobs != 0 {
		t.Fatal("a refused job reached the worker")
	}
	testrouter.ExpectStatus(t, "a sane job after them", r.Post("/v1/images/generations", `{"prompt":"a","size":"64x64","response_format":"b64_json"}`), http.StatusOK)
}

func TestIsDeadMustBeABoolean(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	id := url.QueryEscape(ws[0].URL())
	testrouter.ExpectStatus(t, "hold back", testrouter.Do(t, "PUT", r.Base+"/workers/"+id, strings.NewReader(`{"is_dead": true}`)), 200)
	for _, body := range []string{`{"is_dead": null}`, `{"is_dead": "false"}`, `{"is_dead": 0}`} {
		rp := testrouter.Do(t, "PUT", r.Base+"/workers/"+id, strings.NewReader(body))
		testrouter.ExpectStatus(t, body, rp, http.StatusBadRequest)
	}
	if w := r.Get("/workers/" + id).JSON(t)["worker"].(map[string]any); w["is_dead"] != true {
		t.Fatalf("a refused update revived the worker: %v", w)
	}
}

// TestCutShortAnswerIsAFailure: a worker that promises 1000 bytes and
// closes after nine is failing, each time; the client, which got none of
// them, gets an error that says so, not a 200 cut short.
func TestCutShortAnswerIsAFailure(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/images/generations" {
			_, _ = w.Write([]byte(`{"object":"list","data":[{"id":"m","task_type":"T2I"}]}`))
			return
		}
		w.Header().Set("Content-Length", "1000")
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write([]byte(`{"data":[`))
		conn, _, _ := http.NewResponseController(w).Hijack()
		conn.Close()
	}))
	t.Cleanup(srv.Close)
	r := testrouter.Start(t, "diffusion_router {\n workers "+srv.URL+"\n max_attempts 3\n}")
	rp := r.Post("/v1/images/generations", `{"prompt":"a"}`)
	testrouter.ExpectStatus(t, "a job whose only worker cuts every answer short", rp, http.StatusBadGateway)
	if msg := rp.ErrorText(t); !strings.Contains(msg, "cut short") {
		t.Fatalf("error %q does not say the answer was cut short", msg)
	}
	if got := r.Workers()[srv.URL]["failures"]; got != 3.0 {
		t.Fatalf("the worker shows %v failures after cutting short the answers of 3 attempts", got)
	}
}

func TestForwardPaths(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n forward_paths sglang\n}")
	for _, path := range []string{"/config/", "/any/path", "/debug/pprof/", "/v2/images/generations"} {
		rp := r.Get(path)
		testrouter.ExpectStatus(t, "GET "+path+" with forward_paths sglang", rp, http.StatusNotFound)
		if !strings.Contains(rp.ErrorText(t), "forward_paths") {
			t.Errorf("GET %s: error %q does not name forward_paths", path, rp.ErrorText(t))
		}
	}
	testrouter.ExpectStatus(t, "a generation", r.Post("/v1/images/generations", `{"prompt":"a","size":"64x64","response_format":"b64_json"}`), http.StatusOK)
	testrouter.ExpectStatus(t, "the router's own /health", r.Get("/health"), http.StatusOK)

	r.Load("diffusion_router {\n workers " + testrouter.URLs(ws) + "\n forward_paths /v1/images/*\n}")
	testrouter.ExpectStatus(t, "under a prefix", r.Post("/v1/images/generations", `{"prompt":"a","size":"64x64","response_format":"b64_json"}`), http.StatusOK)
	testrouter.ExpectStatus(t, "outside the prefix", r.Post("/rollout/generate", `{"prompt":"a"}`), http.StatusNotFound)

	// By default every path goes on, as in the Python router: with no
	// worker, a path nobody knows gets 503.
	r.Load("diffusion_router\n")
	testrouter.ExpectStatus(t, "catch-all without workers", r.Get("/any/path"), http.StatusServiceUnavailable)
}

func TestDotSegmentsAreRefused(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	for _, path := range []string{"/v1/videos/../update_weights_from_disk", "/v1/videos/%2e%2e/update_weights_from_disk", "/v1/images/./generations", "/x/.."} {
		conn, err := net.Dial("tcp", strings.TrimPrefix(r.Base, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		body := `{"model_path":"/ckpt/evil"}`
		fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", path, len(body), body)
		_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		buf := make([]byte, 512)
		n, _ := conn.Read(buf)
		conn.Close()
		if !strings.HasPrefix(string(buf[:n]), "HTTP/1.1 400") {
			t.Fatalf("POST %s: %q; want 400", path, buf[:n])
		}
	}
	if ws[0].Weights() != oldVersion {
		t.Fatalf("a refused path reached the worker: it loaded %q", ws[0].Weights())
	}
}

func TestUnreachableRegistrationsDrawNoJobs(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "live"})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n policy round_robin\n}")
	// freePort may give a port it gave before: register 50 distinct ones.
	for dead := map[string]bool{}; len(dead) < 50; {
		u := fmt.Sprintf("http://127.0.0.1:%d", testrouter.Port(t))
		if !dead[u] {
			dead[u] = true
			testrouter.ExpectStatus(t, "register "+u, r.Post("/add_worker?url="+u, ""), http.StatusOK)
		}
	}
	for i := range 30 {
		testrouter.ExpectStatus(t, fmt.Sprint("generation ", i), r.Post("/v1/images/generations", testrouter.SmallImage), http.StatusOK)
	}
	if h := r.Get("/health").JSON(t); h["healthy_workers"] != 1.0 || h["unhealthy_workers"] != 50.0 {
		t.Fatalf("health after 50 unreachable registrations: %v", h)
	}
}

// A client's request id goes out again in the answer's header and to the
// worker: one that could not (too long, not printable ASCII) is refused.
func TestRequestIDIsBounded(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	for name, id := range map[string]string{"129 bytes": strings.Repeat("r", 129), "not ASCII": "step-é"} {
		rp := r.Post("/v1/images/generations", testrouter.SmallImage, requestIDHeader, id)
		testrouter.ExpectStatus(t, "request id of "+name, rp, 400)
		if !strings.Contains(rp.ErrorText(t), "X-Request-Id") {
			t.Fatalf("refusal of a request id of %s: %s", name, rp.Body)
		}
	}
	if ws[0].Stats().Jobs != 0 {
		t.Fatal("a request with a refused id reached a worker")
	}
	rp := r.Post("/v1/images/generations", testrouter.SmallImage, requestIDHeader, strings.Repeat("r", 128))
	testrouter.ExpectStatus(t, "request id of 128 bytes", rp, 200)
	if rp.Header.Get(requestIDHeader) != strings.Repeat("r", 128) {
		t.Fatalf("request id echoed as %q", rp.Header.Get(requestIDHeader))
	}
}

// Behind a proxy or sidecar on the same machine every client arrives from
// loopback, which the default admin_allow admits: once the server trusts
// proxies, the default admits no address, and only the token or an
// explicit admin_allow lets a control call in.
func TestBehindTrustedProxiesLoopbackIsNoAdmin(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{}, fakeworker.Config{})
	register := func(r *testrouter.Router, header ...string) testrouter.Reply {
		return r.Post("/add_worker?url="+ws[1].URL(), "", header...)
	}
	r := testrouter.StartWith(t, "servers {\n trusted_proxies static private_ranges\n trusted_proxies_strict\n}",
		"diffusion_router {\n workers "+ws[0].URL()+"\n admin_token secret\n}")
	rp := register(r)
	testrouter.ExpectStatus(t, "a tokenless registration through a trusted proxy from 127.0.0.1", rp, http.StatusForbidden)
	if !strings.Contains(rp.ErrorText(t), "admin_allow") {
		t.Errorf("the 403 %q does not say what admits a call", rp.ErrorText(t))
	}
	testrouter.ExpectStatus(t, "a tokenless registration naming a loopback client", register(r, "X-Forwarded-For", "127.0.0.1"), http.StatusForbidden)
	if n := len(r.Workers()); n != 1 {
		t.Fatalf("the refused registrations left %d workers; want 1", n)
	}
	testrouter.ExpectStatus(t, "a generation through the proxy",
		r.Post("/v1/images/generations", `{"prompt":"a","size":"64x64","response_format":"b64_json"}`), http.StatusOK)
	testrouter.ExpectStatus(t, "the same registration with the token", register(r, "Authorization", "Bearer secret"), http.StatusOK)

	// An explicit admin_allow still admits loopback.
	r.Load("diffusion_router {\n workers " + ws[0].URL() + "\n admin_allow 127.0.0.1/32\n}")
	testrouter.ExpectStatus(t, "a tokenless call from loopback listed in admin_allow", r.Post("/remove_worker?url="+ws[1].URL(), ""), http.StatusOK)
}

// With trusted_proxies_strict, as the examples set it, a client cannot
// put a cluster address in front of its own in X-Forwarded-For.
func TestAForgedForwardedForIsNoClusterAddress(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{})
	r := testrouter.StartWith(t, "servers {\n trusted_proxies static private_ranges\n trusted_proxies_strict\n}",
		"diffusion_router {\n admin_allow private_ranges\n}")
	rp := r.Post("/add_worker?url="+ws[0].URL(), "", "X-Forwarded-For", "10.0.0.5, 203.0.113.9")
	testrouter.ExpectStatus(t, "a registration with a forged cluster address before the real one", rp, http.StatusForbidden)
	if n := len(r.Workers()); n != 0 {
		t.Fatalf("the forged registration left %d workers", n)
	}
	testrouter.ExpectStatus(t, "a registration from the cluster", r.Post("/add_worker?url="+ws[0].URL(), "", "X-Forwarded-For", "10.0.0.5"), http.StatusOK)
}

// Behind trusted proxies, a client address the proxy forwarded that does
// not parse is no address at all: Caddy would pass over it to the proxy's
// own address (which admin_allow private_ranges admits) or, strict, to one
// further left that the client may have written. Such a call is not
// admitted by its address, only by the token, and the refusal is logged
// with what the header held.
func TestAnUnparseableForwardedAddressAdmitsNoControlCall(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{})
	for name, strict := range map[string]string{"left to right": "", "strict": "\n trusted_proxies_strict"} {
		t.Run(name, func(t *testing.T) {
			errorLog := filepath.Join(t.TempDir(), "router.log")
			logs := "log router {\n output file " + errorLog + "\n format json\n include http.handlers.diffusion_router\n}\n"
			r := testrouter.StartWith(t, logs+"servers {\n trusted_proxies static private_ranges"+strict+"\n}",
				"diffusion_router {\n admin_allow private_ranges\n admin_token secret\n}")
			register := func(header ...string) testrouter.Reply {
				return r.Post("/add_worker?url="+ws[0].URL(), "", header...)
			}
			for _, forwarded := range []string{"unknown", "_hidden", "10.0.0.5, unknown", "unknown, 10.0.0.5", "10.0.0.5 10.0.0.6", ""} {
				rp := register("X-Forwarded-For", forwarded)
				testrouter.ExpectStatus(t, "a tokenless registration forwarded for "+forwarded, rp, http.StatusForbidden)
				if !strings.Contains(rp.ErrorText(t), "admin_allow") {
					t.Errorf("the 403 %q does not say what admits a call", rp.ErrorText(t))
				}
			}
			if n := len(r.Workers()); n != 0 {
				t.Fatalf("the refused registrations left %d workers", n)
			}
			testrouter.WaitFor(t, func() bool {
				return logEntry(t, errorLog, `"refused control call"`, `X-Forwarded-For from trusted proxy 127.0.0.1`, `\"unknown\", which is not an address`) != nil
			})
			testrouter.ExpectStatus(t, "the same registration with the token",
				register("X-Forwarded-For", "unknown", "Authorization", "Bearer secret"), http.StatusOK)
			testrouter.ExpectStatus(t, "a generation forwarded for an unparseable address",
				r.Post("/v1/images/generations", testrouter.SmallImage, "X-Forwarded-For", "unknown"), http.StatusOK)
			testrouter.ExpectStatus(t, "a call from a cluster address",
				r.Post("/remove_worker?url="+ws[0].URL(), "", "X-Forwarded-For", "10.0.0.5"), http.StatusOK)
		})
	}
}
