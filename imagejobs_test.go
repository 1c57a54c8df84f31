package diffusionrouter

import (
	"bufio"
	"bytes"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/examples/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/request"
)

// makeImage makes an image through the router and returns its id and the
// worker that made it.
func makeImage(t *testing.T, r *testRouter) (id, worker string) {
	t.Helper()
	rp := r.post("/v1/images/generations", smallImage)
	expectStatus(t, "make an image", rp, 200)
	id, _ = rp.json(t)["id"].(string)
	if id == "" {
		t.Fatalf("no image id in %.200s", rp.body)
	}
	return id, rp.header.Get("X-Fake-Worker")
}

// Round robin would send every other request to the wrong worker: only
// pinning gets an image's content and its deletion to the worker that made
// it.
func TestImageJobsStayWithTheirWorker(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "a"}, fakeworker.Config{Name: "b"})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n policy round_robin\n}")
	made := map[string]string{} // id → worker
	for range 4 {
		id, worker := makeImage(t, r)
		made[id] = worker
	}
	for id, worker := range made {
		for range 2 {
			rp := r.get("/v1/images/" + id + "/content")
			expectStatus(t, "content of "+id, rp, 200)
			if got := rp.header.Get("X-Fake-Worker"); got != worker || rp.header.Get("Content-Type") != "image/jpeg" || len(rp.body) != 1024 {
				t.Fatalf("content of %s made on %s: served by %q, %s, %d bytes", id, worker, got, rp.header.Get("Content-Type"), len(rp.body))
			}
		}
		rp := do(t, "DELETE", r.base+"/v1/images/"+id, nil)
		expectStatus(t, "delete "+id, rp, 200)
		if got := rp.header.Get("X-Fake-Worker"); got != worker || rp.json(t)["status"] != "deleted" {
			t.Fatalf("delete of %s made on %s: served by %q: %s", id, worker, got, rp.body)
		}
		// Deleted on its worker, the id is forgotten: the router answers.
		rp = r.get("/v1/images/" + id + "/content")
		expectStatus(t, "content of a deleted image", rp, 404)
		if msg := rp.errorText(t); msg != "Unknown image_id" {
			t.Fatalf("content of a deleted image: %q", msg)
		}
	}

	rp := do(t, "DELETE", r.base+"/v1/images/0b6d3a4e-9d8c-4f7a-8e1b-2c3d4e5f6a7b", nil)
	expectStatus(t, "delete an unknown image", rp, 404)
	if msg := rp.errorText(t); msg != "Unknown image_id" {
		t.Fatalf("delete of an unknown image: %q", msg)
	}
}

// A streamed job names its id in its first event: a DELETE sent then, while
// the job runs, reaches its worker and cancels it there.
func TestStreamedImageJobIsPinnedWhileItRuns(t *testing.T) {
	// Each job runs for 10 s: long enough to be cancelled.
	ws := namedWorkers(t, 2, fakeworker.Config{UnitMs: 10_000})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n policy round_robin\n}")
	resp, err := client.Post(r.base+"/v1/images/generations/stream", "application/json",
		strings.NewReader(`{"prompt":"p","size":"1024x1024","num_inference_steps":1,"response_format":"b64_json"}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("stream: %d", resp.StatusCode)
	}
	maker := resp.Header.Get("X-Fake-Worker")
	events := bufio.NewReader(resp.Body)
	accepted := nextEvent(t, events)
	id, _ := accepted["id"].(string)
	if accepted["type"] != "accepted" || id == "" {
		t.Fatalf("first event %v", accepted)
	}

	rp := do(t, "DELETE", r.base+"/v1/images/"+id, nil)
	expectStatus(t, "cancel the stream", rp, 200)
	if got := rp.header.Get("X-Fake-Worker"); got != maker || rp.json(t)["status"] != "cancelling" {
		t.Fatalf("cancel of a stream on %s: served by %q: %s", maker, got, rp.body)
	}
	if last := nextEvent(t, events); last["type"] != "cancelled" || last["id"] != id {
		t.Fatalf("the stream ended with %v", last)
	}
	// A job being cancelled is still on its worker: the id still leads there.
	rp = do(t, "DELETE", r.base+"/v1/images/"+id, nil)
	expectStatus(t, "delete the cancelled stream", rp, 200)
	if rp.header.Get("X-Fake-Worker") != maker || rp.json(t)["status"] != "deleted" {
		t.Fatalf("delete of a cancelled stream: %s", rp.body)
	}
}

// nextEvent reads the next server-sent event's data.
func nextEvent(t *testing.T, events *bufio.Reader) map[string]any {
	t.Helper()
	for {
		line, err := events.ReadBytes('\n')
		if err != nil {
			t.Fatalf("the stream ended: %v", err)
		}
		if data, ok := bytes.CutPrefix(line, []byte("data: ")); ok {
			var ev map[string]any
			if err := json.Unmarshal(data, &ev); err != nil {
				t.Fatalf("event %q: %v", data, err)
			}
			return ev
		}
	}
}

// Bad image ids get a clear 400 from the router and reach no worker: the
// image stays where it is.
func TestBadImageIDsChangeNothing(t *testing.T) {
	ws := startWorkers(t, fakeworker.Config{Name: "a"})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n}")
	id, _ := makeImage(t, r)
	for _, path := range []string{
		"/v1/images/" + strings.Repeat("a", request.MaxJobIDLength+1),
		"/v1/images/" + id + "%2Fcontent",
		"/v1/images/" + id + "%2f",
		"/v1/images/a%2Fb/content",
		"/v1/images/" + id + "/content/more",
		"/v1/images/" + id + "/",
		"/v1/images//content",
		"/v1/images/a%20b",
		"/v1/images/" + id + "%00",
		"/v1/images/./content",
		"/v1/images/%2e%2e/content",
		"/v1/images/" + id + "/../../update_weights_from_disk",
	} {
		for _, method := range []string{"GET", "DELETE"} {
			req, err := http.NewRequest(method, r.base+path, nil)
			if err != nil {
				t.Fatal(err)
			}
			resp, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			var body map[string]any
			err = json.NewDecoder(resp.Body).Decode(&body)
			resp.Body.Close()
			if resp.StatusCode != 400 || err != nil || body["error"] == nil || resp.Header.Get("X-Fake-Worker") != "" {
				t.Fatalf("%s %s: %d %v (%v), from worker %q; want the router's 400", method, path, resp.StatusCode, body, err, resp.Header.Get("X-Fake-Worker"))
			}
		}
	}
	expectStatus(t, "the image after the refused calls", r.get("/v1/images/"+id+"/content"), 200)
}
