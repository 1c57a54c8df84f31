package fakeworker

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"mime/multipart"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// start runs a worker for the test; UnitMs defaults to 1 to keep tests fast.
func start(t *testing.T, cfg Config) *Worker {
	t.Helper()
	if cfg.UnitMs == 0 {
		cfg.UnitMs = 1
	}
	w, err := Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.Close)
	return w
}

type reply struct {
	status int
	header http.Header
	body   []byte
}

func send(ctx context.Context, method, url, contentType string, body []byte) (reply, error) {
	req, err := http.NewRequestWithContext(ctx, method, url, bytes.NewReader(body))
	if err != nil {
		return reply{}, err
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return reply{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return reply{resp.StatusCode, resp.Header, b}, err
}

// call sends a JSON body (none if empty). It reports failures with t.Error,
// so goroutines may use it.
func call(t *testing.T, w *Worker, method, path, body string) reply {
	t.Helper()
	r, err := send(context.Background(), method, w.URL()+path, "application/json", []byte(body))
	if err != nil {
		t.Errorf("%s %s: %v", method, path, err)
	}
	return r
}

func (r reply) object(t *testing.T) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(r.body, &m); err != nil {
		t.Errorf("body %.200q: %v", r.body, err)
	}
	return m
}

// expect checks the status and returns the JSON body.
func (r reply) expect(t *testing.T, status int) map[string]any {
	t.Helper()
	if r.status != status {
		t.Errorf("status %d, want %d; body %.300s", r.status, status, r.body)
	}
	return r.object(t)
}

// firstFieldError is the first entry of a FastAPI 422 detail list.
func firstFieldError(t *testing.T, body map[string]any) map[string]any {
	t.Helper()
	list, ok := body["detail"].([]any)
	if !ok || len(list) == 0 {
		t.Fatalf("detail is not a non-empty list: %v", body)
	}
	return list[0].(map[string]any)
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// queue reports whether the worker's slot is taken and how many wait for it.
func queue(w *Worker) (busy bool, waiting int) {
	w.slot.mu.Lock()
	defer w.slot.mu.Unlock()
	return w.slot.busy, len(w.slot.waiters)
}

func waitQueue(t *testing.T, w *Worker, waiting int) {
	t.Helper()
	waitFor(t, "queue", func() bool {
		busy, n := queue(w)
		return busy && n == waiting
	})
}

// imageJob is an image request of cost steps.
func imageJob(steps int) string {
	return `{"prompt":"p","size":"1024x1024","num_inference_steps":` + strconv.Itoa(steps) + `}`
}

func TestCost(t *testing.T) {
	if got := Cost(1024, 1024, 20, 1, 1); got != 20 {
		t.Errorf("Cost = %v, want 20", got)
	}
	if got := Cost(512, 512, 10, 96, 2); got != 480 {
		t.Errorf("Cost = %v, want 480", got)
	}
}

func TestInfoEndpoints(t *testing.T) {
	w := start(t, Config{Name: "w1", TaskType: "t2v"})
	for _, path := range []string{"/health", "/health_generate"} {
		r := call(t, w, "GET", path, "")
		if body := r.expect(t, 200); body["status"] != "ok" {
			t.Errorf("%s = %v", path, body)
		}
		if got := r.header.Get("X-Fake-Worker"); got != "w1" {
			t.Errorf("X-Fake-Worker = %q", got)
		}
	}
	for _, path := range []string{"/model_info", "/v1/model_info", "/server_info"} {
		body := call(t, w, "GET", path, "").expect(t, 200)
		if body["model_path"] != "fake/diffusion-model" || body["task_type"] != "T2V" || body["weight_version"] != "fake/diffusion-model" {
			t.Errorf("%s = %v", path, body)
		}
	}
	models := call(t, w, "GET", "/v1/models", "").expect(t, 200)
	card := models["data"].([]any)[0].(map[string]any)
	if models["object"] != "list" || card["id"] != "fake/diffusion-model" || card["object"] != "model" || card["task_type"] != "T2V" {
		t.Errorf("/v1/models = %v", models)
	}
	call(t, w, "GET", "/v1/models/fake/diffusion-model", "").expect(t, 200)
	notFound := call(t, w, "GET", "/v1/models/other", "").expect(t, 404)
	if e := notFound["error"].(map[string]any); e["code"] != "model_not_found" {
		t.Errorf("unknown model = %v", notFound)
	}
}

func TestImageGenerations(t *testing.T) {
	w := start(t, Config{ImageBytes: 100})
	r := call(t, w, "POST", "/v1/images/generations", `{"prompt":"cat","size":"64x32","num_inference_steps":4,"n":3}`)
	body := r.expect(t, 200)
	data := body["data"].([]any)
	if len(data) != 3 {
		t.Fatalf("%d outputs, want 3", len(data))
	}
	img, err := base64.StdEncoding.DecodeString(data[0].(map[string]any)["b64_json"].(string))
	if err != nil || len(img) != 100 || !bytes.HasPrefix(img, []byte("\x89PNG")) {
		t.Errorf("image: %d bytes, err %v", len(img), err)
	}
	if body["weight_version"] != "fake/diffusion-model" || r.header.Get("X-Weight-Version") != "fake/diffusion-model" {
		t.Errorf("weight version: body %v, header %q", body["weight_version"], r.header.Get("X-Weight-Version"))
	}
	if s := w.Stats(); s.Jobs != 1 || s.Cost != Cost(64, 32, 4, 1, 3) || s.Busy <= 0 {
		t.Errorf("stats = %+v", s)
	}

	clamped := call(t, w, "POST", "/v1/images/generations", `{"prompt":"cat","size":"8x8","n":50}`).expect(t, 200)
	if n := len(clamped["data"].([]any)); n != maxImagesPerPrompt {
		t.Errorf("n=50 gave %d outputs, want %d", n, maxImagesPerPrompt)
	}
}

func TestImageGenerationErrors(t *testing.T) {
	tests := []struct {
		name, task, body string
		status           int
		detail           string // a substring of a string detail, or the type of the first field error
		jobs             int    // jobs the worker ran anyway
	}{
		{"invalid JSON", "", `{"prompt":`, 422, "json_invalid", 0},
		{"empty body", "", ``, 422, "missing", 0},
		{"no prompt", "", `{"n":1}`, 422, "missing", 0},
		{"n not an int", "", `{"prompt":"p","n":"two"}`, 422, "int_type", 0},
		{"bad size", "", `{"prompt":"p","size":"big"}`, 400, "invalid size", 0},
		{"zero steps", "", `{"prompt":"p","num_inference_steps":0}`, 400, "must be positive", 0},
		{"url format", "", `{"prompt":"p","size":"8x8","response_format":"url"}`, 400, "cloud storage", 1},
		{"unknown format", "", `{"prompt":"p","size":"8x8","response_format":"gif"}`, 400, "not supported", 1},
		{"video model", "T2V", `{"prompt":"p"}`, 400, "cannot generate images", 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := start(t, Config{TaskType: tt.task})
			body := call(t, w, "POST", "/v1/images/generations", tt.body).expect(t, tt.status)
			if tt.status == 422 {
				if got := firstFieldError(t, body)["type"]; got != tt.detail {
					t.Errorf("field error type %v, want %s", got, tt.detail)
				}
			} else if d, _ := body["detail"].(string); !strings.Contains(d, tt.detail) {
				t.Errorf("detail %q, want it to contain %q", d, tt.detail)
			}
			if got := w.Stats().Jobs; got != tt.jobs {
				t.Errorf("%d jobs ran, want %d", got, tt.jobs)
			}
		})
	}
}

// multipartBody builds a form with the given fields and one small file per
// name in files.
func multipartBody(t *testing.T, fields map[string]string, files ...string) (contentType string, body []byte) {
	t.Helper()
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	for k, v := range fields {
		mw.WriteField(k, v)
	}
	for _, name := range files {
		fw, err := mw.CreateFormFile(name, "input.png")
		if err != nil {
			t.Fatal(err)
		}
		fw.Write([]byte("\x89PNG fake"))
	}
	if err := mw.Close(); err != nil {
		t.Fatal(err)
	}
	return mw.FormDataContentType(), buf.Bytes()
}

func postForm(t *testing.T, w *Worker, path string, fields map[string]string, files ...string) reply {
	t.Helper()
	ct, body := multipartBody(t, fields, files...)
	r, err := send(context.Background(), "POST", w.URL()+path, ct, body)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestImageEdits(t *testing.T) {
	w := start(t, Config{TaskType: "TI2I"})
	fields := map[string]string{"prompt": "p", "n": "2", "size": "64x64", "num_inference_steps": "3"}
	ok := postForm(t, w, "/v1/images/edits", fields, "image[]").expect(t, 200)
	if n := len(ok["data"].([]any)); n != 2 {
		t.Errorf("%d outputs, want 2", n)
	}
	if s := w.Stats(); s.Cost != Cost(64, 64, 3, 1, 2) {
		t.Errorf("cost %v", s.Cost)
	}

	noImage := postForm(t, w, "/v1/images/edits", fields).expect(t, 422)
	if noImage["detail"] != "Field 'image' or 'url' is required" {
		t.Errorf("no image: %v", noImage)
	}
	noPrompt := postForm(t, w, "/v1/images/edits", map[string]string{"n": "1"}, "image").expect(t, 422)
	if fe := firstFieldError(t, noPrompt); fe["type"] != "missing" {
		t.Errorf("no prompt: %v", noPrompt)
	}
	badN := postForm(t, w, "/v1/images/edits", map[string]string{"prompt": "p", "n": "x"}, "image").expect(t, 422)
	if fe := firstFieldError(t, badN); fe["type"] != "int_parsing" {
		t.Errorf("bad n: %v", badN)
	}
}

func TestJobsRunOneAtATimeInArrivalOrder(t *testing.T) {
	// 200 ms a job: each must still run when the next arrives, even on a
	// loaded machine.
	const jobs, steps, unit = 3, 2, 100 * time.Millisecond
	w := start(t, Config{UnitMs: float64(unit / time.Millisecond)})
	begin := time.Now()
	finished := make(chan int, jobs)
	for i := range jobs {
		go func() {
			call(t, w, "POST", "/v1/images/generations", imageJob(steps)).expect(t, 200)
			finished <- i
		}()
		waitQueue(t, w, i) // job i is queued before job i+1 is sent
	}
	var order []int
	for range jobs {
		order = append(order, <-finished)
	}
	if !slices.Equal(order, []int{0, 1, 2}) {
		t.Errorf("completion order %v, want arrival order", order)
	}
	if serial := jobs * steps * unit; time.Since(begin) < serial {
		t.Errorf("3 jobs took %v, less than their serial service time %v", time.Since(begin), serial)
	}
	if s := w.Stats(); s.Jobs != jobs || s.Busy < jobs*steps*unit {
		t.Errorf("stats %+v", s)
	}
}

func TestQueuedJobIsDroppedWhenClientLeaves(t *testing.T) {
	w := start(t, Config{UnitMs: 10})
	done := make(chan reply)
	// 1 s: long enough to still run while the second job comes and goes.
	go func() { done <- call(t, w, "POST", "/v1/images/generations", imageJob(100)) }()
	waitQueue(t, w, 0)

	ctx, cancel := context.WithCancel(context.Background())
	left := make(chan error)
	go func() {
		_, err := send(ctx, "POST", w.URL()+"/v1/images/generations", "application/json", []byte(imageJob(1)))
		left <- err
	}()
	waitQueue(t, w, 1)
	cancel()
	if err := <-left; err == nil {
		t.Error("cancelled request succeeded")
	}
	waitQueue(t, w, 0)

	(<-done).expect(t, 200)
	waitFor(t, "idle worker", func() bool { busy, _ := queue(w); return !busy })
	if s := w.Stats(); s.Jobs != 1 {
		t.Errorf("%d jobs ran, want 1: the dropped one must not run", s.Jobs)
	}
}

func TestRunningJobOutlivesClient(t *testing.T) {
	w := start(t, Config{UnitMs: 10})
	begin := time.Now()
	ctx, cancel := context.WithCancel(context.Background())
	left := make(chan error)
	go func() {
		_, err := send(ctx, "POST", w.URL()+"/v1/images/generations", "application/json", []byte(imageJob(10)))
		left <- err
	}()
	waitQueue(t, w, 0)
	cancel()
	if err := <-left; err == nil {
		t.Fatal("cancelled request succeeded")
	}
	call(t, w, "POST", "/v1/images/generations", imageJob(1)).expect(t, 200)
	if elapsed := time.Since(begin); elapsed < 100*time.Millisecond {
		t.Errorf("second job done after %v: it did not wait for the abandoned 100 ms job", elapsed)
	}
	if s := w.Stats(); s.Jobs != 2 {
		t.Errorf("%d jobs, want 2", s.Jobs)
	}
}

func TestVideoLifecycle(t *testing.T) {
	w := start(t, Config{TaskType: "T2V", ImageBytes: 64})
	created := call(t, w, "POST", "/v1/videos", `{"prompt":"p","size":"1024x1024","num_inference_steps":10,"num_frames":20}`).expect(t, 200)
	id, _ := created["id"].(string)
	if created["object"] != "video" || created["status"] != "queued" || created["model"] != "sora-2" ||
		created["size"] != "1024x1024" || created["seconds"] != "1" || id == "" {
		t.Errorf("created = %v", created)
	}
	early := call(t, w, "GET", "/v1/videos/"+id+"/content", "").expect(t, 404)
	if early["detail"] != "Generation is still in-progress" {
		t.Errorf("early content = %v", early)
	}

	var job map[string]any
	waitFor(t, "video completion", func() bool {
		job = call(t, w, "GET", "/v1/videos/"+id, "").expect(t, 200)
		return job["status"] == "completed"
	})
	if job["progress"] != 100.0 || job["weight_version"] != "fake/diffusion-model" || job["completed_at"] == nil {
		t.Errorf("completed job = %v", job)
	}
	content := call(t, w, "GET", "/v1/videos/"+id+"/content", "")
	if content.status != 200 || content.header.Get("Content-Type") != "video/mp4" ||
		len(content.body) != 64 || string(content.body[4:8]) != "ftyp" {
		t.Errorf("content: %d %q %d bytes", content.status, content.header.Get("Content-Type"), len(content.body))
	}
	if s := w.Stats(); s.Jobs != 1 || s.Cost != 200 {
		t.Errorf("stats %+v", s)
	}

	second := call(t, w, "POST", "/v1/videos", `{"prompt":"q","size":"64x64","extra_body":{"num_frames":4}}`).expect(t, 200)
	secondID := second["id"].(string)
	listIDs := func(query string) []string {
		var ids []string
		for _, j := range call(t, w, "GET", "/v1/videos"+query, "").expect(t, 200)["data"].([]any) {
			ids = append(ids, j.(map[string]any)["id"].(string))
		}
		return ids
	}
	for query, want := range map[string][]string{
		"":                       {secondID, id},
		"?order=asc":             {id, secondID},
		"?limit=1":               {secondID},
		"?order=asc&after=" + id: {secondID},
		"?after=unknown":         nil,
	} {
		if got := listIDs(query); !slices.Equal(got, want) {
			t.Errorf("list%s = %v, want %v", query, got, want)
		}
	}
	call(t, w, "GET", "/v1/videos?limit=0", "").expect(t, 422)

	if deleted := call(t, w, "DELETE", "/v1/videos/"+id, "").expect(t, 200); deleted["status"] != "deleted" {
		t.Errorf("deleted = %v", deleted)
	}
	for _, r := range []reply{
		call(t, w, "GET", "/v1/videos/"+id, ""),
		call(t, w, "DELETE", "/v1/videos/"+id, ""),
		call(t, w, "GET", "/v1/videos/unknown/content", ""),
	} {
		if body := r.expect(t, 404); body["detail"] != "Video not found" {
			t.Errorf("unknown video = %v", body)
		}
	}
}

func TestVideoRequestErrors(t *testing.T) {
	w := start(t, Config{TaskType: "I2V"})
	for _, body := range []string{`{"seconds":4}`, `{"prompt":`} {
		r := call(t, w, "POST", "/v1/videos", body).expect(t, 400)
		if d, _ := r["detail"].(string); !strings.HasPrefix(d, "Invalid request body") {
			t.Errorf("%s: %v", body, r)
		}
	}
	fields := map[string]string{"prompt": "p", "size": "64x64", "num_frames": "4"}
	noRef := postForm(t, w, "/v1/videos", fields).expect(t, 400)
	if noRef["detail"] != "input_reference file is required" {
		t.Errorf("no input_reference: %v", noRef)
	}
	noPrompt := postForm(t, w, "/v1/videos", map[string]string{"size": "64x64"}, "input_reference").expect(t, 400)
	if noPrompt["detail"] != "prompt is required" {
		t.Errorf("no prompt: %v", noPrompt)
	}
	if ok := postForm(t, w, "/v1/videos", fields, "input_reference").expect(t, 200); ok["status"] != "queued" {
		t.Errorf("multipart video = %v", ok)
	}

	image := start(t, Config{TaskType: "T2I"})
	r := call(t, image, "POST", "/v1/videos", `{"prompt":"p"}`).expect(t, 400)
	if d, _ := r["detail"].(string); !strings.Contains(d, "video-capable") {
		t.Errorf("image model: %v", r)
	}
}

func TestWeightUpdateWaitsForQueuedJobs(t *testing.T) {
	w := start(t, Config{UnitMs: 10})
	type result struct {
		name string
		r    reply
	}
	results := make(chan result, 3)
	submit := func(name, path, body string, waiting int) {
		go func() { results <- result{name, call(t, w, "POST", path, body)} }()
		waitQueue(t, w, waiting)
	}
	submit("before", "/v1/images/generations", imageJob(10), 0)
	submit("update", "/update_weights_from_disk", `{"model_path":"/ckpt/2","weight_version":"v2"}`, 1)
	submit("after", "/v1/images/generations", imageJob(1), 2)

	var order []string
	got := map[string]reply{}
	for range 3 {
		res := <-results
		order = append(order, res.name)
		got[res.name] = res.r
	}
	if !slices.Equal(order, []string{"before", "update", "after"}) {
		t.Errorf("completion order %v", order)
	}
	if v := got["before"].expect(t, 200)["weight_version"]; v != "fake/diffusion-model" {
		t.Errorf("job queued before the update ran with %v", v)
	}
	if u := got["update"].expect(t, 200); u["success"] != true {
		t.Errorf("update = %v", u)
	}
	after := got["after"]
	if v := after.expect(t, 200)["weight_version"]; v != "v2" || after.header.Get("X-Weight-Version") != "v2" {
		t.Errorf("job queued after the update ran with %v (header %q)", v, after.header.Get("X-Weight-Version"))
	}

	call(t, w, "POST", "/update_weights_from_disk", `{"model_path":"/ckpt/3"}`).expect(t, 200)
	if v := w.WeightVersion(); v != "/ckpt/3" {
		t.Errorf("version %q, want the model path", v)
	}
	for _, body := range []string{`{"flush_cache":true}`, `{"model_path":`, `{"model_path":"x","target_modules":"all"}`} {
		if r := call(t, w, "POST", "/update_weights_from_disk", body).expect(t, 400); r["success"] != false {
			t.Errorf("%s: %v", body, r)
		}
	}
}

func TestTensorUpdateAndChecksum(t *testing.T) {
	w := start(t, Config{})
	before := call(t, w, "POST", "/get_weights_checksum", "").expect(t, 200)
	call(t, w, "POST", "/update_weights_from_tensor", `{"serialized_named_tensors":[]}`).expect(t, 400)
	call(t, w, "POST", "/update_weights_from_tensor", `{"serialized_named_tensors":["abc"]}`).expect(t, 200)
	if v := w.WeightVersion(); v != "fake/diffusion-model" {
		t.Errorf("version changed to %q without weight_version", v)
	}
	call(t, w, "POST", "/update_weights_from_tensor", `{"serialized_named_tensors":["abc"],"weight_version":"v3"}`).expect(t, 200)
	if v := w.WeightVersion(); v != "v3" {
		t.Errorf("version %q, want v3", v)
	}
	after := call(t, w, "POST", "/get_weights_checksum", `{"module_names":["transformer"]}`).expect(t, 200)
	if len(after) != 1 || after["transformer"] == before["transformer"] || len(before) != 3 {
		t.Errorf("checksums before %v, after %v", before, after)
	}
}

func TestSleepAndWake(t *testing.T) {
	w := start(t, Config{})
	for range 2 {
		if r := call(t, w, "POST", "/release_memory_occupation", "").expect(t, 200); r["success"] != true {
			t.Errorf("release = %v", r)
		}
	}
	asleep := call(t, w, "POST", "/v1/images/generations", imageJob(1)).expect(t, 503)
	if d, _ := asleep["detail"].(string); !strings.Contains(d, "resume_memory_occupation") {
		t.Errorf("asleep = %v", asleep)
	}
	if info := call(t, w, "GET", "/server_info", "").expect(t, 200); info["is_sleeping"] != true {
		t.Errorf("server_info = %v", info)
	}
	for range 2 {
		call(t, w, "POST", "/resume_memory_occupation", "").expect(t, 200)
	}
	call(t, w, "POST", "/v1/images/generations", imageJob(1)).expect(t, 200)
	if s := w.Stats(); s.Jobs != 1 {
		t.Errorf("%d jobs, want 1", s.Jobs)
	}
}

func TestHealthFaults(t *testing.T) {
	failing := start(t, Config{HealthFail: true})
	call(t, failing, "GET", "/health", "").expect(t, 503)

	slow := start(t, Config{HealthDelay: 50 * time.Millisecond})
	begin := time.Now()
	call(t, slow, "GET", "/health", "").expect(t, 200)
	if elapsed := time.Since(begin); elapsed < 50*time.Millisecond {
		t.Errorf("health answered after %v", elapsed)
	}
}

func TestFailRate(t *testing.T) {
	w := start(t, Config{FailRate: 1})
	r := call(t, w, "POST", "/v1/images/generations", imageJob(1)).expect(t, 500)
	if d, _ := r["detail"].(string); !strings.HasPrefix(d, "Generation failed") {
		t.Errorf("failure = %v", r)
	}
	if s := w.Stats(); s.Failed != 1 || s.Jobs != 0 {
		t.Errorf("stats %+v", s)
	}

	statuses := func() []int {
		w := start(t, Config{FailRate: 0.5, Seed: 42})
		var got []int
		for range 8 {
			got = append(got, call(t, w, "POST", "/v1/images/generations", imageJob(1)).status)
		}
		return got
	}
	first, second := statuses(), statuses()
	if !slices.Equal(first, second) || !slices.Contains(first, 500) || !slices.Contains(first, 200) {
		t.Errorf("seeded failures not deterministic or not mixed: %v vs %v", first, second)
	}
}

func TestCrashAfter(t *testing.T) {
	w := start(t, Config{CrashAfter: 1})
	call(t, w, "POST", "/v1/images/generations", imageJob(1)).expect(t, 200)
	if r, err := send(context.Background(), "POST", w.URL()+"/v1/images/generations", "application/json", []byte(imageJob(1))); err == nil {
		t.Errorf("job after the crash got an answer: %d %s", r.status, r.body)
	}
	if r, err := send(context.Background(), "GET", w.URL()+"/health", "", nil); err == nil {
		t.Errorf("crashed worker still answers: %d", r.status)
	}
	if s := w.Stats(); s.Jobs != 1 {
		t.Errorf("%d jobs, want 1", s.Jobs)
	}
}

func TestHangAfter(t *testing.T) {
	w := start(t, Config{HangAfter: 1})
	call(t, w, "POST", "/v1/images/generations", imageJob(1)).expect(t, 200)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	hung := make(chan error, 1)
	go func() {
		_, err := send(ctx, "POST", w.URL()+"/v1/images/generations", "application/json", []byte(imageJob(1)))
		hung <- err
	}()
	waitQueue(t, w, 0) // the hung job runs
	cancel()
	if err := <-hung; err == nil {
		t.Fatal("hung job answered")
	}
	waitQueue(t, w, 0) // the hung job keeps the worker after its client gave up

	queued := make(chan error)
	go func() {
		_, err := send(context.Background(), "POST", w.URL()+"/v1/images/generations", "application/json", []byte(imageJob(1)))
		queued <- err
	}()
	waitQueue(t, w, 1)
	w.Close()
	w.Close()
	select {
	case <-queued:
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not end the job queued behind the hung one")
	}
	waitFor(t, "slot freed by Close", func() bool { busy, _ := queue(w); return !busy })
	if s := w.Stats(); s.Jobs != 1 {
		t.Errorf("%d jobs, want 1", s.Jobs)
	}
}

// npyHeader checks a base64 .npy blob of float32 zeros and returns its header.
func npyHeader(t *testing.T, b64 string) string {
	t.Helper()
	b, err := base64.StdEncoding.DecodeString(b64)
	if err != nil || !bytes.HasPrefix(b, []byte("\x93NUMPY\x01\x00")) {
		t.Fatalf("not an npy blob: %v", err)
	}
	n := int(binary.LittleEndian.Uint16(b[8:10]))
	if (10+n)%64 != 0 || b[10+n-1] != '\n' {
		t.Errorf("npy header of %d bytes is not aligned", n)
	}
	return string(b[10 : 10+n])
}

func TestDiffusionGenerate(t *testing.T) {
	w := start(t, Config{ImageBytes: 32})
	body := call(t, w, "POST", "/v1/diffusion/generate",
		`{"prompt":"p","width":64,"height":64,"num_inference_steps":2,"num_outputs_per_prompt":2,"get_latents":true,"get_log_probs":true}`).expect(t, 200)
	if out, _ := base64.StdEncoding.DecodeString(body["output_b64"].(string)); len(out) != 32 || body["output_format"] != "png" {
		t.Errorf("output: %d bytes, format %v", len(out), body["output_format"])
	}
	traj := body["trajectory"].(map[string]any)
	if h := npyHeader(t, traj["latents"].(string)); !strings.Contains(h, "'shape': (2, 3, 16, 1, 8, 8)") {
		t.Errorf("latents header %q", h)
	}
	if h := npyHeader(t, traj["log_probs"].(string)); !strings.Contains(h, "'shape': (2, 2)") {
		t.Errorf("log_probs header %q", h)
	}
	if ts := traj["timesteps"].([]any); len(ts) != 2 || !strings.Contains(npyHeader(t, ts[0].(string)), "'shape': ()") {
		t.Errorf("timesteps %v", ts)
	}
	plain := call(t, w, "POST", "/v1/diffusion/generate", `{"prompt":"p","size":"64x64"}`).expect(t, 200)
	if plain["trajectory"] != nil {
		t.Errorf("unrequested trajectory: %v", plain["trajectory"])
	}
	call(t, w, "POST", "/v1/diffusion/generate", `{"size":"64x64"}`).expect(t, 422)
}

// safetensorsHeader checks a rollout tensor and returns its safetensors header.
func safetensorsHeader(t *testing.T, tensor any) map[string]any {
	t.Helper()
	m := tensor.(map[string]any)
	if m["__tensor__"] != true || m["dtype"] != "torch.float32" {
		t.Fatalf("not a tensor: %v", m)
	}
	b, err := base64.StdEncoding.DecodeString(m["data"].(string))
	if err != nil || len(b) < 8 {
		t.Fatalf("bad tensor data: %v", err)
	}
	n := binary.LittleEndian.Uint64(b)
	var header map[string]map[string]any
	if err := json.Unmarshal(b[8:8+n], &header); err != nil || n%8 != 0 {
		t.Fatalf("bad safetensors header %q: %v", b[8:8+n], err)
	}
	want := 4 * elements(toInts(m["shape"].([]any)))
	if offsets := header["t"]["data_offsets"].([]any); offsets[1] != float64(want) || len(b) != int(8+n)+want {
		t.Errorf("data offsets %v, %d bytes of data, want %d", offsets, len(b)-int(8+n), want)
	}
	return header["t"]
}

func toInts(a []any) []int {
	ns := make([]int, len(a))
	for i, v := range a {
		ns[i] = int(v.(int64))
	}
	return ns
}

func TestRollout(t *testing.T) {
	w := start(t, Config{ImageBytes: 40})
	r := call(t, w, "POST", "/rollout/generate",
		`{"prompt":"p","width":64,"height":64,"num_inference_steps":3,"num_outputs_per_prompt":2,"seed":7,"rollout_return_dit_trajectory":true}`)
	if r.status != 200 || r.header.Get("Content-Type") != "application/msgpack" || r.header.Get("X-Weight-Version") == "" {
		t.Fatalf("rollout: %d %v", r.status, r.header)
	}
	decoded, err := decodeMsgpack(r.body)
	if err != nil {
		t.Fatal(err)
	}
	samples := decoded.([]any)
	if len(samples) != 2 {
		t.Fatalf("%d samples, want 2", len(samples))
	}
	s := samples[0].(map[string]any)
	if s["seed"] != int64(7) || s["prompt"] != "p" || s["request_id"] != samples[1].(map[string]any)["request_id"] ||
		s["denoising_env"] != nil || s["weight_version"] != "fake/diffusion-model" {
		t.Errorf("sample = %v", s)
	}
	if h := safetensorsHeader(t, s["generated_output"]); h["dtype"] != "F32" {
		t.Errorf("generated_output header %v", h)
	}
	safetensorsHeader(t, s["rollout_log_probs"])
	if debug := s["rollout_debug_tensors"].(map[string]any); len(debug) != 4 {
		t.Errorf("debug tensors %v", debug)
	}
	latents := s["dit_trajectory"].(map[string]any)["latents"]
	if shape := toInts(latents.(map[string]any)["shape"].([]any)); !slices.Equal(shape, []int{4, 16, 1, 8, 8}) {
		t.Errorf("latents shape %v", shape)
	}

	r = call(t, w, "POST", "/rollout/generate", `{"prompt":"p","width":64,"height":64,"rollout":false}`)
	decoded, err = decodeMsgpack(r.body)
	if err != nil {
		t.Fatal(err)
	}
	if s := decoded.([]any)[0].(map[string]any); s["rollout_log_probs"] != nil || s["rollout_debug_tensors"] != nil {
		t.Errorf("evaluation sample carries RL tensors: %v", s)
	}
	call(t, w, "POST", "/rollout/generate", `{"prompt":1}`).expect(t, 422)
}

func TestServeAndClose(t *testing.T) {
	w := New(Config{Name: "served"})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error)
	go func() { served <- w.Serve(ln) }()
	waitFor(t, "URL", func() bool { return w.URL() != "" })
	call(t, w, "GET", "/health", "").expect(t, 200)
	w.Close()
	if err := <-served; !errors.Is(err, http.ErrServerClosed) {
		t.Errorf("Serve = %v", err)
	}
	if err := w.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		t.Errorf("Serve after Close = %v", err)
	}
}

func TestHandlerServedElsewhere(t *testing.T) {
	w := New(Config{Name: "mounted", UnitMs: 1})
	defer w.Close()
	srv := httptest.NewServer(w.Handler())
	defer srv.Close()
	r, err := send(context.Background(), "POST", srv.URL+"/v1/images/generations", "application/json", []byte(imageJob(1)))
	if err != nil || r.status != 200 || r.header.Get("X-Fake-Worker") != "mounted" {
		t.Errorf("mounted handler: %d %v %v", r.status, r.header, err)
	}
	if w.URL() != "" {
		t.Errorf("URL = %q for a worker that does not serve", w.URL())
	}
}

func TestVideoModelRLShapes(t *testing.T) {
	w := start(t, Config{TaskType: "TI2V"})
	body := call(t, w, "POST", "/v1/diffusion/generate",
		`{"prompt":"p","size":"64x64","num_inference_steps":1,"num_frames":8,"get_latents":true}`).expect(t, 200)
	if body["output_format"] != "mp4" {
		t.Errorf("output_format %v", body["output_format"])
	}
	latents := body["trajectory"].(map[string]any)["latents"].(string)
	if h := npyHeader(t, latents); !strings.Contains(h, "'shape': (1, 2, 16, 2, 8, 8)") {
		t.Errorf("latents header %q", h)
	}
	if s := w.Stats(); s.Cost != Cost(64, 64, 1, 8, 1) {
		t.Errorf("cost %v", s.Cost)
	}
}
