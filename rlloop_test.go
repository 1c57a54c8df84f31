package diffusionrouter_test

import (
	"fmt"
	"io"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// miles_diffusion's training loop, played on fake engines while its
// rollout sends all along (issue 41, item 6). The trainer moves the
// weights into each engine itself and tells the router what they hold;
// the rollout must get no answer stamped with a version other than the
// weights that made it (stale), and lose no request.

// What miles' rollout does with a request that fails (http_utils._post):
// any error, an answer that is not 2xx included, is tried again 1 s
// later, 60 attempts in all.
const (
	milesAttempts  = 60
	milesRetryWait = time.Second
)

// rolloutAnswer is a 200 the rollout got.
type rolloutAnswer struct {
	sent    time.Time // when the attempt that got it was sent
	version string    // its X-Weight-Version
	weights string    // the weights the fake ran it on (X-Fake-Weights)
	worker  string    // the fake that ran it (X-Fake-Worker)
}

// rolloutClient stands for miles' rollout: goroutines that each send
// /rollout/generate one request after another, as its semaphore lets
// them go, each retried as miles retries it.
type rolloutClient struct {
	mu      sync.Mutex
	answers []rolloutAnswer
	lost    []string // the last error of each request that got no 200
	failed  int      // attempts that got no 200
	stop    chan struct{}
	halt    func()
}

// startRollouts starts the rollout with n requests in flight; it stops
// when the test ends, or at halt.
func startRollouts(t *testing.T, r *testrouter.Router, n int) *rolloutClient {
	c := &rolloutClient{stop: make(chan struct{})}
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			for seq := 0; ; seq++ {
				select {
				case <-c.stop:
					return
				default:
				}
				c.rollout(r, milesRollout(fmt.Sprintf("client %d rollout %d", i, seq), 1000*i+seq, 1, 256))
			}
		})
	}
	var once sync.Once
	c.halt = func() { once.Do(func() { close(c.stop); wg.Wait() }) }
	t.Cleanup(c.halt)
	return c
}

// rollout sends one request until it gets a 200 or runs out of attempts.
func (c *rolloutClient) rollout(r *testrouter.Router, body string) {
	var last string
	for attempt := range milesAttempts {
		if attempt > 0 {
			time.Sleep(milesRetryWait)
		}
		sent := time.Now()
		resp, err := testrouter.Client.Post(r.Base+"/rollout/generate", "application/json", strings.NewReader(body))
		if err != nil {
			last = err.Error()
			c.count(nil)
			continue
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != 200 {
			last = fmt.Sprintf("%d %.200s (%v)", resp.StatusCode, b, err)
			c.count(nil)
			continue
		}
		c.count(&rolloutAnswer{sent, resp.Header.Get(weightVersionHeader), resp.Header.Get(fakeworker.WeightsHeader), resp.Header.Get("X-Fake-Worker")})
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.lost = append(c.lost, last)
}

// count records an attempt: its answer, or nil when it got no 200.
func (c *rolloutClient) count(a *rolloutAnswer) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if a == nil {
		c.failed++
		return
	}
	c.answers = append(c.answers, *a)
}

// answeredSince counts the answers to attempts sent after since.
func (c *rolloutClient) answeredSince(since time.Time) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, a := range c.answers {
		if a.sent.After(since) {
			n++
		}
	}
	return n
}

// failures counts the attempts that got no 200 so far.
func (c *rolloutClient) failures() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.failed
}

// expectNoneStaleOrLost stops the rollout and fails t for each request
// lost and each answer whose version names other weights than the fake
// ran it on; weightsOf gives the weights of each version. It returns the
// answers.
func (c *rolloutClient) expectNoneStaleOrLost(t *testing.T, weightsOf map[string]string) []rolloutAnswer {
	t.Helper()
	c.halt()
	stale := 0
	for _, a := range c.answers {
		if want, ok := weightsOf[a.version]; !ok || want != a.weights {
			if stale++; stale <= 5 {
				t.Errorf("stale: %s answered %q, run on %s", a.worker, a.version, a.weights)
			}
		}
	}
	if stale > 0 || len(c.lost) > 0 {
		t.Errorf("%d of %d answers stale, %d requests lost (%d attempts failed): %q", stale, len(c.answers), len(c.lost), c.failed, c.lost)
	}
	t.Logf("%d answers, %d attempts failed and were tried again", len(c.answers), c.failed)
	return c.answers
}

// stepTensors are the transformer's tensors the trainer sends at step k.
func stepTensors(k int) []fakeworker.Tensor {
	return []fakeworker.Tensor{{Name: "blocks.0.weight", Data: []byte{byte(k), 1, 2, 3}}, {Name: "blocks.1.weight", Data: []byte{byte(k), 5}}}
}

// badTensors are what a transfer gone wrong leaves: the same tensors,
// other values.
var badTensors = []fakeworker.Tensor{{Name: "blocks.0.weight", Data: []byte{0xff, 0xff, 0xff, 0xff}}, {Name: "blocks.1.weight", Data: []byte{0xff, 0xff}}}

// stepVersion is the version the trainer declares for step k, and
// stepWeights how the fakes name the weights it sends.
func stepVersion(k int) string { return fmt.Sprintf("step-%d", k) }
func stepWeights(k int) string { return "tensor:" + fakeworker.Checksum(stepTensors(k)...) }

// stepDeclaration is a declaration of step k's version with its checksum.
func stepDeclaration(k int) string {
	return fmt.Sprintf(`{"new_version":%q,"checksums":{"transformer":%q}}`, stepVersion(k), fakeworker.Checksum(stepTensors(k)...))
}

// direct POSTs body to path on the engine itself, as the trainer calls
// its engines past the router, and expects 200.
func direct(t *testing.T, w *fakeworker.Worker, path, body string) {
	t.Helper()
	testrouter.ExpectStatus(t, path+" on "+w.URL(), testrouter.Do(t, "POST", w.URL()+path, strings.NewReader(body)), 200)
}

// rolloutRouter starts fake engines and a router in front of them, and
// waits until the router has read their model, the fleet's first
// version; weightsOf gives the weights of that version.
func rolloutRouter(t *testing.T, n int, options string) (*testrouter.Router, []*fakeworker.Worker, map[string]string) {
	ws := namedWorkers(t, n, fakeworker.Config{UnitMs: 40}) // a rollout of miles' at 256x256 takes 2.5 ms, a transfer 200 ms
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n"+options+"}")
	reported(t, r, ws)
	return r, ws, map[string]string{oldVersion: ws[0].Config().ModelPath}
}

// The non-colocated loop: each step the trainer pauses the engines
// through the router, sends each its tensors directly, and continues
// with the version and its checksums. At step 2 one engine is sent
// other tensors: the continue names it in a 502 with the module that
// differs, and it gets no job, stale, until the next step's transfer
// brings it back. No answer is stale, none is lost, and none sent after
// a continue answered runs on the weights before it.
func TestMilesLoopPauseTransferContinue(t *testing.T) {
	const steps = 3
	r, ws, weightsOf := rolloutRouter(t, 3, "")
	bad := ws[1]
	client := startRollouts(t, r, 6)
	continued := make([]time.Time, steps+1) // when each step's continue answered
	continued[0] = time.Now()
	heldOutJobs := 0 // the jobs the bad engine had run when it was held out
	for k := 1; k <= steps; k++ {
		testrouter.WaitFor(t, func() bool { return client.answeredSince(continued[k-1]) >= 20 })
		if k == 3 { // the engine sent other tensors was held out all along
			expectSource(t, r, bad.URL(), "stale", stepVersion(1), "unknown")
			if jobs := bad.Stats().Jobs; jobs != heldOutJobs {
				t.Fatalf("the engine held out ran %d jobs after the continue", jobs-heldOutJobs)
			}
		}
		testrouter.ExpectStatus(t, fmt.Sprintf("step %d's pause", k), r.Post("/pause_generation", ""), 200)
		for _, w := range ws {
			tensors := stepTensors(k)
			if w == bad && k == 2 {
				tensors = badTensors
			}
			transfer(t, w, tensors)
		}
		weightsOf[stepVersion(k)] = stepWeights(k)
		rp := r.Post("/continue_generation", stepDeclaration(k))
		continued[k] = time.Now()
		if k != 2 {
			testrouter.ExpectStatus(t, fmt.Sprintf("step %d's continue", k), rp, 200)
			continue
		}
		testrouter.ExpectStatus(t, "the continue of the step with a bad transfer", rp, 502)
		res := resultOf(t, rp.JSON(t), bad.URL())
		body, _ := res["body"].(map[string]any)
		if msg, _ := body["error"].(string); res["status_code"] != 409.0 || body["module"] != "transformer" || !strings.Contains(msg, "module transformer differs") {
			t.Fatalf("the continue's result for the engine sent other tensors: %v", res)
		}
		expectSource(t, r, bad.URL(), "stale", stepVersion(1), "unknown")
		heldOutJobs = bad.Stats().Jobs
	}
	answers := client.expectNoneStaleOrLost(t, weightsOf)
	expectSource(t, r, bad.URL(), "serving", stepVersion(steps), "verified")

	// An answer to a request sent after a continue answered ran on that
	// step's weights or a later one's.
	stepOf := map[string]int{}
	for k := range steps {
		stepOf[stepWeights(k+1)] = k + 1
	}
	old := 0
	for _, a := range answers {
		k := 0
		for k < steps && a.sent.After(continued[k+1]) {
			k++
		}
		if k > 0 && stepOf[a.weights] < k {
			if old++; old <= 5 {
				t.Errorf("a request sent after step %d's continue answered ran on %s (%s)", k, a.weights, a.worker)
			}
		}
	}
	if old > 0 {
		t.Errorf("%d requests sent after a continue answered ran on the weights before it", old)
	}
}

// The colocated loop: the trainer declares the version the engines
// start on (docs/operations.md: before a declaration nothing tells the
// router of a sleep); then each step it puts the engines to sleep and
// wakes them itself, past the router, while the rollout's requests find
// them asleep; it sends each its tensors directly and then declares the
// version with its checksums. No answer is stale, none is lost.
func TestMilesLoopSleepWakeTransferDeclare(t *testing.T) {
	const steps = 3
	r, ws, weightsOf := rolloutRouter(t, 3, "")
	testrouter.ExpectStatus(t, "the starting version's declaration", r.Post("/update_weight_version", `{"new_version":"`+oldVersion+`"}`), 200)
	client := startRollouts(t, r, 6)
	declared := time.Now()
	for k := 1; k <= steps; k++ {
		testrouter.WaitFor(t, func() bool { return client.answeredSince(declared) >= 20 })
		failed := client.failures()
		for _, w := range ws {
			direct(t, w, "/release_memory_occupation", "{}")
		}
		// Training, until the rollout has been told the engines sleep and
		// the router has found each asleep, so vouches for none: a
		// failure alone may come before a job has met every engine
		// asleep (on a loaded machine, one attempt's timeout), and an
		// engine the router never saw asleep keeps its version as far as
		// the router can know, its weights moving behind its back.
		testrouter.WaitFor(t, func() bool { return client.failures() > failed && noneVouched(r, ws) })
		for _, w := range ws {
			direct(t, w, "/resume_memory_occupation", "{}")
			transfer(t, w, stepTensors(k))
		}
		weightsOf[stepVersion(k)] = stepWeights(k)
		testrouter.ExpectStatus(t, fmt.Sprintf("step %d's declaration", k), r.Post("/update_weight_version", stepDeclaration(k)), 200)
		declared = time.Now()
		for _, w := range ws {
			if wk := r.Workers()[w.URL()]; wk["weight_version"] != stepVersion(k) || wk["weight_version_source"] != "verified" {
				t.Fatalf("%s after step %d's declaration: %v (%v)", w.URL(), k, wk["weight_version"], wk["weight_version_source"])
			}
		}
	}
	client.expectNoneStaleOrLost(t, weightsOf)
}

// noneVouched reports whether the router vouches for none of ws's
// weights: each shows weight_version_source unknown.
func noneVouched(r *testrouter.Router, ws []*fakeworker.Worker) bool {
	workers := r.Workers()
	for _, w := range ws {
		if workers[w.URL()]["weight_version_source"] != "unknown" {
			return false
		}
	}
	return true
}

// A trainer that pauses and dies leaves the engines paused: the
// rollout's requests wait (here until queue_timeout, and are tried
// again), no engine gets a job, and /workers shows since when each is
// paused. An operator's continue_generation ends it; so does a PUT
// /workers/{id}, for that engine alone. Nothing is lost or stale.
func TestMilesTrainerThatPausedAndDied(t *testing.T) {
	r, ws, weightsOf := rolloutRouter(t, 2, " queue_timeout 500ms\n")
	a, b := ws[0], ws[1]
	client := startRollouts(t, r, 4)
	testrouter.WaitFor(t, func() bool { return client.answeredSince(time.Time{}) >= 20 })
	asked := time.Now()
	testrouter.ExpectStatus(t, "the trainer's pause", r.Post("/pause_generation", ""), 200)
	jobs := a.Stats().Jobs + b.Stats().Jobs
	failed := client.failures()
	testrouter.WaitFor(t, func() bool { return client.failures() >= failed+4 }) // requests waited out queue_timeout
	if n := a.Stats().Jobs + b.Stats().Jobs - jobs; n != 0 {
		t.Fatalf("the engines, paused, ran %d jobs", n)
	}
	for _, w := range ws {
		if since := pausedSince(t, r, w.URL()); since.Before(asked.Truncate(time.Second)) || since.After(time.Now()) {
			t.Fatalf("%s shows paused since %v; want the time of the pause, %v", w.URL(), since, asked)
		}
		if st := r.Workers()[w.URL()]["state"]; st != "paused" {
			t.Fatalf("%s after the trainer died: %v; want paused", w.URL(), st)
		}
	}
	testrouter.ExpectStatus(t, "the operator's continue", r.Post("/continue_generation", ""), 200)
	continued := time.Now()
	testrouter.WaitFor(t, func() bool { return client.answeredSince(continued) >= 20 })
	for _, w := range ws {
		if !pausedSince(t, r, w.URL()).IsZero() {
			t.Fatalf("%s is still paused after the operator's continue", w.URL())
		}
	}

	// Paused again, the trainer dies again; the operator lets a serve.
	testrouter.ExpectStatus(t, "the trainer's second pause", r.Post("/pause_generation", ""), 200)
	put := testrouter.Do(t, "PUT", r.Base+"/workers/"+url.QueryEscape(a.URL()), strings.NewReader(`{"is_dead": false}`))
	testrouter.ExpectStatus(t, "the operator's PUT of a", put, 200)
	if !pausedSince(t, r, a.URL()).IsZero() || pausedSince(t, r, b.URL()).IsZero() {
		t.Fatalf("after the PUT of a: a paused since %v, b since %v; want a serving, b paused", pausedSince(t, r, a.URL()), pausedSince(t, r, b.URL()))
	}
	served, held := a.Stats().Jobs, b.Stats().Jobs
	testrouter.WaitFor(t, func() bool { return a.Stats().Jobs >= served+20 })
	if n := b.Stats().Jobs - held; n != 0 {
		t.Fatalf("b, still paused, ran %d jobs while a served", n)
	}
	testrouter.ExpectStatus(t, "the operator's continue of b", r.Post("/continue_generation", pauseOf(b)), 200)
	client.expectNoneStaleOrLost(t, weightsOf)
}

// In the colocated loop an engine that answered a job as asleep serves
// nothing until the trainer's declaration names it: the router does not
// ask it for the declared checksums by itself, which, asked between the
// trainer's wake and its transfer, would match the weights it is about to
// lose, and no answer from the new weights goes out under the old
// version.
func TestMilesLoopNoStaleAnswerBetweenWakeAndTransfer(t *testing.T) {
	r, ws, weightsOf := rolloutRouter(t, 1, "")
	w := ws[0]
	transfer(t, w, stepTensors(1))
	testrouter.ExpectStatus(t, "step 1's declaration", r.Post("/update_weight_version", stepDeclaration(1)), 200)
	weightsOf[stepVersion(1)], weightsOf[stepVersion(2)] = stepWeights(1), stepWeights(2)

	client := startRollouts(t, r, 1)
	direct(t, w, "/release_memory_occupation", "{}")
	testrouter.WaitFor(t, func() bool { return r.Workers()[w.URL()]["weight_version_source"] == "unknown" }) // a rollout found it asleep
	checks := w.Stats().ChecksumCalls
	direct(t, w, "/resume_memory_occupation", "{}")
	testrouter.WaitFor(t, func() bool { return r.Workers()[w.URL()]["state"] == "stale" }) // no longer taken for asleep; rollouts wait
	transfer(t, w, stepTensors(2))
	testrouter.ExpectStatus(t, "step 2's declaration", r.Post("/update_weight_version", stepDeclaration(2)), 200)
	if n := w.Stats().ChecksumCalls - checks; n != 1 {
		t.Fatalf("the engine was asked for its checksums %d times after it was found asleep; want once, by the declaration", n)
	}
	declared := time.Now()
	testrouter.WaitFor(t, func() bool { return client.answeredSince(declared) >= 3 })
	client.expectNoneStaleOrLost(t, weightsOf)
}
