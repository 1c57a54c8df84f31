package testrouter

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
)

// Reply is a response read whole.
type Reply struct {
	Status int
	Header http.Header
	Body   []byte
}

// JSON decodes the body as a JSON object, failing t if it is not one.
func (rp Reply) JSON(t testing.TB) map[string]any {
	t.Helper()
	var v map[string]any
	if err := json.Unmarshal(rp.Body, &v); err != nil {
		t.Fatalf("status %d, body is not JSON: %v: %.200s", rp.Status, err, rp.Body)
	}
	return v
}

// ErrorText is the message of a {"error": "..."} body, the shape of every
// error the router itself answers.
func (rp Reply) ErrorText(t testing.TB) string {
	t.Helper()
	msg, ok := rp.JSON(t)["error"].(string)
	if !ok {
		t.Fatalf("status %d, no error message in %.200s", rp.Status, rp.Body)
	}
	return msg
}

// Client is the HTTP client of Do. Its timeout ends a test whose request
// would otherwise hang on a stuck router.
var Client = &http.Client{Timeout: 60 * time.Second}

// Do sends a request to u and reads the whole answer. header is name, value
// pairs.
func Do(t testing.TB, method, u string, body io.Reader, header ...string) Reply {
	t.Helper()
	req, err := http.NewRequest(method, u, body)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := Client.Do(req)
	if err != nil && method == http.MethodGet {
		// A reload closes the old server's connections, even one it has
		// just accepted; a client retries a GET, as browsers do.
		resp, err = Client.Do(req)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return Reply{resp.StatusCode, resp.Header, b}
}

// Get sends GET path to the router.
func (r *Router) Get(path string) Reply {
	r.t.Helper()
	return Do(r.t, http.MethodGet, r.Base+path, nil)
}

// Post sends POST path with body to the router; header is name, value
// pairs.
func (r *Router) Post(path, body string, header ...string) Reply {
	r.t.Helper()
	return Do(r.t, http.MethodPost, r.Base+path, strings.NewReader(body), header...)
}

// Workers returns the router's GET /workers answer as each worker's
// fields, by worker URL.
func (r *Router) Workers() map[string]map[string]any {
	r.t.Helper()
	out := map[string]map[string]any{}
	for _, w := range r.Get("/workers").JSON(r.t)["workers"].([]any) {
		m := w.(map[string]any)
		out[m["url"].(string)] = m
	}
	return out
}

// ExpectStatus fails t unless rp has status want; what names the request.
func ExpectStatus(t testing.TB, what string, rp Reply, want int) {
	t.Helper()
	if rp.Status != want {
		t.Fatalf("%s: status %d, want %d; body %.300s", what, rp.Status, want, rp.Body)
	}
}

// WaitFor polls cond until it holds, failing t if it has not within 10 s.
func WaitFor(t testing.TB, cond func() bool) {
	t.Helper()
	if !testkit.WaitUntil(10*time.Second, cond) {
		t.Fatal("condition never held")
	}
}

// SmallImage is the body of a small image job: two steps at 256x256,
// answered as base64.
const SmallImage = `{"response_format":"b64_json","prompt":"a cat","size":"256x256","num_inference_steps":2}`

// HeavyImage is the body of an image job of 20 cost units (1024x1024, 20
// steps): 200 ms on a fake worker of speed 1 at 10 ms a unit.
const HeavyImage = `{"response_format":"b64_json","prompt":"a cat","size":"1024x1024","num_inference_steps":20}`

// SendImages sends small image jobs to r from clients clients at once,
// each client one job after another while more holds for the jobs it has
// sent, and counts the answers by the fake worker that made them
// (X-Fake-Worker). A job answered other than 200 fails t.
func SendImages(t testing.TB, r *Router, clients int, more func(sent int) bool) map[string]int {
	return SendJobs(t, r, clients, "/v1/images/generations", SmallImage, more)
}

// SendJobs is SendImages for jobs of body sent to path.
func SendJobs(t testing.TB, r *Router, clients int, path, body string, more func(sent int) bool) map[string]int {
	var mu sync.Mutex
	by := map[string]int{}
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			for sent := 0; more(sent); sent++ {
				rp := r.Post(path, body)
				if rp.Status != 200 {
					t.Errorf("a job sent to %s: %d %s", path, rp.Status, rp.Body)
				}
				mu.Lock()
				by[rp.Header.Get("X-Fake-Worker")]++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return by
}

// BusyWith starts an image job with body on r that keeps the given worker
// busy, and waits until the worker has it; the job's answer arrives on the
// channel.
func BusyWith(t testing.TB, r *Router, worker string, body string) <-chan Reply {
	t.Helper()
	done := make(chan Reply, 1)
	go func() { done <- r.Post("/v1/images/generations", body) }()
	WaitFor(t, func() bool { return r.Workers()[worker]["active_requests"] == 1.0 })
	return done
}
