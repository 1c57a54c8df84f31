package diffusionrouter_test

import (
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// prioritySite is a router over ws whose jobs take their priority from
// X-Priority, with /metrics beside it.
func prioritySite(ws []*fakeworker.Worker, extra string) string {
	return testrouter.MetricsSite("diffusion_router priority-pool {\n workers " + testrouter.URLs(ws) +
		"\n priority {http.request.header.X-Priority}\n" + extra + "}")
}

// postImage posts a 1024x1024 image job of steps steps (its cost), with
// the header name set to value unless value is empty, and returns the
// answer's status and body: 0 and the error when none came.
func postImage(r *testrouter.Router, steps int, name, value string) (int, string) {
	body := fmt.Sprintf(`{"response_format":"b64_json","prompt":"x","size":"1024x1024","num_inference_steps":%d}`, steps)
	req, _ := http.NewRequest(http.MethodPost, r.Base+"/v1/images/generations", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if value != "" {
		req.Header.Set(name, value)
	}
	resp, err := testrouter.Client.Do(req)
	if err != nil {
		return 0, err.Error()
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp.StatusCode, string(b)
}

// heldSpeed is the initial_speed of routers whose tests hold a job on its
// worker (fakeworker's Hold) while others queue behind it, and then look at
// the order the others run in. A job held is predicted to run long, so the
// router sends its worker no second job meanwhile. The held job is no
// larger than the others, so the speed the router learns from it once
// released is no faster than theirs: learning a GPU far faster than the
// fake would have the router send the worker its next jobs all at once, in
// no order. Each test also releases the held job as it ends, so that one
// that fails does not leave its router waiting for the job to end.
const heldSpeed = "initial_speed 0.1\n"

// sendJob sends an image job of steps steps with the given X-Priority
// (none when empty) and names it on done once answered.
func sendJob(r *testrouter.Router, name, prio string, steps int, done chan<- string) {
	if status, body := postImage(r, steps, "X-Priority", prio); status != 200 {
		name = fmt.Sprintf("%s: status %d: %.100s", name, status, body)
	}
	done <- name
}

func TestUrgentJobsRunNextNotBehindTheBatch(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{UnitMs: 20})
	r := testrouter.Start(t, prioritySite(ws, heldSpeed))
	pool := map[string]string{"pool": "priority-pool"}
	done := make(chan string, 12)
	// The batch's first job holds the worker until the rest of the batch
	// and the urgent jobs have queued behind it and been seen there.
	release := ws[0].Hold()
	t.Cleanup(release)
	go sendJob(r, "batch-0", "", 2, done)
	testrouter.WaitFor(t, func() bool { return testrouter.Value(t, r, "caddy_diffusion_worker_inflight_jobs", pool) == 1 })
	for i := 1; i < 10; i++ {
		go sendJob(r, fmt.Sprintf("batch-%d", i), "", 2, done)
	}
	testrouter.WaitFor(t, func() bool { return testrouter.Value(t, r, "caddy_diffusion_queue_length", pool) == 9 })
	go sendJob(r, "urgent-1", "5", 2, done)
	go sendJob(r, "urgent-2", "5", 2, done)
	testrouter.WaitFor(t, func() bool { return testrouter.Value(t, r, "caddy_diffusion_queue_length", pool) == 11 })
	// What waits, by priority, as the metrics, /health, /workers and the
	// status page show it.
	if n := testrouter.Value(t, r, "caddy_diffusion_priority_queue_length", map[string]string{"pool": "priority-pool", "priority": "5"}); n != 2 {
		t.Errorf("priority_queue_length{priority=5} = %v; want the 2 urgent jobs", n)
	}
	for _, path := range []string{"/health", "/workers", "/dashboard/data"} {
		if got := r.Get(path).JSON(t)["queued_by_priority"].(map[string]any)["5"]; got != 2.0 {
			t.Errorf("%s queued_by_priority[5] = %v; want 2", path, got)
		}
	}
	release()
	var order []string
	for range 12 {
		order = append(order, <-done)
	}
	if !slices.Equal(order[:3], []string{"batch-0", "urgent-1", "urgent-2"}) && !slices.Equal(order[:3], []string{"batch-0", "urgent-2", "urgent-1"}) {
		t.Fatalf("answers came in the order %v; want the urgent jobs right after the batch job that was running", order)
	}
}

func TestPriorityThatIsNoIntegerIsRefused(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{})
	r := testrouter.Start(t, prioritySite(ws, ""))
	for _, bad := range []string{"high", "1.5", "9999999999999999999999"} {
		rp := r.Post("/v1/images/generations", `{"response_format":"b64_json","prompt":"x","size":"8x8"}`, "X-Priority", bad)
		testrouter.ExpectStatus(t, "priority "+bad, rp, 400)
		if msg := rp.ErrorText(t); !strings.Contains(msg, "priority") || !strings.Contains(msg, "not an integer") {
			t.Errorf("priority %q: error %q does not say the priority is no integer", bad, msg)
		}
	}
	for _, ok := range []string{"", "0", "-3", " 7 ", "1000", "-1000"} { // clamped to max_priority
		rp := r.Post("/v1/images/generations", `{"response_format":"b64_json","prompt":"x","size":"8x8"}`, "X-Priority", ok)
		testrouter.ExpectStatus(t, fmt.Sprintf("priority %q", ok), rp, 200)
	}
	if n := ws[0].Stats().Jobs; n != 6 {
		t.Errorf("the worker served %d jobs; want the 6 with a priority it could read", n)
	}
}
