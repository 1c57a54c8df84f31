package diffusionrouter

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/examples/fakeworker"
)

const oldVersion = "fake/diffusion-model" // the fake workers' initial weights

// sample is one generation of a load test.
type sample struct {
	sent, received time.Time
	status         int
	version        string
	worker         string // the X-Fake-Worker that answered
}

// load keeps clients generation requests in flight until the returned stop
// is called, which reports every request; meanwhile answered counts the
// requests answered so far that match.
func load(t *testing.T, r *testRouter, clients int) (stop func() []sample, answered func(match func(sample) bool) int) {
	t.Helper()
	var (
		mu      sync.Mutex
		samples []sample
		wg      sync.WaitGroup
		done    = make(chan struct{})
	)
	for range clients {
		wg.Go(func() {
			for {
				select {
				case <-done:
					return
				default:
				}
				s := sample{sent: time.Now()}
				rp := do(t, "POST", r.base+"/v1/images/generations", strings.NewReader(`{"response_format":"b64_json","prompt":"x","size":"512x512","num_inference_steps":4}`))
				s.received, s.status, s.version = time.Now(), rp.status, rp.header.Get(weightVersionHeader)
				s.worker = rp.header.Get("X-Fake-Worker")
				mu.Lock()
				samples = append(samples, s)
				mu.Unlock()
			}
		})
	}
	var once sync.Once
	stop = func() []sample {
		once.Do(func() { close(done); wg.Wait() })
		mu.Lock()
		defer mu.Unlock()
		return samples
	}
	t.Cleanup(func() { stop() }) // when the test ends early
	answered = func(match func(sample) bool) int {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, s := range samples {
			if match(s) {
				n++
			}
		}
		return n
	}
	return stop, answered
}

func namedWorkers(t *testing.T, n int, cfg fakeworker.Config) []*fakeworker.Worker {
	t.Helper()
	cfgs := make([]fakeworker.Config, n)
	for i := range cfgs {
		cfgs[i] = cfg
		cfgs[i].Name = string(rune('a' + i))
	}
	return startWorkers(t, cfgs...)
}

func workerStates(t *testing.T, r *testRouter) map[string]map[string]any {
	t.Helper()
	out := map[string]map[string]any{}
	for _, w := range r.get("/workers").json(t)["workers"].([]any) {
		w := w.(map[string]any)
		out[w["url"].(string)] = w
	}
	return out
}

func TestDrainUpdateUnderLoad(t *testing.T) {
	ws := namedWorkers(t, 4, fakeworker.Config{UnitMs: 20})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n}")
	stop, answered := load(t, r, 12)
	all := func(sample) bool { return true }
	waitFor(t, func() bool { return answered(all) >= 12 }) // a round of requests before the update

	start := time.Now()
	rp := r.post("/update_weights_from_disk", `{"model_path":"/ckpt/step-1","flush_cache":true}`)
	updated := time.Now()
	expectStatus(t, "update", rp, 200)
	sentAfter := func(s sample) bool { return s.sent.After(updated) }
	waitFor(t, func() bool { return answered(sentAfter) >= 12 }) // and a round after it
	samples := stop()

	body := rp.json(t)
	if body["success"] != true || body["weight_version"] != "/ckpt/step-1" || len(body["results"].([]any)) != 4 {
		t.Fatalf("update answered %s", rp.body)
	}
	var before, after int
	for _, s := range samples {
		switch {
		case s.status != 200:
			t.Fatalf("a request failed during the update: %d", s.status)
		case s.version != oldVersion && s.version != "/ckpt/step-1":
			t.Fatalf("response from version %q", s.version)
		case s.sent.After(updated) && s.version != "/ckpt/step-1":
			t.Fatal("a request sent after the update answered was served by the old weights")
		case s.received.Before(start):
			before++
		case s.sent.After(updated):
			after++
		}
	}
	if before == 0 || after == 0 {
		t.Fatalf("load did not span the update: %d before, %d after", before, after)
	}
	for _, w := range ws {
		if w.Weights() != "/ckpt/step-1" {
			t.Fatalf("worker on %q", w.Weights())
		}
	}
	for u, w := range workerStates(t, r) {
		if w["weight_version"] != "/ckpt/step-1" || w["state"] != "serving" {
			t.Fatalf("%s after the update: %v", u, w)
		}
	}
}

func TestJobsInFlightFinishOnOldWeights(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{UnitMs: 100})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n}")
	job := busyWith(t, r, ws[0].URL(), `{"response_format":"b64_json","prompt":"x","size":"1024x1024","num_inference_steps":5}`)
	expectStatus(t, "update", r.post("/update_weights_from_disk", `{"model_path":"/ckpt/2","weight_version":"step-2"}`), 200)
	long := <-job
	expectStatus(t, "job in flight", long, 200)
	if long.header.Get(weightVersionHeader) != oldVersion {
		t.Fatalf("job in flight when the update came was served by %q", long.header.Get(weightVersionHeader))
	}
	rp := r.post("/v1/images/generations", smallImage)
	if rp.header.Get(weightVersionHeader) != "step-2" {
		t.Fatalf("after the update: %q", rp.header.Get(weightVersionHeader))
	}
}

func TestRollingUpdateKeepsServing(t *testing.T) {
	ws := namedWorkers(t, 4, fakeworker.Config{UnitMs: 20})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n weights_mode rolling\n}")
	stop, _ := load(t, r, 8)
	answered := make(chan reply)
	go func() { answered <- r.post("/update_weights_from_disk", `{"model_path":"/ckpt/r"}`) }()
	var rp reply
	maxOut := 0
	for rp.status == 0 {
		select {
		case rp = <-answered:
		default:
			out := 0
			for _, w := range workerStates(t, r) {
				if w["state"] != "serving" {
					out++
				}
			}
			maxOut = max(maxOut, out)
		}
	}
	samples := stop()
	expectStatus(t, "rolling update", rp, 200)
	if maxOut > 1 {
		t.Fatalf("%d workers out of service at once; rolling_batch is 1", maxOut)
	}
	for _, s := range samples {
		if s.status != 200 {
			t.Fatalf("a request failed during the rolling update: %d", s.status)
		}
	}
	for _, w := range ws {
		if w.Weights() != "/ckpt/r" {
			t.Fatalf("worker on %q after the rolling update", w.Weights())
		}
	}
}

func TestFailedUpdateKeepsWorkerOut(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "good"}, fakeworker.Config{Name: "bad", UpdateFail: true})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n}")
	rp := r.post("/update_weights_from_disk", `{"model_path":"/ckpt/3"}`)
	expectStatus(t, "partly failed update", rp, 502)
	if rp.json(t)["success"] != false {
		t.Fatalf("answer %s", rp.body)
	}
	if st := workerStates(t, r)[ws[1].URL()]["state"]; st != "stale" {
		t.Fatalf("failed worker is %v; want stale", st)
	}
	for range 10 {
		rp := r.post("/v1/images/generations", smallImage)
		if rp.header.Get("X-Fake-Worker") != "good" || rp.header.Get(weightVersionHeader) != "/ckpt/3" {
			t.Fatalf("served by %q on %q", rp.header.Get("X-Fake-Worker"), rp.header.Get(weightVersionHeader))
		}
	}
}

func TestUpdatesAreSerialised(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{UnitMs: 300})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n}")
	busyWith(t, r, ws[0].URL(), `{"response_format":"b64_json","prompt":"x","size":"1024x1024","num_inference_steps":3}`)
	var wg sync.WaitGroup
	var first, second reply
	wg.Go(func() { first = r.post("/update_weights_from_disk", `{"model_path":"/ckpt/a"}`) })
	waitFor(t, func() bool { return r.get("/health").json(t)["updating_to"] == "/ckpt/a" })
	rp := r.post("/update_weights_from_disk?wait=false", `{"model_path":"/ckpt/x"}`)
	expectStatus(t, "update while one runs, wait=false", rp, 409)
	wg.Go(func() { second = r.post("/update_weights_from_disk", `{"model_path":"/ckpt/b"}`) })
	wg.Wait()
	expectStatus(t, "first update", first, 200)
	expectStatus(t, "second update", second, 200)
	if ws[0].Weights() != "/ckpt/b" {
		t.Fatalf("worker ended on %q; the second update runs after the first", ws[0].Weights())
	}
}

func TestDrainTimeoutChangesNothing(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{UnitMs: 500})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n drain_timeout 100ms\n}")
	job := busyWith(t, r, ws[0].URL(), `{"response_format":"b64_json","prompt":"x","size":"1024x1024","num_inference_steps":3}`)
	rp := r.post("/update_weights_from_disk", `{"model_path":"/ckpt/late"}`)
	expectStatus(t, "update behind a long job", rp, 504)
	if !strings.Contains(rp.errorText(t), "drain_timeout") {
		t.Fatalf("504 answer: %s", rp.body)
	}
	expectStatus(t, "the long job", <-job, 200)
	rp = r.post("/v1/images/generations", smallImage)
	expectStatus(t, "after the timed-out update", rp, 200)
	if ws[0].Weights() != oldVersion || rp.header.Get(weightVersionHeader) != oldVersion {
		t.Fatalf("a timed-out update changed the weights to %q", ws[0].Weights())
	}
}

func TestSleepAndWake(t *testing.T) {
	ws := namedWorkers(t, 2, fakeworker.Config{})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n queue_timeout 200ms\n}")
	expectStatus(t, "warm-up", r.post("/v1/images/generations", smallImage), 200)
	jobs := ws[0].Stats().Jobs + ws[1].Stats().Jobs

	expectStatus(t, "sleep", r.post("/release_memory_occupation", `{}`), 200)
	rp := r.post("/release_memory_occupation", "")
	expectStatus(t, "sleep again", rp, 200)
	if rp.json(t)["message"] != "No eligible workers available in the pool" {
		t.Fatalf("second sleep: %s", rp.body)
	}
	if h := r.get("/health"); h.status != 503 || h.json(t)["sleeping_workers"] != 2.0 {
		t.Fatalf("health while asleep: %d %s", h.status, h.body)
	}
	expectStatus(t, "generation while asleep", r.post("/v1/images/generations", smallImage), 503)
	if n := ws[0].Stats().Jobs + ws[1].Stats().Jobs; n != jobs {
		t.Fatalf("sleeping workers were sent %d jobs", n-jobs)
	}

	expectStatus(t, "wake", r.post("/resume_memory_occupation", ""), 200)
	expectStatus(t, "wake again", r.post("/resume_memory_occupation", ""), 200)
	expectStatus(t, "generation after wake", r.post("/v1/images/generations", smallImage), 200)
}

func TestJoiningWorkerIsBroughtToCurrentWeights(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "first"}, fakeworker.Config{Name: "late"}, fakeworker.Config{Name: "broken", UpdateFail: true})
	r := startRouter(t, "diffusion_router {\n workers "+ws[0].URL()+"\n}")
	expectStatus(t, "update", r.post("/update_weights_from_disk", `{"model_path":"/ckpt/7","weight_version":"step-7"}`), 200)

	expectStatus(t, "register late", r.post("/workers", `{"url":"`+ws[1].URL()+`"}`), 200)
	expectStatus(t, "register broken", r.post("/workers", `{"url":"`+ws[2].URL()+`"}`), 200)
	waitFor(t, func() bool {
		s := workerStates(t, r)
		return s[ws[1].URL()]["state"] == "serving" && s[ws[2].URL()]["state"] == "stale"
	})
	if ws[1].Weights() != "/ckpt/7" || workerStates(t, r)[ws[1].URL()]["weight_version"] != "step-7" {
		t.Fatalf("late worker on %q", ws[1].Weights())
	}
	for range 6 {
		if v := r.post("/v1/images/generations", smallImage).header.Get(weightVersionHeader); v != "step-7" {
			t.Fatalf("served by %q", v)
		}
	}
	if ws[2].Stats().Jobs != 0 {
		t.Fatal("the worker that could not load the weights got jobs")
	}
}

func TestRequestedWeightVersion(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n}")
	expectStatus(t, "update", r.post("/update_weights_from_disk", `{"model_path":"/ckpt/9","weight_version":"step-9"}`), 200)
	rp := r.post("/v1/images/generations", smallImage, weightVersionHeader, "step-9")
	expectStatus(t, "current version", rp, 200)
	rp = r.post("/v1/images/generations", smallImage, weightVersionHeader, "step-8")
	expectStatus(t, "a version nobody has", rp, 409)
	if !strings.Contains(rp.errorText(t), "step-8") {
		t.Fatalf("409 answer: %s", rp.body)
	}
}

// The weight version a proxied answer names is the router's record, never
// the worker's word (sglang names none): before any update, the model id
// the worker's /v1/models reports, learned before its first job of any
// kind.
func TestWeightVersionIsTheRouters(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "w", ModelPath: "org/model-a"})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n}")
	rp := r.post("/rollout/generate", `{"prompt":"a cat","width":64,"height":64,"num_inference_steps":2,"seed":1}`)
	expectStatus(t, "first job, a rollout", rp, 200)
	if v := rp.header.Get(weightVersionHeader); v != "org/model-a" {
		t.Fatalf("the first job was served on %q; want the worker's model id", v)
	}
	if v := r.get("/health").header.Get(weightVersionHeader); v != "" {
		t.Fatalf("the router's own answer names %q", v)
	}

	// A worker that names a version itself is not believed.
	liar := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		w.Header().Set(weightVersionHeader, "worker-says")
		switch req.URL.Path {
		case "/v1/models":
			http.Error(w, "no model card", http.StatusInternalServerError)
		default:
			_, _ = io.WriteString(w, `{"status":"ok"}`)
		}
	}))
	t.Cleanup(liar.Close)
	r = startRouter(t, "diffusion_router {\n workers "+liar.URL+"\n}")
	rp = r.post("/rollout/generate", `{"prompt":"a cat","seed":1}`)
	expectStatus(t, "job on a worker whose model is unknown", rp, 200)
	if v, ok := rp.header[weightVersionHeader]; ok {
		t.Fatalf("answer names %q; the router knows no version for it", v)
	}
	expectStatus(t, "update", r.post("/update_weights_from_disk", `{"model_path":"/ckpt/1","weight_version":"step-1"}`), 200)
	if v := r.get("/model_info").header.Get(weightVersionHeader); v != "step-1" {
		t.Fatalf("after the update: %q", v)
	}
}

func TestBadWeightUpdates(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n weights_path_prefix /ckpt/ s3://bucket/\n}")
	for body, want := range map[string]int{
		`model_path=/ckpt/1`:                   400,
		`[1]`:                                  400,
		`{}`:                                   400,
		`{"model_path":""}`:                    400,
		`{"model_path":5}`:                     400,
		`{"model_path":"/ckpt/../etc/passwd"}`: 400,
		`{"model_path":"/ckpt/a/.."}`:          400,
		`{"model_path":"/ckpt/a\u0000b"}`:      400,
		`{"model_path":"/home/me/model"}`:      403,
		`{"model_path":"/ckpt/1","weight_version":7}`:                                              400,
		`{"model_path":"/ckpt/1","mode":"eventually"}`:                                             400,
		`{"model_path":"s3://other/1"}`:                                                            403,
		`{"model_path":"/ckpt/..hidden/1","mode":"x"}`:                                             400,
		`{"model_path":"/ckpt/ok","flush_cache":false,"target_modules":["transformer"],"extra":1}`: 200,
	} {
		rp := r.post("/update_weights_from_disk", body)
		expectStatus(t, body, rp, want)
		if want != 200 {
			rp.errorText(t)
		}
	}
	if ws[0].Weights() != "/ckpt/ok" {
		t.Fatalf("worker on %q; only the one good update may reach it", ws[0].Weights())
	}
	for _, path := range []string{"/update_weights_from_disk", "/release_memory_occupation", "/resume_memory_occupation"} {
		r.load("diffusion_router {\n workers " + urlsOf(ws) + "\n admin_allow 10.0.0.0/8\n}")
		expectStatus(t, "untrusted "+path, r.post(path, `{"model_path":"/ckpt/1"}`), 403)
	}
	r.load("diffusion_router") // the worker leaves with the config that listed it
	rp := r.post("/update_weights_from_disk", `{"model_path":"/ckpt/1"}`)
	expectStatus(t, "update with no workers", rp, 503)
	if rp.errorText(t) != "No healthy workers available in the pool" {
		t.Fatalf("503 answer: %s", rp.body)
	}
}

// A worker down during an update that comes back at the same URL on its
// old weights is brought to the fleet's weights before its first job, as
// a late joiner is, and then serves.
func TestWorkerThatMissedAnUpdateCatchesUpWhenBack(t *testing.T) {
	ws := namedWorkers(t, 2, fakeworker.Config{})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n health_interval 50ms\n health_fails 1\n}")
	cfg := ws[1].Config()
	cfg.Addr = strings.TrimPrefix(ws[1].URL(), "http://")
	ws[1].Crash()
	rp := r.post("/update_weights_from_disk", `{"model_path":"/ckpt/8","weight_version":"step-8"}`)
	if rp.status != 502 || workerStates(t, r)[ws[1].URL()]["state"] != "stale" {
		t.Fatalf("update with one worker down: %d %s; workers %s", rp.status, rp.body, r.get("/workers").body)
	}

	back, err := fakeworker.Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(back.Close)
	waitFor(t, func() bool {
		r.post("/v1/images/generations", smallImage) // catch-ups start on requests
		return workerStates(t, r)[back.URL()]["state"] == "serving"
	})
	if back.Weights() != "/ckpt/8" || workerStates(t, r)[back.URL()]["weight_version"] != "step-8" {
		t.Fatalf("the worker came back on %q", back.Weights())
	}
	for range 8 {
		if v := r.post("/v1/images/generations", smallImage).header.Get(weightVersionHeader); v != "step-8" {
			t.Fatalf("served by %q", v)
		}
	}
	if jobs := back.Stats().JobsOn; jobs[cfg.ModelPath] != 0 || jobs[""] != 0 {
		t.Fatalf("the worker that came back served jobs on its old weights: %v", jobs)
	}
}
