package diffusionrouter_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	diffusionrouter "github.com/miles-rollout/miles-diffusion-router"
	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/msgpack"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// TestMain keeps Caddy's files out of the user's home.
func TestMain(m *testing.M) { os.Exit(testrouter.Main(m, "diffusionrouter-test")) }

// The headers the router's HTTP API names, written out so that a test pins
// them rather than whatever the code calls them.
const (
	weightVersionHeader = "X-Weight-Version"
	requestIDHeader     = "X-Request-Id"
)

func TestForwardsEveryEndpoint(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "img"}, fakeworker.Config{Name: "vid", TaskType: "T2V"})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")

	rp := r.Post("/v1/images/generations", testrouter.SmallImage)
	testrouter.ExpectStatus(t, "images/generations", rp, 200)
	if rp.Header.Get("X-Fake-Worker") != "img" {
		t.Fatalf("image job served by %q; want the image worker", rp.Header.Get("X-Fake-Worker"))
	}
	if data, _ := rp.JSON(t)["data"].([]any); len(data) != 1 {
		t.Fatalf("images/generations answered %.200s", rp.Body)
	}

	body, ctype := multipartEdit(t)
	testrouter.ExpectStatus(t, "images/edits", r.Post("/v1/images/edits", body, "Content-Type", ctype), 200)
	testrouter.ExpectStatus(t, "diffusion/generate", r.Post("/v1/diffusion/generate", testrouter.SmallImage), 200)

	rp = r.Post("/rollout/generate", `{"prompt":"a cat","width":64,"height":64,"num_inference_steps":2,"seed":7}`)
	testrouter.ExpectStatus(t, "rollout/generate", rp, 200)
	decoded, err := msgpack.Unmarshal(rp.Body)
	if samples, _ := decoded.([]any); err != nil || len(samples) != 1 || samples[0].(map[string]any)["seed"] != int64(7) ||
		rp.Header.Get("Content-Type") != "application/msgpack" {
		t.Fatalf("rollout/generate body is not the worker's msgpack list: %.200q (%v)", rp.Body, err)
	}
	if v := rp.Header.Get(weightVersionHeader); v != "fake/diffusion-model" {
		t.Fatalf("rollout/generate served on %q; want the model id", v)
	}

	testrouter.ExpectStatus(t, "model_info", r.Get("/model_info"), 200)

	id := createVideo(t, r, "vid")
	waitVideo(t, r, id)
	rp = r.Get("/v1/videos/" + id + "/content")
	testrouter.ExpectStatus(t, "video content", rp, 200)
	if rp.Header.Get("Content-Type") != "video/mp4" || len(rp.Body) == 0 {
		t.Fatalf("video content: %s, %d bytes", rp.Header.Get("Content-Type"), len(rp.Body))
	}
	testrouter.ExpectStatus(t, "delete video", testrouter.Do(t, "DELETE", r.Base+"/v1/videos/"+id, nil), 200)
	rp = r.Get("/v1/videos/" + id)
	testrouter.ExpectStatus(t, "deleted video", rp, 404)
	if msg := rp.ErrorText(t); msg != "Unknown video_id" {
		t.Fatalf("deleted video: %q", msg)
	}
}

func multipartEdit(t *testing.T) (string, string) {
	t.Helper()
	return testkit.MultipartForm([]byte("\x89PNG fake image bytes"), "prompt", "make it blue", "size", "256x256", "num_inference_steps", "2")
}

// createVideo starts a video job and checks which worker took it.
func createVideo(t *testing.T, r *testrouter.Router, wantWorker string) string {
	t.Helper()
	rp := r.Post("/v1/videos", `{"prompt":"a dog","size":"64x64","num_frames":2,"num_inference_steps":2}`)
	if rp.Status != 200 {
		t.Fatalf("create video: status %d; body %.300s; workers %s", rp.Status, rp.Body, r.Get("/workers").Body)
	}
	if wantWorker != "" && rp.Header.Get("X-Fake-Worker") != wantWorker {
		t.Fatalf("video job made by %q; want %q", rp.Header.Get("X-Fake-Worker"), wantWorker)
	}
	id, _ := rp.JSON(t)["id"].(string)
	if id == "" {
		t.Fatalf("no job id in %s", rp.Body)
	}
	return id
}

func waitVideo(t *testing.T, r *testrouter.Router, id string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		rp := r.Get("/v1/videos/" + id)
		testrouter.ExpectStatus(t, "poll video", rp, 200)
		if rp.JSON(t)["status"] == "completed" {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("video %s never completed", id)
}

func TestVideoJobsStayWithTheirWorker(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "v1", TaskType: "T2V"}, fakeworker.Config{Name: "v2", TaskType: "TI2V"})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n policy round_robin\n}")
	made := map[string]string{}
	for range 6 {
		rp := r.Post("/v1/videos", `{"prompt":"a dog","size":"64x64","num_frames":2,"num_inference_steps":2}`)
		testrouter.ExpectStatus(t, "create video", rp, 200)
		made[rp.JSON(t)["id"].(string)] = rp.Header.Get("X-Fake-Worker")
	}
	if len(made) != 6 {
		t.Fatalf("job ids %v", made)
	}
	for id, creator := range made {
		for _, path := range []string{"/v1/videos/" + id, "/v1/videos/" + id} {
			if got := r.Get(path).Header.Get("X-Fake-Worker"); got != creator {
				t.Fatalf("GET %s reached %q; the job was made by %q", path, got, creator)
			}
		}
	}
	rp := r.Get("/v1/videos/video_nobody_made/content")
	testrouter.ExpectStatus(t, "unknown video", rp, 404)
	if rp.ErrorText(t) != "Unknown video_id" {
		t.Fatalf("unknown video: %s", rp.Body)
	}
}

func TestVideoNeedsVideoCapableWorker(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "img"})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	rp := r.Post("/v1/videos", `{"prompt":"a dog"}`)
	testrouter.ExpectStatus(t, "video on image-only pool", rp, 400)
	if !strings.Contains(rp.ErrorText(t), "video-capable") {
		t.Fatalf("error %q does not say video-capable", rp.ErrorText(t))
	}
	if ws[0].Stats().Jobs != 0 {
		t.Fatal("the image worker was sent a video job")
	}
}

func TestHealthFollowsServingWorkers(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "w"})
	r := testrouter.Start(t, "diffusion_router {\n queue_timeout 300ms\n}")

	rp := r.Get("/health")
	testrouter.ExpectStatus(t, "health with no workers", rp, 503)
	if h := rp.JSON(t); h["status"] != "unhealthy" || h["total_workers"] != 0.0 {
		t.Fatalf("health: %s", rp.Body)
	}
	rp = r.Post("/v1/images/generations", testrouter.SmallImage)
	testrouter.ExpectStatus(t, "generation with no workers", rp, 503)
	if rp.ErrorText(t) != "No healthy workers available in the pool" {
		t.Fatalf("no workers: %s", rp.Body)
	}

	testrouter.ExpectStatus(t, "register", r.Post("/workers", `{"url":"`+ws[0].URL()+`"}`), 200)
	rp = r.Get("/health")
	testrouter.ExpectStatus(t, "health with a worker", rp, 200)
	want := map[string]any{"status": "healthy", "healthy_workers": 1.0, "total_workers": 1.0, "dead_workers": 0.0, "sleeping_workers": 0.0}
	for k, v := range want {
		if got := rp.JSON(t)[k]; got != v {
			t.Fatalf("health %s = %v, want %v", k, got, v)
		}
	}
	testrouter.ExpectStatus(t, "generation", r.Post("/v1/images/generations", testrouter.SmallImage), 200)

	id := url.QueryEscape(ws[0].URL())
	testrouter.ExpectStatus(t, "mark dead", testrouter.Do(t, "PUT", r.Base+"/workers/"+id, strings.NewReader(`{"is_dead":true}`)), 200)
	testrouter.ExpectStatus(t, "health with a dead worker", r.Get("/health"), 503)
	// The job waits in the queue for the worker to come back, up to queue_timeout.
	rp = r.Post("/v1/images/generations", testrouter.SmallImage)
	testrouter.ExpectStatus(t, "generation on a dead pool", rp, 503)
	if !strings.Contains(rp.ErrorText(t), "queue") || rp.Header.Get("Retry-After") == "" {
		t.Fatalf("queue timeout answer: %s %v", rp.Body, rp.Header)
	}
	if ws[0].Stats().Jobs != 1 {
		t.Fatalf("dead worker got jobs: %d", ws[0].Stats().Jobs)
	}
}

func TestBadRequestsAreRefusedCleanly(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "w"})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n max_body 4KiB\n}")

	rp := r.Post("/v1/images/generations", `{"prompt": "a cat",`)
	testrouter.ExpectStatus(t, "invalid JSON", rp, 400)
	if rp.ErrorText(t) != "Invalid JSON body" {
		t.Fatalf("invalid JSON: %s", rp.Body)
	}

	big := `{"prompt":"` + strings.Repeat("x", 8<<10) + `"}`
	rp = r.Post("/v1/images/generations", big)
	testrouter.ExpectStatus(t, "body over max_body", rp, 413)
	if !strings.Contains(rp.ErrorText(t), "max_body") {
		t.Fatalf("413 error: %s", rp.Body)
	}
	// Without a Content-Length the limit is found while reading.
	rp = testrouter.Do(t, "POST", r.Base+"/v1/images/generations", io.MultiReader(strings.NewReader(big)))
	testrouter.ExpectStatus(t, "chunked body over max_body", rp, 413)
	body, ctype := multipartEdit(t)
	rp = testrouter.Do(t, "POST", r.Base+"/v1/images/edits", io.MultiReader(strings.NewReader(body+strings.Repeat("x", 8<<10))), "Content-Type", ctype)
	testrouter.ExpectStatus(t, "chunked multipart over max_body", rp, 413)

	if n := ws[0].Stats().Jobs; n != 0 {
		t.Fatalf("a refused request reached the worker (%d jobs)", n)
	}
	testrouter.ExpectStatus(t, "good request after bad ones", r.Post("/v1/images/generations", testrouter.SmallImage), 200)

	// A worker's own 4xx passes through unchanged.
	rp = r.Post("/v1/images/generations", `{"size":"256x256"}`)
	if rp.Status != 422 || rp.Header.Get("X-Fake-Worker") != "w" {
		t.Fatalf("worker's 422 became %d: %s", rp.Status, rp.Body)
	}
}

func TestUnreachableWorker(t *testing.T) {
	dead := "http://127.0.0.1:" + fmt.Sprint(testrouter.Port(t))
	r := testrouter.Start(t, "diffusion_router {\n workers "+dead+"\n max_attempts 2\n}")
	rp := r.Post("/v1/images/generations", testrouter.SmallImage)
	testrouter.ExpectStatus(t, "unreachable worker", rp, 502)
	if !strings.HasPrefix(rp.ErrorText(t), "Worker request failed") {
		t.Fatalf("502 error: %s", rp.Body)
	}
	// With no other worker, the job is tried on this one max_attempts times.
	w := r.Get("/workers/" + url.QueryEscape(dead)).JSON(t)["worker"].(map[string]any)
	if w["consecutive_failures"] != 2.0 || w["active_requests"] != 0.0 {
		t.Fatalf("after a failed connection the worker shows %v", w)
	}
}

func TestFailedConnectionIsRetriedElsewhere(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "live"})
	dead := "http://127.0.0.1:" + fmt.Sprint(testrouter.Port(t))
	r := testrouter.Start(t, "diffusion_router {\n workers "+dead+" "+ws[0].URL()+"\n policy round_robin\n}")
	for i := range 6 {
		rp := r.Post("/v1/images/generations", testrouter.SmallImage)
		testrouter.ExpectStatus(t, fmt.Sprintf("request %d", i), rp, 200)
	}
	if n := ws[0].Stats().Jobs; n != 6 {
		t.Fatalf("live worker served %d of 6", n)
	}
}

func TestControlEndpointsNeedTrust(t *testing.T) {
	t.Setenv("DIFFUSION_ROUTER_TEST_TOKEN", "s3cret")
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "w"})
	r := testrouter.Start(t, "diffusion_router {\n admin_allow 10.0.0.0/8\n admin_token {env.DIFFUSION_ROUTER_TEST_TOKEN}\n}")
	register := `{"url":"` + ws[0].URL() + `"}`

	for _, auth := range []string{"", "Bearer wrong", "Bearer s3cret2", "s3cret"} {
		rp := r.Post("/workers", register, "Authorization", auth)
		testrouter.ExpectStatus(t, "untrusted register with "+auth, rp, 403)
		rp.ErrorText(t)
	}
	for _, path := range []string{"/add_worker?url=" + ws[0].URL(), "/remove_worker?url=" + ws[0].URL()} {
		testrouter.ExpectStatus(t, "untrusted "+path, r.Post(path, ""), 403)
	}
	testrouter.ExpectStatus(t, "untrusted delete", testrouter.Do(t, "DELETE", r.Base+"/workers/x", nil), 403)
	if n := len(r.Get("/workers").JSON(t)["workers"].([]any)); n != 0 {
		t.Fatalf("untrusted calls changed the fleet: %d workers", n)
	}

	rp := r.Post("/workers", register, "Authorization", "Bearer s3cret")
	testrouter.ExpectStatus(t, "register with token", rp, 200)
	testrouter.ExpectStatus(t, "read-only list", r.Get("/list_workers"), 200)
	testrouter.ExpectStatus(t, "generation", r.Post("/v1/images/generations", testrouter.SmallImage), 200)
}

func TestWorkersAPI(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a"}, fakeworker.Config{Name: "b", TaskType: "T2V"})
	r := testrouter.Start(t, "diffusion_router {\n workers "+ws[0].URL()+"\n}")
	b := ws[1].URL()

	rp := r.Post("/workers?worker_url="+b, "")
	testrouter.ExpectStatus(t, "register b", rp, 200)
	w := rp.JSON(t)["worker"].(map[string]any)
	if w["url"] != b || w["worker_id"] != url.QueryEscape(b) || w["video_support"] != true || w["display_id"] != strings.TrimPrefix(b, "http://") {
		t.Fatalf("registered worker %v", w)
	}
	testrouter.ExpectStatus(t, "register b again", r.Post("/add_worker?url="+b+"/", ""), 200)
	rp = r.Get("/list_workers")
	if urls := rp.JSON(t)["urls"].([]any); len(urls) != 2 || urls[1] != b {
		t.Fatalf("list_workers: %s", rp.Body)
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
		rp := r.Post("/workers", body)
		testrouter.ExpectStatus(t, "register "+body, rp, 400)
		if !strings.Contains(rp.ErrorText(t), want) {
			t.Fatalf("register %s: error %q lacks %q", body, rp.ErrorText(t), want)
		}
	}

	id := url.QueryEscape(b)
	testrouter.ExpectStatus(t, "get worker", r.Get("/workers/"+id), 200)
	rp = r.Get("/workers/" + url.QueryEscape("http://10.9.9.9:1"))
	testrouter.ExpectStatus(t, "unknown worker", rp, 404)
	if rp.ErrorText(t) != "Worker not found" {
		t.Fatalf("unknown worker: %s", rp.Body)
	}
	for body, want := range map[string]string{
		`{}`:                "At least one field",
		`{"is_dead":"yes"}`: "boolean",
		`{"colour":"red"}`:  "Unsupported fields",
		`{"is_dead":`:       "Invalid JSON",
	} {
		rp := testrouter.Do(t, "PUT", r.Base+"/workers/"+id, strings.NewReader(body))
		testrouter.ExpectStatus(t, "update "+body, rp, 400)
		if !strings.Contains(rp.ErrorText(t), want) {
			t.Fatalf("update %s: error %q lacks %q", body, rp.ErrorText(t), want)
		}
	}
	testrouter.ExpectStatus(t, "wrong method", r.Post("/list_workers", ""), 405)

	rp = r.Get("/v1/models")
	testrouter.ExpectStatus(t, "models", rp, 200)
	if data := rp.JSON(t)["data"].([]any); len(data) != 1 {
		t.Fatalf("models union of two workers with one model id: %s", rp.Body)
	}

	testrouter.ExpectStatus(t, "delete b", testrouter.Do(t, "DELETE", r.Base+"/workers/"+id, nil), 200)
	testrouter.ExpectStatus(t, "delete b again", testrouter.Do(t, "DELETE", r.Base+"/workers/"+id, nil), 404)
	testrouter.ExpectStatus(t, "remove a", r.Post("/remove_worker?url="+ws[0].URL(), ""), 200)
	testrouter.ExpectStatus(t, "remove a again", r.Post("/remove_worker?url="+ws[0].URL(), ""), 404)
	if n := len(r.Get("/workers").JSON(t)["workers"].([]any)); n != 0 {
		t.Fatalf("%d workers left", n)
	}
}

func TestLeastRequestSpreadsABatch(t *testing.T) {
	// Each job takes 400 ms, far longer than it takes to send all eight.
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a", UnitMs: 100}, fakeworker.Config{Name: "b", UnitMs: 100})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n policy least_request\n}")
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			rp := r.Post("/v1/images/generations", `{"response_format":"b64_json","prompt":"a cat","size":"1024x1024","num_inference_steps":4}`)
			if rp.Status != 200 {
				t.Errorf("status %d: %s", rp.Status, rp.Body)
			}
		})
	}
	wg.Wait()
	if a, b := ws[0].Stats().Jobs, ws[1].Stats().Jobs; a != 4 || b != 4 {
		t.Fatalf("8 concurrent jobs on 2 workers split %d/%d", a, b)
	}
	for _, w := range r.Get("/workers").JSON(t)["workers"].([]any) {
		if n := w.(map[string]any)["active_requests"]; n != 0.0 {
			t.Fatalf("active_requests %v after the batch", n)
		}
	}
}

func TestLargeResponseStreamsIntact(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "big", ImageBytes: 15 << 20})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	direct := testrouter.Do(t, "POST", ws[0].URL()+"/v1/images/generations", strings.NewReader(testrouter.SmallImage))
	proxied := r.Post("/v1/images/generations", testrouter.SmallImage)
	testrouter.ExpectStatus(t, "20 MB image", proxied, 200)
	if len(proxied.Body) < 20<<20 {
		t.Fatalf("response is %d bytes; want over 20 MiB", len(proxied.Body))
	}
	b64 := func(rp testrouter.Reply) string {
		return rp.JSON(t)["data"].([]any)[0].(map[string]any)["b64_json"].(string)
	}
	if b64(proxied) != b64(direct) {
		t.Fatal("the image arrived changed")
	}
}

func TestRegisteredWorkersSurviveReload(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "static"}, fakeworker.Config{Name: "joined"})
	r := testrouter.Start(t, "diffusion_router {\n workers "+ws[0].URL()+"\n}")
	testrouter.ExpectStatus(t, "register", r.Post("/workers", `{"url":"`+ws[1].URL()+`"}`), 200)

	r.Load("diffusion_router {\n workers " + ws[0].URL() + "\n policy round_robin\n}")
	r.Load("diffusion_router {\n policy round_robin\n}")

	rp := r.Get("/list_workers")
	if urls := rp.JSON(t)["urls"].([]any); len(urls) != 1 || urls[0] != ws[1].URL() {
		t.Fatalf("after reloads the pool holds %s; want only the registered worker", rp.Body)
	}
	for range 3 {
		rp := r.Post("/v1/images/generations", testrouter.SmallImage)
		testrouter.ExpectStatus(t, "after reload", rp, 200)
		if rp.Header.Get("X-Fake-Worker") != "joined" {
			t.Fatalf("served by %q", rp.Header.Get("X-Fake-Worker"))
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
	// It is etcd too: validating a config with `ha etcd` campaigns nowhere.
	cfgJSON, err := testrouter.AdaptSite(testrouter.Port(t), "", "diffusion_router validate-pool {\n workers "+worker+"\n ha etcd "+worker+"\n}")
	if err != nil {
		t.Fatal(err)
	}
	var cfg caddy.Config
	if err := json.Unmarshal(cfgJSON, &cfg); err != nil {
		t.Fatal(err)
	}
	before := testrouter.RouterGoroutines()
	if err := caddy.Validate(&cfg); err != nil {
		t.Fatal(err)
	}
	testrouter.WaitNoNewRouterGoroutines(t, "caddy validate", before)

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

	if diffusionrouter.PoolHeld("validate-pool") {
		t.Fatal("validating a config left its pool behind")
	}
}

func TestUpstreamTimeout(t *testing.T) {
	// A 1024² 4-step job takes 40 s on this worker: far past the limit.
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "slow", UnitMs: 10_000})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n upstream_timeout 300ms\n}")
	rp := r.Post("/v1/images/generations", `{"response_format":"b64_json","prompt":"a cat","size":"1024x1024","num_inference_steps":4}`)
	testrouter.ExpectStatus(t, "slow worker", rp, 504)
	if !strings.Contains(rp.ErrorText(t), "upstream_timeout") {
		t.Fatalf("504 error: %s", rp.Body)
	}
	if n := r.Get("/workers").JSON(t)["workers"].([]any)[0].(map[string]any)["active_requests"]; n != 0.0 {
		t.Fatalf("active_requests %v after the timeout", n)
	}
}

func TestWorkerErrorsPassThrough(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "flaky", FailRate: 1})
	// The first job's three attempts eject the only worker; the next job
	// waits for its next passed probe, which lets it back on probation.
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n health_interval 500ms\n}")
	rp := r.Post("/v1/images/generations", testrouter.SmallImage)
	direct := testrouter.Do(t, "POST", ws[0].URL()+"/v1/images/generations", strings.NewReader(testrouter.SmallImage))
	if rp.Status != 500 || direct.Status != 500 || string(rp.Body) != string(direct.Body) ||
		rp.Header.Get("Content-Type") != direct.Header.Get("Content-Type") {
		t.Fatalf("worker's 500 %s became %d %s", direct.Body, rp.Status, rp.Body)
	}
	const rollout = `{"prompt":"a cat","width":64,"height":64,"num_inference_steps":2,"seed":1}`
	rp = r.Post("/rollout/generate", rollout)
	direct = testrouter.Do(t, "POST", ws[0].URL()+"/rollout/generate", strings.NewReader(rollout))
	if rp.Status != 500 || direct.Status != 500 || rp.JSON(t)["detail"] != direct.JSON(t)["detail"] {
		t.Fatalf("worker's 500 %s became %d %s", direct.Body, rp.Status, rp.Body)
	}
}

func TestBadCostFieldsAreRefusedBeforeAnyWorker(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "w"}, fakeworker.Config{Name: "v", TaskType: "T2V"})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	for path, body := range map[string]string{
		"/v1/images/generations": `{"prompt":"x","size":"0x512"}`, // one that does not parse the worker ignores
		"/v1/diffusion/generate": `{"prompt":"x","num_inference_steps":-4}`,
		"/rollout/generate":      `{"prompt":"x","width":"wide"}`,
		"/v1/videos":             `{"prompt":"x","num_frames":0}`,
	} {
		rp := r.Post(path, body)
		testrouter.ExpectStatus(t, path+" "+body, rp, 400)
		if msg := rp.ErrorText(t); !strings.Contains(msg, "size") && !strings.Contains(msg, "num_inference_steps") &&
			!strings.Contains(msg, "width") && !strings.Contains(msg, "num_frames") {
			t.Fatalf("%s: error %q names no field", path, msg)
		}
	}
	body, ctype := multipartEdit(t)
	rp := r.Post("/v1/images/edits", strings.Replace(body, "256x256", "256x0", 1), "Content-Type", ctype)
	testrouter.ExpectStatus(t, "multipart with a bad size", rp, 400)
	if ws[0].Stats().Jobs+ws[1].Stats().Jobs != 0 {
		t.Fatal("a refused request reached a worker")
	}
	testrouter.ExpectStatus(t, "good request after bad ones", r.Post("/v1/images/generations", testrouter.SmallImage), 200)
}

func TestFullQueueAnswers429(t *testing.T) {
	// One worker busy for 4 s; one job may wait; the third is refused.
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "w", UnitMs: 1000})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n max_queue 1\n queue_timeout 10s\n}")
	slow := `{"response_format":"b64_json","prompt":"a cat","size":"1024x1024","num_inference_steps":4}`
	running := testrouter.BusyWith(t, r, ws[0].URL(), slow)
	ctx, leave := context.WithCancel(t.Context())
	waiting := postJob(ctx, r, "/v1/images/generations", slow, "")
	testrouter.WaitFor(t, func() bool { return r.Get("/health").JSON(t)["queued_requests"] == 1.0 })
	rp := r.Post("/v1/images/generations", testrouter.SmallImage)
	testrouter.ExpectStatus(t, "third job", rp, 429)
	if !strings.Contains(rp.ErrorText(t), "max_queue") || rp.Header.Get("Retry-After") == "" {
		t.Fatalf("429 answer: %s %v", rp.Body, rp.Header)
	}
	// End the test without waiting 8 s for the jobs: the waiting job's
	// client leaves the queue, and the running one's worker closes.
	leave()
	ws[0].Close()
	<-waiting
	<-running
}

func TestVideoJobKeepsItsWorkerUntilDone(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "v", TaskType: "T2V", UnitMs: 50})
	// A video nobody polls gives its worker back when it is predicted to
	// end: at the default initial_speed this small one would be predicted
	// to end within milliseconds, before a loaded test reads /workers.
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n initial_speed 0.0001\n}")
	active := func() any { return r.Get("/workers").JSON(t)["workers"].([]any)[0].(map[string]any)["active_requests"] }

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
	testrouter.ExpectStatus(t, "delete running video", testrouter.Do(t, "DELETE", r.Base+"/v1/videos/"+id, nil), 200)
	if got := active(); got != 0.0 {
		t.Fatalf("active_requests %v after the video was deleted; want 0", got)
	}
}
