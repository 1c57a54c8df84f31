package diffusionrouter_test

import (
	"fmt"
	"regexp"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// internals are what an error body must never show: Go's or Caddy's own
// words (types, source lines, handler traces, stacks).
var internals = regexp.MustCompile(`\.go:\d|reverseproxy\.|caddyhttp\.|\{id=|goroutine \d|runtime\.|panic`)

// Every error path of the router that answers (rather than resetting an
// answer already begun) answers JSON a client can act on, and none of its
// bodies shows the router's internals. A video poll of a worker that is
// gone is checked in TestVideoWorkerThatLostItsVideoGetsNewOnes.
func TestErrorBodiesShowNoInternals(t *testing.T) {
	dead := "http://127.0.0.1:" + fmt.Sprint(testrouter.Port(t))
	slow := testrouter.StartWorkers(t, fakeworker.Config{Name: "slow", UnitMs: 10_000})
	slowJob := `{"response_format":"b64_json","prompt":"a cat","size":"1024x1024","num_inference_steps":4}`
	for _, tc := range []struct {
		name, site, method, path, body string
		status                         int
	}{
		{"unreachable worker", "workers " + dead + "\n max_attempts 2", "POST", "/v1/images/generations", testrouter.SmallImage, 502},
		{"a request that is no job, to an unreachable worker", "workers " + dead + "\n max_attempts 1", "GET", "/server_info", "", 502},
		{"upstream timeout", "workers " + slow[0].URL() + "\n upstream_timeout 200ms", "POST", "/v1/images/generations", slowJob, 504},
		{"no worker", "", "POST", "/v1/images/generations", testrouter.SmallImage, 503},
		{"unknown video", "workers " + dead, "GET", "/v1/videos/no-such-job", "", 404},
		{"bad image id", "workers " + dead, "GET", "/v1/images/a%2Fb/content", "", 400},
		{"dotted path", "workers " + dead, "GET", "/v1/videos/../update_weights_from_disk", "", 400},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := testrouter.Start(t, "diffusion_router {\n "+tc.site+"\n}")
			var rp testrouter.Reply
			if tc.method == "GET" {
				rp = r.Get(tc.path)
			} else {
				rp = r.Post(tc.path, tc.body)
			}
			testrouter.ExpectStatus(t, tc.name, rp, tc.status)
			if msg := rp.ErrorText(t); msg == "" || internals.MatchString(string(rp.Body)) {
				t.Fatalf("error body %s", rp.Body)
			}
		})
	}
}
