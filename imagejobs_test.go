package diffusionrouter_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// makeImage makes an image through the router and returns its id and the
// worker that made it.
func makeImage(t *testing.T, r *testrouter.Router) (id, worker string) {
	t.Helper()
	rp := r.Post("/v1/images/generations", testrouter.SmallImage)
	testrouter.ExpectStatus(t, "make an image", rp, 200)
	id, _ = rp.JSON(t)["id"].(string)
	if id == "" {
		t.Fatalf("no image id in %.200s", rp.Body)
	}
	return id, rp.Header.Get("X-Fake-Worker")
}

// Round robin would send every other request to the wrong worker: only
// pinning gets an image's content and its deletion to the worker that made
// it.
func TestImageJobsStayWithTheirWorker(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a"}, fakeworker.Config{Name: "b"})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n policy round_robin\n}")
	made := map[string]string{} // id → worker
	for range 4 {
		id, worker := makeImage(t, r)
		made[id] = worker
	}
	for id, worker := range made {
		for range 2 {
			rp := r.Get("/v1/images/" + id + "/content")
			testrouter.ExpectStatus(t, "content of "+id, rp, 200)
			if got := rp.Header.Get("X-Fake-Worker"); got != worker || rp.Header.Get("Content-Type") != "image/jpeg" || len(rp.Body) != 1024 {
				t.Fatalf("content of %s made on %s: served by %q, %s, %d bytes", id, worker, got, rp.Header.Get("Content-Type"), len(rp.Body))
			}
		}
		rp := testrouter.Do(t, "DELETE", r.Base+"/v1/images/"+id, nil)
		testrouter.ExpectStatus(t, "delete "+id, rp, 200)
		if got := rp.Header.Get("X-Fake-Worker"); got != worker || rp.JSON(t)["status"] != "deleted" {
			t.Fatalf("delete of %s made on %s: served by %q: %s", id, worker, got, rp.Body)
		}
		// Deleted on its worker, the id is forgotten: the router answers.
		rp = r.Get("/v1/images/" + id + "/content")
		testrouter.ExpectStatus(t, "content of a deleted image", rp, 404)
		if msg := rp.ErrorText(t); msg != "Unknown image_id" {
			t.Fatalf("content of a deleted image: %q", msg)
		}
	}

	rp := testrouter.Do(t, "DELETE", r.Base+"/v1/images/0b6d3a4e-9d8c-4f7a-8e1b-2c3d4e5f6a7b", nil)
	testrouter.ExpectStatus(t, "delete an unknown image", rp, 404)
	if msg := rp.ErrorText(t); msg != "Unknown image_id" {
		t.Fatalf("delete of an unknown image: %q", msg)
	}
}

// A streamed job names its id in its first event: a DELETE sent then, while
// the job runs, reaches its worker and cancels it there.
func TestStreamedImageJobIsPinnedWhileItRuns(t *testing.T) {
	// Each job runs for 10 s: long enough to be cancelled.
	ws := namedWorkers(t, 2, fakeworker.Config{UnitMs: 10_000})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n policy round_robin\n}")
	resp, err := testrouter.Client.Post(r.Base+"/v1/images/generations/stream", "application/json",
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

	rp := testrouter.Do(t, "DELETE", r.Base+"/v1/images/"+id, nil)
	testrouter.ExpectStatus(t, "cancel the stream", rp, 200)
	if got := rp.Header.Get("X-Fake-Worker"); got != maker || rp.JSON(t)["status"] != "cancelling" {
		t.Fatalf("cancel of a stream on %s: served by %q: %s", maker, got, rp.Body)
	}
	if last := nextEvent(t, events); last["type"] != "cancelled" || last["id"] != id {
		t.Fatalf("the stream ended with %v", last)
	}
	// A job being cancelled is still on its worker: the id still leads there.
	rp = testrouter.Do(t, "DELETE", r.Base+"/v1/images/"+id, nil)
	testrouter.ExpectStatus(t, "delete the cancelled stream", rp, 200)
	if rp.Header.Get("X-Fake-Worker") != maker || rp.JSON(t)["status"] != "deleted" {
		t.Fatalf("delete of a cancelled stream: %s", rp.Body)
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
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a"})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
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
			req, err := http.NewRequest(method, r.Base+path, nil)
			if err != nil {
				t.Fatal(err)
			}
			resp, err := testrouter.Client.Do(req)
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
	testrouter.ExpectStatus(t, "the image after the refused calls", r.Get("/v1/images/"+id+"/content"), 200)
}
