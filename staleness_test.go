package diffusionrouter_test

import (
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

const policyHeader = "X-Weight-Version-Policy"

func heldBack(t *testing.T, r *testrouter.Router, policy string) float64 {
	t.Helper()
	return testrouter.Value(t, r, "caddy_diffusion_version_policy_held_total", map[string]string{"pool": "stale-pool", "policy": policy})
}

// rollingUpdate is a router of pool stale-pool, with options, over fake
// workers a and b on step-1, in the middle of a rolling update to step-2:
// a, which the update takes first, drains a job the test holds (release
// ends it), while b serves step-1. updated answers the update.
func rollingUpdate(t *testing.T, options string) (r *testrouter.Router, release func(), updated <-chan testrouter.Reply) {
	t.Helper()
	ws := namedWorkers(t, 2, fakeworker.Config{UnitMs: 20})
	a, b := ws[0], ws[1]
	r = testrouter.Start(t, testrouter.MetricsSite("diffusion_router stale-pool {\n workers "+testrouter.URLs(ws)+
		"\n weights_mode rolling\n"+options+"\n}"))
	testrouter.ExpectStatus(t, "update to step-1", r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/1","weight_version":"step-1","mode":"drain"}`), 200)
	if heldBack(t, r, "latest") != 0 || heldBack(t, r, "max_staleness") != 0 {
		t.Fatal("jobs counted as held back before any was")
	}
	releaseA, releaseB := a.Hold(), b.Hold()
	jobs := make(chan testrouter.Reply, 2)
	for range 2 {
		go func() { jobs <- r.Post("/v1/images/generations", testrouter.SmallImage) }()
	}
	waitRunning(t, r, a, b)
	releaseB()
	testrouter.ExpectStatus(t, "b's held job", <-jobs, 200)
	answer := make(chan testrouter.Reply, 1)
	go func() {
		answer <- r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/2","weight_version":"step-2"}`)
	}()
	testrouter.WaitFor(t, func() bool { return r.Workers()[a.URL()]["state"] == "draining" })
	release = func() {
		releaseA()
		testrouter.ExpectStatus(t, "a's held job", <-jobs, 200)
	}
	return r, release, answer
}

// During a rolling update its target is the newest version. With
// version_policy max_staleness 1, jobs run on the worker not updated yet;
// a job that asks for latest waits for the updated worker, counted once
// as held back; every answer names the version that served it.
func TestVersionPolicyDuringARollingUpdate(t *testing.T) {
	r, release, updated := rollingUpdate(t, "version_policy max_staleness 1")
	for _, header := range [][]string{nil, {policyHeader, "max-staleness:1"}} {
		rp := r.Post("/v1/images/generations", testrouter.SmallImage, header...)
		testrouter.ExpectStatus(t, "a job the policy lets run on step-1", rp, 200)
		if w, v := rp.Header.Get("X-Fake-Worker"), rp.Header.Get(weightVersionHeader); w != "b" || v != "step-1" {
			t.Fatalf("with %v the job ran on %q, answering %q; want b, step-1", header, w, v)
		}
	}
	latest := make(chan testrouter.Reply, 1)
	go func() { latest <- r.Post("/v1/images/generations", testrouter.SmallImage, policyHeader, "latest") }()
	waitQueued(t, r, 1)
	if got := heldBack(t, r, "latest"); got != 1 {
		t.Fatalf("jobs latest held back: %g; want 1", got)
	}

	release()
	rp := <-latest
	testrouter.ExpectStatus(t, "the job that asked for latest", rp, 200)
	if w, v := rp.Header.Get("X-Fake-Worker"), rp.Header.Get(weightVersionHeader); w != "a" || v != "step-2" {
		t.Fatalf("latest ran on %q, answering %q; want a, step-2", w, v)
	}
	testrouter.ExpectStatus(t, "rolling update", <-updated, 200)
	if got, other := heldBack(t, r, "latest"), heldBack(t, r, "max_staleness"); got != 1 || other != 0 {
		t.Fatalf("jobs held back after the update: latest %g, max_staleness %g; want 1 and 0", got, other)
	}
	rp = r.Post("/v1/images/generations", testrouter.SmallImage, policyHeader, "latest")
	if v := rp.Header.Get(weightVersionHeader); rp.Status != 200 || v != "step-2" {
		t.Fatalf("latest after the update: %d on %q; want 200 on step-2", rp.Status, v)
	}
}

// A job whose policy keeps it waiting past queue_timeout gets 503 saying
// so, and the update goes on.
func TestVersionPolicyWaitIsBoundedByTheQueueTimeout(t *testing.T) {
	r, release, updated := rollingUpdate(t, "queue_timeout 200ms")
	rp := r.Post("/v1/images/generations", testrouter.SmallImage, policyHeader, "latest")
	testrouter.ExpectStatus(t, "latest while no worker is on step-2", rp, 503)
	if msg := rp.ErrorText(t); !strings.Contains(msg, "on weights the job's version policy admits was free within queue_timeout (200ms)") {
		t.Fatalf("503 answer: %q; want it to name the version policy and queue_timeout", msg)
	}
	if got := heldBack(t, r, "latest"); got != 1 {
		t.Fatalf("jobs latest held back: %g; want 1", got)
	}
	testrouter.ExpectStatus(t, "a job without a policy meanwhile", r.Post("/v1/images/generations", testrouter.SmallImage), 200)
	release()
	testrouter.ExpectStatus(t, "rolling update", <-updated, 200)
}

// A version policy header that does not parse, a bound out of range, the
// header twice or beside an exact X-Weight-Version: each a 400 naming
// what is wrong, and the next jobs run.
func TestBadVersionPolicyHeaders(t *testing.T) {
	ws := namedWorkers(t, 1, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	for _, tc := range []struct {
		header []string
		want   string
	}{
		{[]string{policyHeader, "newest"}, `X-Weight-Version-Policy: "newest" is neither latest nor max-staleness:<k>`},
		{[]string{policyHeader, ""}, `X-Weight-Version-Policy: "" is neither latest`},
		{[]string{policyHeader, "max-staleness:"}, `"max-staleness:" is neither latest`},
		{[]string{policyHeader, "max-staleness:1.5"}, `"max-staleness:1.5" is neither latest`},
		{[]string{policyHeader, "max_staleness:1"}, `"max_staleness:1" is neither latest`},
		{[]string{policyHeader, "max-staleness:-1"}, "the staleness bound must be 0 to 1000, got -1"},
		{[]string{policyHeader, "max-staleness:1001"}, "the staleness bound must be 0 to 1000, got 1001"},
		{[]string{policyHeader, "latest", weightVersionHeader, oldVersion}, "X-Weight-Version and X-Weight-Version-Policy are both given"},
	} {
		rp := r.Post("/v1/images/generations", testrouter.SmallImage, tc.header...)
		testrouter.ExpectStatus(t, strings.Join(tc.header, ": "), rp, 400)
		if msg := rp.ErrorText(t); !strings.Contains(msg, tc.want) {
			t.Fatalf("%v: error %q; want it to say %q", tc.header, msg, tc.want)
		}
	}

	twice, err := http.NewRequest("POST", r.Base+"/v1/images/generations", strings.NewReader(testrouter.SmallImage))
	if err != nil {
		t.Fatal(err)
	}
	twice.Header.Add(policyHeader, "latest")
	twice.Header.Add(policyHeader, "max-staleness:3")
	resp, err := testrouter.Client.Do(twice)
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	rp := testrouter.Reply{Status: resp.StatusCode, Header: resp.Header, Body: body}
	testrouter.ExpectStatus(t, "the header twice", rp, 400)
	if msg := rp.ErrorText(t); !strings.Contains(msg, "X-Weight-Version-Policy is given 2 times") {
		t.Fatalf("the header twice: error %q", msg)
	}

	for _, header := range [][]string{nil, {policyHeader, "latest"}, {policyHeader, "max-staleness:1000"}} {
		testrouter.ExpectStatus(t, "a good job after the bad ones", r.Post("/v1/images/generations", testrouter.SmallImage, header...), 200)
	}
	if n := ws[0].Stats().Jobs; n != 3 {
		t.Fatalf("the worker ran %d jobs; want the 3 good ones", n)
	}
}
