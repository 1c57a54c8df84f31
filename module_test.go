package diffusionrouter

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"mime/multipart"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"

	"github.com/miles-rollout/miles-diffusion-router/examples/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/msgpack"
)

// TestMain keeps Caddy's files out of the user's home.
func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "diffusionrouter-test")
	if err != nil {
		panic(err)
	}
	for _, k := range []string{"HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME"} {
		os.Setenv(k, dir)
	}
	// Caddy chose its storage folder from HOME before TestMain ran.
	caddy.DefaultStorage.Path = caddy.AppDataDir()
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// testRouter is Caddy running in this process with one site on a port the
// test picked.
type testRouter struct {
	t       *testing.T
	port    int
	base    string
	globals string // more global options
}

func startRouter(t *testing.T, site string) *testRouter {
	t.Helper()
	return startRouterWith(t, "", site)
}

// startRouterWith is startRouter with more global options.
func startRouterWith(t *testing.T, globals, site string) *testRouter {
	t.Helper()
	if !strings.Contains(globals, "storage ") {
		globals += "\n" + ownStorage(t)
	}
	port := freePort(t)
	r := &testRouter{t: t, port: port, base: fmt.Sprintf("http://127.0.0.1:%d", port), globals: globals}
	r.load(site)
	t.Cleanup(func() { _ = caddy.Stop() })
	return r
}

// load adapts the site as `caddy adapt` would and (re)loads it, as
// `caddy reload` does.
func (r *testRouter) load(site string) {
	r.t.Helper()
	cfg, err := adaptSite(r.port, r.globals, site)
	if err != nil {
		r.t.Fatal(err)
	}
	if err := caddy.Load(cfg, true); err != nil {
		r.t.Fatal(err)
	}
	client.CloseIdleConnections() // the old config's server closes them
	// Each config listens on a socket of its own (SO_REUSEPORT), and the
	// kernel spreads new connections over both while the old one is open;
	// closing it resets those still waiting to be accepted, requests no
	// server has read. caddy.Load returns before the old server has closed
	// its socket, so wait for that before a test sends anything.
	addr := fmt.Sprintf("127.0.0.1:%d", r.port)
	if !waitUntilOr(30*time.Second, func() bool { return listeners(addr) <= 1 }) {
		r.t.Fatalf("%d sockets still listen on %s 30 s after a reload", listeners(addr), addr)
	}
}

// listeners counts the sockets listening on addr, an IPv4 host:port: from
// /proc/net/tcp where there is one, otherwise the configs using it.
func listeners(addr string) int {
	data, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		return caddy.ListenerUsage("tcp", addr)
	}
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		panic(err)
	}
	ip := ap.Addr().As4()
	// The address as the kernel writes it: the IPv4 address as a
	// native-endian 32-bit number, then the port, both in hex.
	local := fmt.Sprintf("%08X:%04X", binary.NativeEndian.Uint32(ip[:]), ap.Port())
	n := 0
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) > 3 && f[1] == local && f[3] == "0A" { // TCP_LISTEN
			n++
		}
	}
	return n
}

// ownStorage is the storage global option of a folder of the test's own,
// so that no pool reads back the fleet an earlier test left.
func ownStorage(t *testing.T) string {
	return "storage file_system " + t.TempDir()
}

func adaptSite(port int, globals, site string) ([]byte, error) {
	cf := fmt.Sprintf(`{
	admin off
	auto_https off
	persist_config off
	grace_period 2s # long enough for a request caught by a reload to finish
	default_bind 127.0.0.1
	log {
		level ERROR
	}
%s
}
:%d {
%s
}
`, globals, port, site)
	cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(cf), nil)
	return cfg, err
}

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// startWorkers starts fake sglang-diffusion workers that stop with the test.
func startWorkers(t *testing.T, cfgs ...fakeworker.Config) []*fakeworker.Worker {
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

func urlsOf(workers []*fakeworker.Worker) string {
	var urls []string
	for _, w := range workers {
		urls = append(urls, w.URL())
	}
	return strings.Join(urls, " ")
}

// reply is a response read whole.
type reply struct {
	status int
	header http.Header
	body   []byte
}

func (rp reply) json(t *testing.T) map[string]any {
	t.Helper()
	var v map[string]any
	if err := json.Unmarshal(rp.body, &v); err != nil {
		t.Fatalf("status %d, body is not JSON: %v: %.200s", rp.status, err, rp.body)
	}
	return v
}

// errorText is the message of a {"error": "..."} body.
func (rp reply) errorText(t *testing.T) string {
	t.Helper()
	msg, ok := rp.json(t)["error"].(string)
	if !ok {
		t.Fatalf("status %d, no error message in %.200s", rp.status, rp.body)
	}
	return msg
}

var client = &http.Client{Timeout: 60 * time.Second}

func do(t *testing.T, method, u string, body io.Reader, header ...string) reply {
	t.Helper()
	req, err := http.NewRequest(method, u, body)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := client.Do(req)
	if err != nil && method == http.MethodGet {
		// A reload closes the old server's connections, even one it has
		// just accepted; a client retries a GET, as browsers do.
		resp, err = client.Do(req)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return reply{resp.StatusCode, resp.Header, b}
}

func (r *testRouter) get(path string) reply { return do(r.t, "GET", r.base+path, nil) }

func (r *testRouter) post(path, body string, header ...string) reply {
	return do(r.t, "POST", r.base+path, strings.NewReader(body), header...)
}

const smallImage = `{"response_format":"b64_json","prompt":"a cat","size":"256x256","num_inference_steps":2}`

func expectStatus(t *testing.T, what string, rp reply, want int) {
	t.Helper()
	if rp.status != want {
		t.Fatalf("%s: status %d, want %d; body %.300s", what, rp.status, want, rp.body)
	}
}

func TestForwardsEveryEndpoint(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "img"}, fakeworker.Config{Name: "vid", TaskType: "T2V"})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n}")

	rp := r.post("/v1/images/generations", smallImage)
	expectStatus(t, "images/generations", rp, 200)
	if rp.header.Get("X-Fake-Worker") != "img" {
		t.Fatalf("image job served by %q; want the image worker", rp.header.Get("X-Fake-Worker"))
	}
	if data, _ := rp.json(t)["data"].([]any); len(data) != 1 {
		t.Fatalf("images/generations answered %.200s", rp.body)
	}

	body, ctype := multipartEdit(t)
	expectStatus(t, "images/edits", r.post("/v1/images/edits", body, "Content-Type", ctype), 200)
	expectStatus(t, "diffusion/generate", r.post("/v1/diffusion/generate", smallImage), 200)

	rp = r.post("/rollout/generate", `{"prompt":"a cat","width":64,"height":64,"num_inference_steps":2,"seed":7}`)
	expectStatus(t, "rollout/generate", rp, 200)
	decoded, err := msgpack.Unmarshal(rp.body)
	if samples, _ := decoded.([]any); err != nil || len(samples) != 1 || samples[0].(map[string]any)["seed"] != int64(7) ||
		rp.header.Get("Content-Type") != "application/msgpack" {
		t.Fatalf("rollout/generate body is not the worker's msgpack list: %.200q (%v)", rp.body, err)
	}
	if v := rp.header.Get(weightVersionHeader); v != "fake/diffusion-model" {
		t.Fatalf("rollout/generate served on %q; want the model id", v)
	}

	expectStatus(t, "model_info", r.get("/model_info"), 200)

	id := createVideo(t, r, "vid")
	waitVideo(t, r, id)
	rp = r.get("/v1/videos/" + id + "/content")
	expectStatus(t, "video content", rp, 200)
	if rp.header.Get("Content-Type") != "video/mp4" || len(rp.body) == 0 {
		t.Fatalf("video content: %s, %d bytes", rp.header.Get("Content-Type"), len(rp.body))
	}
	expectStatus(t, "delete video", do(t, "DELETE", r.base+"/v1/videos/"+id, nil), 200)
	rp = r.get("/v1/videos/" + id)
	expectStatus(t, "deleted video", rp, 404)
	if msg := rp.errorText(t); msg != "Unknown video_id" {
		t.Fatalf("deleted video: %q", msg)
	}
}

func multipartEdit(t *testing.T) (string, string) {
	t.Helper()
	return multipartForm([]byte("\x89PNG fake image bytes"), "prompt", "make it blue", "size", "256x256", "num_inference_steps", "2")
}

// multipartForm is a form with an image file part, then the fields given as
// name, value pairs; it returns the body and its Content-Type.
func multipartForm(image []byte, fields ...string) (string, string) {
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	fw, _ := mw.CreateFormFile("image", "in.png")
	fw.Write(image)
	for i := 0; i+1 < len(fields); i += 2 {
		mw.WriteField(fields[i], fields[i+1])
	}
	mw.Close()
	return buf.String(), mw.FormDataContentType()
}

// busyWith starts a job on the router that keeps the given worker busy and
// waits until the worker has it; the job's answer arrives on the channel.
func busyWith(t *testing.T, r *testRouter, worker string, body string) <-chan reply {
	t.Helper()
	done := make(chan reply, 1)
	go func() { done <- r.post("/v1/images/generations", body) }()
	waitFor(t, func() bool { return workerStates(t, r)[worker]["active_requests"] == 1.0 })
	return done
}

// createVideo starts a video job and checks which worker took it.
func createVideo(t *testing.T, r *testRouter, wantWorker string) string {
	t.Helper()
	rp := r.post("/v1/videos", `{"prompt":"a dog","size":"64x64","num_frames":2,"num_inference_steps":2}`)
	if rp.status != 200 {
		t.Fatalf("create video: status %d; body %.300s; workers %s", rp.status, rp.body, r.get("/workers").body)
	}
	if wantWorker != "" && rp.header.Get("X-Fake-Worker") != wantWorker {
		t.Fatalf("video job made by %q; want %q", rp.header.Get("X-Fake-Worker"), wantWorker)
	}
	id, _ := rp.json(t)["id"].(string)
	if id == "" {
		t.Fatalf("no job id in %s", rp.body)
	}
	return id
}

func waitVideo(t *testing.T, r *testRouter, id string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		rp := r.get("/v1/videos/" + id)
		expectStatus(t, "poll video", rp, 200)
		if rp.json(t)["status"] == "completed" {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("video %s never completed", id)
}

func TestVideoJobsStayWithTheirWorker(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "v1", TaskType: "T2V"}, fakeworker.Config{Name: "v2", TaskType: "TI2V"})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n policy round_robin\n}")
	made := map[string]string{}
	for range 6 {
		rp := r.post("/v1/videos", `{"prompt":"a dog","size":"64x64","num_frames":2,"num_inference_steps":2}`)
		expectStatus(t, "create video", rp, 200)
		made[rp.json(t)["id"].(string)] = rp.header.Get("X-Fake-Worker")
	}
	if len(made) != 6 {
		t.Fatalf("job ids %v", made)
	}
	for id, creator := range made {
		for _, path := range []string{"/v1/videos/" + id, "/v1/videos/" + id} {
			if got := r.get(path).header.Get("X-Fake-Worker"); got != creator {
				t.Fatalf("GET %s reached %q; the job was made by %q", path, got, creator)
			}
		}
	}
	rp := r.get("/v1/videos/video_nobody_made/content")
	expectStatus(t, "unknown video", rp, 404)
	if rp.errorText(t) != "Unknown video_id" {
		t.Fatalf("unknown video: %s", rp.body)
	}
}

func TestVideoNeedsVideoCapableWorker(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "img"})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n}")
	rp := r.post("/v1/videos", `{"prompt":"a dog"}`)
	expectStatus(t, "video on image-only pool", rp, 400)
	if !strings.Contains(rp.errorText(t), "video-capable") {
		t.Fatalf("error %q does not say video-capable", rp.errorText(t))
	}
	if ws[0].Stats().Jobs != 0 {
		t.Fatal("the image worker was sent a video job")
	}
}

func TestHealthFollowsServingWorkers(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "w"})
	r := startRouter(t, "diffusion_router {\n queue_timeout 300ms\n}")

	rp := r.get("/health")
	expectStatus(t, "health with no workers", rp, 503)
	if h := rp.json(t); h["status"] != "unhealthy" || h["total_workers"] != 0.0 {
		t.Fatalf("health: %s", rp.body)
	}
	rp = r.post("/v1/images/generations", smallImage)
	expectStatus(t, "generation with no workers", rp, 503)
	if rp.errorText(t) != "No healthy workers available in the pool" {
		t.Fatalf("no workers: %s", rp.body)
	}

	expectStatus(t, "register", r.post("/workers", `{"url":"`+ws[0].URL()+`"}`), 200)
	rp = r.get("/health")
	expectStatus(t, "health with a worker", rp, 200)
	want := map[string]any{"status": "healthy", "healthy_workers": 1.0, "total_workers": 1.0, "dead_workers": 0.0, "sleeping_workers": 0.0}
	for k, v := range want {
		if got := rp.json(t)[k]; got != v {
			t.Fatalf("health %s = %v, want %v", k, got, v)
		}
	}
	expectStatus(t, "generation", r.post("/v1/images/generations", smallImage), 200)

	id := url.QueryEscape(ws[0].URL())
	expectStatus(t, "mark dead", do(t, "PUT", r.base+"/workers/"+id, strings.NewReader(`{"is_dead":true}`)), 200)
	expectStatus(t, "health with a dead worker", r.get("/health"), 503)
	// The job waits in the queue for the worker to come back, up to queue_timeout.
	rp = r.post("/v1/images/generations", smallImage)
	expectStatus(t, "generation on a dead pool", rp, 503)
	if !strings.Contains(rp.errorText(t), "queue") || rp.header.Get("Retry-After") == "" {
		t.Fatalf("queue timeout answer: %s %v", rp.body, rp.header)
	}
	if ws[0].Stats().Jobs != 1 {
		t.Fatalf("dead worker got jobs: %d", ws[0].Stats().Jobs)
	}
}

func TestBadRequestsAreRefusedCleanly(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "w"})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n max_body 4KiB\n}")

	rp := r.post("/v1/images/generations", `{"prompt": "a cat",`)
	expectStatus(t, "invalid JSON", rp, 400)
	if rp.errorText(t) != "Invalid JSON body" {
		t.Fatalf("invalid JSON: %s", rp.body)
	}

	big := `{"prompt":"` + strings.Repeat("x", 8<<10) + `"}`
	rp = r.post("/v1/images/generations", big)
	expectStatus(t, "body over max_body", rp, 413)
	if !strings.Contains(rp.errorText(t), "max_body") {
		t.Fatalf("413 error: %s", rp.body)
	}
	// Without a Content-Length the limit is found while reading.
	rp = do(t, "POST", r.base+"/v1/images/generations", io.MultiReader(strings.NewReader(big)))
	expectStatus(t, "chunked body over max_body", rp, 413)
	body, ctype := multipartEdit(t)
	rp = do(t, "POST", r.base+"/v1/images/edits", io.MultiReader(strings.NewReader(body+strings.Repeat("x", 8<<10))), "Content-Type", ctype)
	expectStatus(t, "chunked multipart over max_body", rp, 413)

	if n := ws[0].Stats().Jobs; n != 0 {
		t.Fatalf("a refused request reached the worker (%d jobs)", n)
	}
	expectStatus(t, "good request after bad ones", r.post("/v1/images/generations", smallImage), 200)

	// A worker's own 4xx passes through unchanged.
	rp = r.post("/v1/images/generations", `{"size":"256x256"}`)
	if rp.status != 422 || rp.header.Get("X-Fake-Worker") != "w" {
		t.Fatalf("worker's 422 became %d: %s", rp.status, rp.body)
	}
}

func TestUnreachableWorker(t *testing.T) {
	dead := "http://127.0.0.1:" + fmt.Sprint(freePort(t))
	r := startRouter(t, "diffusion_router {\n workers "+dead+"\n max_attempts 2\n}")
	rp := r.post("/v1/images/generations", smallImage)
	expectStatus(t, "unreachable worker", rp, 502)
	if !strings.HasPrefix(rp.errorText(t), "Worker request failed") {
		t.Fatalf("502 error: %s", rp.body)
	}
	// With no other worker, the job is tried on this one max_attempts times.
	w := r.get("/workers/" + url.QueryEscape(dead)).json(t)["worker"].(map[string]any)
	if w["consecutive_failures"] != 2.0 || w["active_requests"] != 0.0 {
		t.Fatalf("after a failed connection the worker shows %v", w)
	}
}

func TestFailedConnectionIsRetriedElsewhere(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "live"})
	dead := "http://127.0.0.1:" + fmt.Sprint(freePort(t))
	r := startRouter(t, "diffusion_router {\n workers "+dead+" "+ws[0].URL()+"\n policy round_robin\n}")
	for i := range 6 {
		rp := r.post("/v1/images/generations", smallImage)
		expectStatus(t, fmt.Sprintf("request %d", i), rp, 200)
	}
	if n := ws[0].Stats().Jobs; n != 6 {
		t.Fatalf("live worker served %d of 6", n)
	}
}

func TestControlEndpointsNeedTrust(t *testing.T) {
	t.Setenv("DIFFUSION_ROUTER_TEST_TOKEN", "s3cret")
	ws := startWorkers(t, fakeworker.Config{Name: "w"})
	r := startRouter(t, "diffusion_router {\n admin_allow 10.0.0.0/8\n admin_token {env.DIFFUSION_ROUTER_TEST_TOKEN}\n}")
	register := `{"url":"` + ws[0].URL() + `"}`

	for _, auth := range []string{"", "Bearer wrong", "Bearer s3cret2", "s3cret"} {
		rp := r.post("/workers", register, "Authorization", auth)
		expectStatus(t, "untrusted register with "+auth, rp, 403)
		rp.errorText(t)
	}
	for _, path := range []string{"/add_worker?url=" + ws[0].URL(), "/remove_worker?url=" + ws[0].URL()} {
		expectStatus(t, "untrusted "+path, r.post(path, ""), 403)
	}
	expectStatus(t, "untrusted delete", do(t, "DELETE", r.base+"/workers/x", nil), 403)
	if n := len(r.get("/workers").json(t)["workers"].([]any)); n != 0 {
		t.Fatalf("untrusted calls changed the fleet: %d workers", n)
	}

	rp := r.post("/workers", register, "Authorization", "Bearer s3cret")
	expectStatus(t, "register with token", rp, 200)
	expectStatus(t, "read-only list", r.get("/list_workers"), 200)
	expectStatus(t, "generation", r.post("/v1/images/generations", smallImage), 200)
}

func TestWorkersAPI(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "a"}, fakeworker.Config{Name: "b", TaskType: "T2V"})
	r := startRouter(t, "diffusion_router {\n workers "+ws[0].URL()+"\n}")
	b := ws[1].URL()

	rp := r.post("/workers?worker_url="+b, "")
	expectStatus(t, "register b", rp, 200)
	w := rp.json(t)["worker"].(map[string]any)
	if w["url"] != b || w["worker_id"] != url.QueryEscape(b) || w["video_support"] != true || w["display_id"] != strings.TrimPrefix(b, "http://") {
		t.Fatalf("registered worker %v", w)
	}
	expectStatus(t, "register b again", r.post("/add_worker?url="+b+"/", ""), 200)
	rp = r.get("/list_workers")
	if urls := rp.json(t)["urls"].([]any); len(urls) != 2 || urls[1] != b {
		t.Fatalf("list_workers: %s", rp.body)
	}

	for body, want := range map[string]string{
		``:                                          "worker_url is required",
		`{"url": 5`:                                 "Invalid JSON body",
		`["http://10.0.0.1:1"]`:                     "JSON object",
		`{"url":"http://169.254.169.254"}`:          "blocked",
		`{"url":"http://10.0.0.1:1/v1"}`:            "path",
		`{"url":"unix:///var/run/w.sock"}`:          "http://",
		`{"worker_url":"http://u:p@h:1"}`:           "credentials",
		`{"url":"http://10.0.0.1:1?x=y"}`:           "query",
		`{"url":"http://[fe80::1]:30000"}`:          "link-local",
		`{"url":"http://metadata.google.internal"}`: "blocked",
	} {
		rp := r.post("/workers", body)
		expectStatus(t, "register "+body, rp, 400)
		if !strings.Contains(rp.errorText(t), want) {
			t.Fatalf("register %s: error %q lacks %q", body, rp.errorText(t), want)
		}
	}

	id := url.QueryEscape(b)
	expectStatus(t, "get worker", r.get("/workers/"+id), 200)
	rp = r.get("/workers/" + url.QueryEscape("http://10.9.9.9:1"))
	expectStatus(t, "unknown worker", rp, 404)
	if rp.errorText(t) != "Worker not found" {
		t.Fatalf("unknown worker: %s", rp.body)
	}
	for body, want := range map[string]string{
		`{}`:                "At least one field",
		`{"is_dead":"yes"}`: "boolean",
		`{"colour":"red"}`:  "Unsupported fields",
		`{"is_dead":`:       "Invalid JSON",
	} {
		rp := do(t, "PUT", r.base+"/workers/"+id, strings.NewReader(body))
		expectStatus(t, "update "+body, rp, 400)
		if !strings.Contains(rp.errorText(t), want) {
			t.Fatalf("update %s: error %q lacks %q", body, rp.errorText(t), want)
		}
	}
	expectStatus(t, "wrong method", r.post("/list_workers", ""), 405)

	rp = r.get("/v1/models")
	expectStatus(t, "models", rp, 200)
	if data := rp.json(t)["data"].([]any); len(data) != 1 {
		t.Fatalf("models union of two workers with one model id: %s", rp.body)
	}

	expectStatus(t, "delete b", do(t, "DELETE", r.base+"/workers/"+id, nil), 200)
	expectStatus(t, "delete b again", do(t, "DELETE", r.base+"/workers/"+id, nil), 404)
	expectStatus(t, "remove a", r.post("/remove_worker?url="+ws[0].URL(), ""), 200)
	expectStatus(t, "remove a again", r.post("/remove_worker?url="+ws[0].URL(), ""), 404)
	if n := len(r.get("/workers").json(t)["workers"].([]any)); n != 0 {
		t.Fatalf("%d workers left", n)
	}
}

func TestLeastRequestSpreadsABatch(t *testing.T) {
	// Each job takes 400 ms, far longer than it takes to send all eight.
	ws := startWorkers(t, fakeworker.Config{Name: "a", UnitMs: 100}, fakeworker.Config{Name: "b", UnitMs: 100})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n policy least_request\n}")
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			rp := r.post("/v1/images/generations", `{"response_format":"b64_json","prompt":"a cat","size":"1024x1024","num_inference_steps":4}`)
			if rp.status != 200 {
				t.Errorf("status %d: %s", rp.status, rp.body)
			}
		})
	}
	wg.Wait()
	if a, b := ws[0].Stats().Jobs, ws[1].Stats().Jobs; a != 4 || b != 4 {
		t.Fatalf("8 concurrent jobs on 2 workers split %d/%d", a, b)
	}
	for _, w := range r.get("/workers").json(t)["workers"].([]any) {
		if n := w.(map[string]any)["active_requests"]; n != 0.0 {
			t.Fatalf("active_requests %v after the batch", n)
		}
	}
}

func TestLargeResponseStreamsIntact(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "big", ImageBytes: 15 << 20})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n}")
	direct := do(t, "POST", ws[0].URL()+"/v1/images/generations", strings.NewReader(smallImage))
	proxied := r.post("/v1/images/generations", smallImage)
	expectStatus(t, "20 MB image", proxied, 200)
	if len(proxied.body) < 20<<20 {
		t.Fatalf("response is %d bytes; want over 20 MiB", len(proxied.body))
	}
	b64 := func(rp reply) string { return rp.json(t)["data"].([]any)[0].(map[string]any)["b64_json"].(string) }
	if b64(proxied) != b64(direct) {
		t.Fatal("the image arrived changed")
	}
}

func TestRegisteredWorkersSurviveReload(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "static"}, fakeworker.Config{Name: "joined"})
	r := startRouter(t, "diffusion_router {\n workers "+ws[0].URL()+"\n}")
	expectStatus(t, "register", r.post("/workers", `{"url":"`+ws[1].URL()+`"}`), 200)

	r.load("diffusion_router {\n workers " + ws[0].URL() + "\n policy round_robin\n}")
	r.load("diffusion_router {\n policy round_robin\n}")

	rp := r.get("/list_workers")
	if urls := rp.json(t)["urls"].([]any); len(urls) != 1 || urls[0] != ws[1].URL() {
		t.Fatalf("after reloads the pool holds %s; want only the registered worker", rp.body)
	}
	for range 3 {
		rp := r.post("/v1/images/generations", smallImage)
		expectStatus(t, "after reload", rp, 200)
		if rp.header.Get("X-Fake-Worker") != "joined" {
			t.Fatalf("served by %q", rp.header.Get("X-Fake-Worker"))
		}
	}
}

func TestValidateStartsNothing(t *testing.T) {
	// The worker is a bare listener that counts the connections made to it.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	conns := make(chan net.Conn, 100)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				close(conns)
				return
			}
			conns <- c
		}
	}()
	worker := "http://" + ln.Addr().String()
	cfgJSON, err := adaptSite(freePort(t), "", "diffusion_router validate-pool {\n workers "+worker+"\n}")
	if err != nil {
		t.Fatal(err)
	}
	var cfg caddy.Config
	if err := json.Unmarshal(cfgJSON, &cfg); err != nil {
		t.Fatal(err)
	}
	before := packageGoroutines()
	if err := caddy.Validate(&cfg); err != nil {
		t.Fatal(err)
	}
	waitNoNewPackageGoroutines(t, "caddy validate", before)

	// Connections are accepted in the order they were made: once the
	// test's own arrives, any the router made has been counted.
	mine, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer mine.Close()
	for c := range conns {
		c.Close()
		if c.RemoteAddr().String() == mine.LocalAddr().String() {
			break
		}
		t.Errorf("caddy validate connected to the worker, from %s", c.RemoteAddr())
	}

	p, _ := loadPool("validate-pool")
	defer releasePool("validate-pool")
	if len(p.snapshot()) != 0 {
		t.Fatal("validating a config left its pool behind")
	}
}

func TestUpstreamTimeout(t *testing.T) {
	// A 1024² 4-step job takes 40 s on this worker: far past the limit.
	ws := startWorkers(t, fakeworker.Config{Name: "slow", UnitMs: 10_000})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n upstream_timeout 300ms\n}")
	rp := r.post("/v1/images/generations", `{"response_format":"b64_json","prompt":"a cat","size":"1024x1024","num_inference_steps":4}`)
	expectStatus(t, "slow worker", rp, 504)
	if !strings.Contains(rp.errorText(t), "upstream_timeout") {
		t.Fatalf("504 error: %s", rp.body)
	}
	if n := r.get("/workers").json(t)["workers"].([]any)[0].(map[string]any)["active_requests"]; n != 0.0 {
		t.Fatalf("active_requests %v after the timeout", n)
	}
}

func TestWorkerErrorsPassThrough(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "flaky", FailRate: 1})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n}")
	rp := r.post("/v1/images/generations", smallImage)
	direct := do(t, "POST", ws[0].URL()+"/v1/images/generations", strings.NewReader(smallImage))
	if rp.status != 500 || direct.status != 500 || string(rp.body) != string(direct.body) ||
		rp.header.Get("Content-Type") != direct.header.Get("Content-Type") {
		t.Fatalf("worker's 500 %s became %d %s", direct.body, rp.status, rp.body)
	}
	const rollout = `{"prompt":"a cat","width":64,"height":64,"num_inference_steps":2,"seed":1}`
	rp = r.post("/rollout/generate", rollout)
	direct = do(t, "POST", ws[0].URL()+"/rollout/generate", strings.NewReader(rollout))
	if rp.status != 500 || direct.status != 500 || rp.json(t)["detail"] != direct.json(t)["detail"] {
		t.Fatalf("worker's 500 %s became %d %s", direct.body, rp.status, rp.body)
	}
}

func TestBadCostFieldsAreRefusedBeforeAnyWorker(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "w"}, fakeworker.Config{Name: "v", TaskType: "T2V"})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n}")
	for path, body := range map[string]string{
		"/v1/images/generations": `{"prompt":"x","size":"abc"}`,
		"/v1/diffusion/generate": `{"prompt":"x","num_inference_steps":-4}`,
		"/rollout/generate":      `{"prompt":"x","width":"wide"}`,
		"/v1/videos":             `{"prompt":"x","num_frames":0}`,
	} {
		rp := r.post(path, body)
		expectStatus(t, path+" "+body, rp, 400)
		if msg := rp.errorText(t); !strings.Contains(msg, "size") && !strings.Contains(msg, "num_inference_steps") &&
			!strings.Contains(msg, "width") && !strings.Contains(msg, "num_frames") {
			t.Fatalf("%s: error %q names no field", path, msg)
		}
	}
	body, ctype := multipartEdit(t)
	rp := r.post("/v1/images/edits", strings.Replace(body, "256x256", "256 by 256", 1), "Content-Type", ctype)
	expectStatus(t, "multipart with a bad size", rp, 400)
	if ws[0].Stats().Jobs+ws[1].Stats().Jobs != 0 {
		t.Fatal("a refused request reached a worker")
	}
	expectStatus(t, "good request after bad ones", r.post("/v1/images/generations", smallImage), 200)
}

func TestFullQueueAnswers429(t *testing.T) {
	// One worker busy for 4 s; one job may wait; the third is refused.
	ws := startWorkers(t, fakeworker.Config{Name: "w", UnitMs: 1000})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n max_queue 1\n}")
	slow := `{"response_format":"b64_json","prompt":"a cat","size":"1024x1024","num_inference_steps":4}`
	running := busyWith(t, r, ws[0].URL(), slow)
	var wg sync.WaitGroup
	wg.Go(func() { r.post("/v1/images/generations", slow) })
	waitFor(t, func() bool { return r.get("/health").json(t)["queued_requests"] == 1.0 })
	rp := r.post("/v1/images/generations", smallImage)
	expectStatus(t, "third job", rp, 429)
	if !strings.Contains(rp.errorText(t), "max_queue") || rp.header.Get("Retry-After") == "" {
		t.Fatalf("429 answer: %s %v", rp.body, rp.header)
	}
	ws[0].Close() // end the test without waiting 8 s for the jobs
	wg.Wait()
	<-running
}

// waitFor polls cond until it holds, for at most 10 s.
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition never held")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitUntilOr polls cond every few milliseconds until it holds or d has
// passed, and reports whether it held.
func waitUntilOr(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(5 * time.Millisecond)
	}
	return true
}

func TestVideoJobKeepsItsWorkerUntilDone(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "v", TaskType: "T2V", UnitMs: 50})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n}")
	active := func() any { return r.get("/workers").json(t)["workers"].([]any)[0].(map[string]any)["active_requests"] }

	// The router learns that a video ended from a status poll.
	id := createVideo(t, r, "v")
	if got := active(); got != 1.0 {
		t.Fatalf("active_requests %v before any poll saw the video end; want 1", got)
	}
	waitVideo(t, r, id)
	if got := active(); got != 0.0 {
		t.Fatalf("active_requests %v after the video completed; want 0", got)
	}

	id = createVideo(t, r, "v")
	expectStatus(t, "delete running video", do(t, "DELETE", r.base+"/v1/videos/"+id, nil), 200)
	if got := active(); got != 0.0 {
		t.Fatalf("active_requests %v after the video was deleted; want 0", got)
	}
}
