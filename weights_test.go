package diffusionrouter_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
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
func load(t *testing.T, r *testrouter.Router, clients int) (stop func() []sample, answered func(match func(sample) bool) int) {
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
				rp := testrouter.Do(t, "POST", r.Base+"/v1/images/generations", strings.NewReader(`{"response_format":"b64_json","prompt":"x","size":"512x512","num_inference_steps":4}`))
				s.received, s.status, s.version = time.Now(), rp.Status, rp.Header.Get(weightVersionHeader)
				s.worker = rp.Header.Get("X-Fake-Worker")
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
	return testrouter.StartWorkers(t, cfgs...)
}

func TestDrainUpdateUnderLoad(t *testing.T) {
	ws := namedWorkers(t, 4, fakeworker.Config{UnitMs: 20})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	stop, answered := load(t, r, 12)
	all := func(sample) bool { return true }
	testrouter.WaitFor(t, func() bool { return answered(all) >= 12 }) // a round of requests before the update

	start := time.Now()
	rp := r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/step-1","flush_cache":true}`)
	updated := time.Now()
	testrouter.ExpectStatus(t, "update", rp, 200)
	sentAfter := func(s sample) bool { return s.sent.After(updated) }
	testrouter.WaitFor(t, func() bool { return answered(sentAfter) >= 12 }) // and a round after it
	samples := stop()

	body := rp.JSON(t)
	if body["success"] != true || body["weight_version"] != "/ckpt/step-1" || len(body["results"].([]any)) != 4 {
		t.Fatalf("update answered %s", rp.Body)
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
	for u, w := range r.Workers() {
		if w["weight_version"] != "/ckpt/step-1" || w["state"] != "serving" {
			t.Fatalf("%s after the update: %v", u, w)
		}
	}
}

func TestJobsInFlightFinishOnOldWeights(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{UnitMs: 100})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	job := testrouter.BusyWith(t, r, ws[0].URL(), `{"response_format":"b64_json","prompt":"x","size":"1024x1024","num_inference_steps":5}`)
	testrouter.ExpectStatus(t, "update", r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/2","weight_version":"step-2"}`), 200)
	long := <-job
	testrouter.ExpectStatus(t, "job in flight", long, 200)
	if long.Header.Get(weightVersionHeader) != oldVersion {
		t.Fatalf("job in flight when the update came was served by %q", long.Header.Get(weightVersionHeader))
	}
	rp := r.Post("/v1/images/generations", testrouter.SmallImage)
	if rp.Header.Get(weightVersionHeader) != "step-2" {
		t.Fatalf("after the update: %q", rp.Header.Get(weightVersionHeader))
	}
}

func TestRollingUpdateKeepsServing(t *testing.T) {
	ws := namedWorkers(t, 4, fakeworker.Config{UnitMs: 20})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n weights_mode rolling\n}")
	stop, _ := load(t, r, 8)
	answered := make(chan testrouter.Reply)
	go func() { answered <- r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/r"}`) }()
	var rp testrouter.Reply
	maxOut := 0
	for rp.Status == 0 {
		select {
		case rp = <-answered:
		default:
			out := 0
			for _, w := range r.Workers() {
				if w["state"] != "serving" {
					out++
				}
			}
			maxOut = max(maxOut, out)
		}
	}
	samples := stop()
	testrouter.ExpectStatus(t, "rolling update", rp, 200)
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
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "good"}, fakeworker.Config{Name: "bad", UpdateFail: true})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	rp := r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/3"}`)
	testrouter.ExpectStatus(t, "partly failed update", rp, 502)
	if rp.JSON(t)["success"] != false {
		t.Fatalf("answer %s", rp.Body)
	}
	if st := r.Workers()[ws[1].URL()]["state"]; st != "stale" {
		t.Fatalf("failed worker is %v; want stale", st)
	}
	for range 10 {
		rp := r.Post("/v1/images/generations", testrouter.SmallImage)
		if rp.Header.Get("X-Fake-Worker") != "good" || rp.Header.Get(weightVersionHeader) != "/ckpt/3" {
			t.Fatalf("served by %q on %q", rp.Header.Get("X-Fake-Worker"), rp.Header.Get(weightVersionHeader))
		}
	}
}

func TestUpdatesAreSerialised(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{UnitMs: 300})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	testrouter.BusyWith(t, r, ws[0].URL(), `{"response_format":"b64_json","prompt":"x","size":"1024x1024","num_inference_steps":3}`)
	var wg sync.WaitGroup
	var first, second testrouter.Reply
	wg.Go(func() { first = r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/a"}`) })
	testrouter.WaitFor(t, func() bool { return r.Get("/health").JSON(t)["updating_to"] == "/ckpt/a" })
	rp := r.Post("/update_weights_from_disk?wait=false", `{"model_path":"/ckpt/x"}`)
	testrouter.ExpectStatus(t, "update while one runs, wait=false", rp, 409)
	wg.Go(func() { second = r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/b"}`) })
	wg.Wait()
	testrouter.ExpectStatus(t, "first update", first, 200)
	testrouter.ExpectStatus(t, "second update", second, 200)
	if ws[0].Weights() != "/ckpt/b" {
		t.Fatalf("worker ended on %q; the second update runs after the first", ws[0].Weights())
	}
}

func TestDrainTimeoutChangesNothing(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{UnitMs: 500})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n drain_timeout 100ms\n}")
	job := testrouter.BusyWith(t, r, ws[0].URL(), `{"response_format":"b64_json","prompt":"x","size":"1024x1024","num_inference_steps":3}`)
	rp := r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/late"}`)
	testrouter.ExpectStatus(t, "update behind a long job", rp, 504)
	if !strings.Contains(rp.ErrorText(t), "drain_timeout") {
		t.Fatalf("504 answer: %s", rp.Body)
	}
	testrouter.ExpectStatus(t, "the long job", <-job, 200)
	rp = r.Post("/v1/images/generations", testrouter.SmallImage)
	testrouter.ExpectStatus(t, "after the timed-out update", rp, 200)
	if ws[0].Weights() != oldVersion || rp.Header.Get(weightVersionHeader) != oldVersion {
		t.Fatalf("a timed-out update changed the weights to %q", ws[0].Weights())
	}
}

func TestSleepAndWake(t *testing.T) {
	ws := namedWorkers(t, 2, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n queue_timeout 200ms\n}")
	testrouter.ExpectStatus(t, "warm-up", r.Post("/v1/images/generations", testrouter.SmallImage), 200)
	jobs := ws[0].Stats().Jobs + ws[1].Stats().Jobs

	testrouter.ExpectStatus(t, "sleep", r.Post("/release_memory_occupation", `{}`), 200)
	rp := r.Post("/release_memory_occupation", "")
	testrouter.ExpectStatus(t, "sleep again", rp, 200)
	if rp.JSON(t)["message"] != "No eligible workers available in the pool" {
		t.Fatalf("second sleep: %s", rp.Body)
	}
	if h := r.Get("/health"); h.Status != 503 || h.JSON(t)["sleeping_workers"] != 2.0 {
		t.Fatalf("health while asleep: %d %s", h.Status, h.Body)
	}
	testrouter.ExpectStatus(t, "generation while asleep", r.Post("/v1/images/generations", testrouter.SmallImage), 503)
	if n := ws[0].Stats().Jobs + ws[1].Stats().Jobs; n != jobs {
		t.Fatalf("sleeping workers were sent %d jobs", n-jobs)
	}

	testrouter.ExpectStatus(t, "wake", r.Post("/resume_memory_occupation", ""), 200)
	testrouter.ExpectStatus(t, "wake again", r.Post("/resume_memory_occupation", ""), 200)
	testrouter.ExpectStatus(t, "generation after wake", r.Post("/v1/images/generations", testrouter.SmallImage), 200)
}

func TestJoiningWorkerIsBroughtToCurrentWeights(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "first"}, fakeworker.Config{Name: "late"}, fakeworker.Config{Name: "broken", UpdateFail: true})
	r := testrouter.Start(t, "diffusion_router {\n workers "+ws[0].URL()+"\n}")
	testrouter.ExpectStatus(t, "update", r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/7","weight_version":"step-7"}`), 200)

	testrouter.ExpectStatus(t, "register late", r.Post("/workers", `{"url":"`+ws[1].URL()+`"}`), 200)
	testrouter.ExpectStatus(t, "register broken", r.Post("/workers", `{"url":"`+ws[2].URL()+`"}`), 200)
	testrouter.WaitFor(t, func() bool {
		s := r.Workers()
		return s[ws[1].URL()]["state"] == "serving" && s[ws[2].URL()]["state"] == "stale"
	})
	if ws[1].Weights() != "/ckpt/7" || r.Workers()[ws[1].URL()]["weight_version"] != "step-7" {
		t.Fatalf("late worker on %q", ws[1].Weights())
	}
	for range 6 {
		if v := r.Post("/v1/images/generations", testrouter.SmallImage).Header.Get(weightVersionHeader); v != "step-7" {
			t.Fatalf("served by %q", v)
		}
	}
	if ws[2].Stats().Jobs != 0 {
		t.Fatal("the worker that could not load the weights got jobs")
	}
}

func TestRequestedWeightVersion(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	testrouter.ExpectStatus(t, "update", r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/9","weight_version":"step-9"}`), 200)
	rp := r.Post("/v1/images/generations", testrouter.SmallImage, weightVersionHeader, "step-9")
	testrouter.ExpectStatus(t, "current version", rp, 200)
	rp = r.Post("/v1/images/generations", testrouter.SmallImage, weightVersionHeader, "step-8")
	testrouter.ExpectStatus(t, "a version nobody has", rp, 409)
	if !strings.Contains(rp.ErrorText(t), "step-8") {
		t.Fatalf("409 answer: %s", rp.Body)
	}
}

// The weight version a proxied answer names is the router's record, never
// the worker's word (sglang names none): before any update, the model id
// the worker's /v1/models reports, learned before its first job of any
// kind.
func TestWeightVersionIsTheRouters(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "w", ModelPath: "org/model-a"})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	rp := r.Post("/rollout/generate", `{"prompt":"a cat","width":64,"height":64,"num_inference_steps":2,"seed":1}`)
	testrouter.ExpectStatus(t, "first job, a rollout", rp, 200)
	if v := rp.Header.Get(weightVersionHeader); v != "org/model-a" {
		t.Fatalf("the first job was served on %q; want the worker's model id", v)
	}
	if v := r.Get("/health").Header.Get(weightVersionHeader); v != "" {
		t.Fatalf("the router's own answer names %q", v)
	}

	// A worker that names a version itself is not believed.
	liar := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		w.Header().Set(weightVersionHeader, "worker-says")
		switch req.URL.Path {
		case "/v1/models":
			http.Error(w, "no model card", http.StatusInternalServerError)
		default: // JSON, as the rollout API's older form answered
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"status":"ok"}`)
		}
	}))
	t.Cleanup(liar.Close)
	r = testrouter.Start(t, "diffusion_router {\n workers "+liar.URL+"\n}")
	rp = r.Post("/rollout/generate", `{"prompt":"a cat","seed":1}`)
	testrouter.ExpectStatus(t, "job on a worker whose model is unknown", rp, 200)
	if v, ok := rp.Header[weightVersionHeader]; ok {
		t.Fatalf("answer names %q; the router knows no version for it", v)
	}
	testrouter.ExpectStatus(t, "update", r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/1","weight_version":"step-1"}`), 200)
	if v := r.Get("/model_info").Header.Get(weightVersionHeader); v != "step-1" {
		t.Fatalf("after the update: %q", v)
	}
}

func TestBadWeightUpdates(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n weights_path_prefix /ckpt/ s3://bucket/\n}")
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
		`{"model_path":"/ckpt/1","weight_version":"` + strings.Repeat("v", 100_000) + `"}`:         400,
		`{"model_path":"/ckpt/` + strings.Repeat("d", 600) + `"}`:                                  400,
		`{"model_path":"/ckpt/1","weight_version":"step\r\nX-Evil: 1"}`:                            400,
		`{"model_path":"/ckpt/1","weight_version":"step-\u00e9"}`:                                  400,
		`{"model_path":"/ckpt/ok","flush_cache":false,"target_modules":["transformer"],"extra":1}`: 200,
	} {
		rp := r.Post("/update_weights_from_disk", body)
		testrouter.ExpectStatus(t, body, rp, want)
		if want != 200 {
			rp.ErrorText(t)
		}
	}
	if ws[0].Weights() != "/ckpt/ok" {
		t.Fatalf("worker on %q; only the one good update may reach it", ws[0].Weights())
	}
	for _, path := range []string{"/update_weights_from_disk", "/release_memory_occupation", "/resume_memory_occupation"} {
		r.Load("diffusion_router {\n workers " + testrouter.URLs(ws) + "\n admin_allow 10.0.0.0/8\n}")
		testrouter.ExpectStatus(t, "untrusted "+path, r.Post(path, `{"model_path":"/ckpt/1"}`), 403)
	}
	r.Load("diffusion_router") // the worker leaves with the config that listed it
	rp := r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/1"}`)
	testrouter.ExpectStatus(t, "update with no workers", rp, 503)
	if rp.ErrorText(t) != "No healthy workers available in the pool" {
		t.Fatalf("503 answer: %s", rp.Body)
	}
}

// A worker down during an update that comes back at the same URL on its
// old weights is brought to the fleet's weights before its first job, as
// a late joiner is, and then serves. Its catch-up starts when its probes
// pass, with no job coming: it started on the first request, and until
// then the worker showed updating with no call running.
func TestWorkerThatMissedAnUpdateCatchesUpWhenBack(t *testing.T) {
	ws := namedWorkers(t, 2, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n health_interval 50ms\n health_fails 1\n}")
	cfg := ws[1].Config()
	cfg.Addr = strings.TrimPrefix(ws[1].URL(), "http://")
	ws[1].Crash()
	rp := r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/8","weight_version":"step-8"}`)
	if rp.Status != 502 || r.Workers()[ws[1].URL()]["state"] != "stale" {
		t.Fatalf("update with one worker down: %d %s; workers %s", rp.Status, rp.Body, r.Get("/workers").Body)
	}

	back, err := fakeworker.Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(back.Close)
	testrouter.WaitFor(t, func() bool { return r.Workers()[back.URL()]["state"] == "serving" }) // idle
	if back.Weights() != "/ckpt/8" || r.Workers()[back.URL()]["weight_version"] != "step-8" {
		t.Fatalf("the worker came back on %q", back.Weights())
	}
	for range 8 {
		if v := r.Post("/v1/images/generations", testrouter.SmallImage).Header.Get(weightVersionHeader); v != "step-8" {
			t.Fatalf("served by %q", v)
		}
	}
	if jobs := back.Stats().JobsOn; jobs[cfg.ModelPath] != 0 || jobs[""] != 0 {
		t.Fatalf("the worker that came back served jobs on its old weights: %v", jobs)
	}
}

// A catch-up that a worker answers 5xx (its server raised, or it was
// shutting down to restart) is tried again at its next passed probe: a
// worker restarted after a hung update once stayed stale for good when
// the catch-up, queued behind the hung call, was answered 500 as the old
// process stopped.
func TestCatchUpAnswered5xxIsTriedAgain(t *testing.T) {
	ws := namedWorkers(t, 2, fakeworker.Config{})
	target, err := url.Parse(ws[1].URL())
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(target)
	var down atomic.Bool
	var failures atomic.Int64 // catch-up calls still to answer 500
	front := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		switch {
		case down.Load():
			panic(http.ErrAbortHandler) // the connection drops: no answer
		case r.URL.Path == "/update_weights_from_disk" && failures.Add(-1) >= 0:
			http.Error(rw, "Internal Server Error", http.StatusInternalServerError)
		default:
			proxy.ServeHTTP(rw, r)
		}
	}))
	t.Cleanup(front.Close)
	r := testrouter.Start(t, "diffusion_router {\n workers "+ws[0].URL()+" "+front.URL+"\n health_interval 50ms\n health_fails 1\n}")
	down.Store(true)
	rp := r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/8","weight_version":"step-8"}`)
	if rp.Status != 502 || r.Workers()[front.URL]["state"] != "stale" {
		t.Fatalf("update with one worker unreachable: %d %s; workers %s", rp.Status, rp.Body, r.Get("/workers").Body)
	}
	failures.Store(1)
	down.Store(false)
	testrouter.WaitFor(t, func() bool { return r.Workers()[front.URL]["weight_version"] == "step-8" })
	if ws[1].Weights() != "/ckpt/8" || failures.Load() >= 0 {
		t.Fatalf("the worker is on %q after its catch-up; 500s left to answer %d", ws[1].Weights(), failures.Load())
	}
}

// An update never waits on one worker slow to answer its call: the
// workers that loaded the new weights serve at once, on them, while the
// straggler's call is still open.
func TestWorkersUpdatedServeWhileAStragglerLoads(t *testing.T) {
	ws := namedWorkers(t, 3, fakeworker.Config{})
	target, err := url.Parse(ws[2].URL())
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(target)
	release := make(chan struct{})
	straggler := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/update_weights_from_disk" {
			<-release // the call hangs until the test lets it go
		}
		proxy.ServeHTTP(rw, r)
	}))
	t.Cleanup(straggler.Close)
	var once sync.Once
	letGo := func() { once.Do(func() { close(release) }) }
	t.Cleanup(letGo)

	r := testrouter.Start(t, "diffusion_router {\n workers "+ws[0].URL()+" "+ws[1].URL()+" "+straggler.URL+"\n}")
	updated := make(chan testrouter.Reply, 1)
	go func() {
		updated <- r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/10","weight_version":"step-10"}`)
	}()
	testrouter.WaitFor(t, func() bool {
		s := r.Workers()
		return s[ws[0].URL()]["state"] == "serving" && s[ws[1].URL()]["weight_version"] == "step-10" && s[straggler.URL]["state"] == "updating"
	})
	for range 6 {
		rp := r.Post("/v1/images/generations", testrouter.SmallImage)
		testrouter.ExpectStatus(t, "a job while the straggler loads", rp, 200)
		if v := rp.Header.Get(weightVersionHeader); v != "step-10" {
			t.Fatalf("served by %q while the update runs", v)
		}
	}
	select {
	case rp := <-updated:
		t.Fatalf("the update answered before the straggler did: %s", rp.Body)
	default:
	}
	letGo()
	testrouter.ExpectStatus(t, "update", <-updated, 200)
	if ws[2].Weights() != "/ckpt/10" {
		t.Fatalf("the straggler ended on %q", ws[2].Weights())
	}
}
