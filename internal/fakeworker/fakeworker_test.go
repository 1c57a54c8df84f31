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
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/msgpack"
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

// imageBody is an image request of cost steps, asking for base64 as real
// clients do (sglang's default, "url", needs cloud storage).
func imageBody(steps int) string {
	return `{"prompt":"p","size":"1024x1024","response_format":"b64_json","num_inference_steps":` + strconv.Itoa(steps) + `}`
}

// plain500 checks sglang's answer to an exception it lets through.
func (r reply) plain500(t *testing.T) {
	t.Helper()
	if r.status != 500 || r.header.Get("Content-Type") != "text/plain; charset=utf-8" || string(r.body) != "Internal Server Error" {
		t.Errorf("got %d %q %.200q, want 500 Internal Server Error in plain text", r.status, r.header.Get("Content-Type"), r.body)
	}
}

// list decodes a list body, JSON or (by its Content-Type) msgpack. A
// msgpack list is given JSON's types (numbers as float64), so that one set
// of checks reads both forms of a rollout answer.
func (r reply) list(t *testing.T) []map[string]any {
	t.Helper()
	var l []map[string]any
	if r.header.Get("Content-Type") == "application/msgpack" {
		v, err := msgpack.Unmarshal(r.body)
		if err != nil {
			t.Fatalf("msgpack body %.200q: %v", r.body, err)
		}
		for _, e := range v.([]any) {
			l = append(l, asJSON(e).(map[string]any))
		}
		return l
	}
	if err := json.Unmarshal(r.body, &l); err != nil {
		t.Fatalf("body %.200q: %v", r.body, err)
	}
	return l
}

// asJSON gives a decoded msgpack value the types encoding/json gives the
// same value: numbers float64.
func asJSON(v any) any {
	switch v := v.(type) {
	case int64:
		return float64(v)
	case uint64:
		return float64(v)
	case []any:
		for i := range v {
			v[i] = asJSON(v[i])
		}
	case map[string]any:
		for k := range v {
			v[k] = asJSON(v[k])
		}
	}
	return v
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
		if body := r.expect(t, 200); len(body) != 1 || body["status"] != "ok" {
			t.Errorf("%s = %v", path, body)
		}
		if got := r.header.Get("X-Fake-Worker"); got != "w1" {
			t.Errorf("X-Fake-Worker = %q", got)
		}
	}
	info := call(t, w, "GET", "/server_info", "").expect(t, 200)
	if len(info) != 5 || info["model_path"] != "fake/diffusion-model" || info["served_model_name"] != "fake/diffusion-model" ||
		info["tp_size"] != 1.0 || info["dp_size"] != 1.0 || info["version"] == nil {
		t.Errorf("/server_info = %v", info)
	}
	model := call(t, w, "GET", "/model_info", "").expect(t, 200)
	if model["model_type"] != "diffusion" || model["task_type"] != "T2V" || model["is_image_gen"] != false ||
		model["is_generation"] != true || model["has_image_understanding"] != false ||
		!slices.Equal(model["architectures"].([]any), []any{"WanPipeline"}) {
		t.Errorf("/model_info = %v", model)
	}
	if v1 := call(t, w, "GET", "/v1/model_info", "").expect(t, 200); len(v1) != 1 || v1["model_path"] != "fake/diffusion-model" {
		t.Errorf("/v1/model_info = %v", v1)
	}
	legacy := call(t, w, "GET", "/models", "").expect(t, 200)
	if legacy["pipeline_name"] != "wan" || legacy["pipeline_class"] != "WanPipeline" || legacy["task_type"] != "T2V" {
		t.Errorf("/models = %v", legacy)
	}
	models := call(t, w, "GET", "/v1/models", "").expect(t, 200)
	card := models["data"].([]any)[0].(map[string]any)
	if models["object"] != "list" || card["id"] != "fake/diffusion-model" || card["object"] != "model" || card["task_type"] != "T2V" ||
		card["owned_by"] != "sglang" || card["pipeline_name"] != "wan" || card["pipeline_class"] != "WanPipeline" {
		t.Errorf("/v1/models = %v", models)
	}
	call(t, w, "GET", "/v1/models/fake/diffusion-model", "").expect(t, 200)
	notFound := call(t, w, "GET", "/v1/models/other", "").expect(t, 404)
	if e := notFound["error"].(map[string]any); e["code"] != "model_not_found" || e["message"] != "The model 'other' does not exist" {
		t.Errorf("unknown model = %v", notFound)
	}

	custom := start(t, Config{TaskType: "TI2I", PipelineName: "qwen_image_edit", PipelineClass: "QwenImageEditPipeline"})
	card = call(t, custom, "GET", "/v1/models", "").expect(t, 200)["data"].([]any)[0].(map[string]any)
	model = call(t, custom, "GET", "/model_info", "").expect(t, 200)
	if card["pipeline_name"] != "qwen_image_edit" || model["has_image_understanding"] != true || model["is_image_gen"] != true {
		t.Errorf("TI2I worker: card %v, model_info %v", card, model)
	}
}

// uuidShape is the shape of the ids sglang's generate_request_id makes.
var uuidShape = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

func TestImageGenerations(t *testing.T) {
	w := start(t, Config{ImageBytes: 100})
	r := call(t, w, "POST", "/v1/images/generations", `{"prompt":"cat","size":"64x32","num_inference_steps":4,"n":3,"response_format":"b64_json"}`)
	body := r.expect(t, 200)
	data := body["data"].([]any)
	if len(data) != 3 {
		t.Fatalf("%d outputs, want 3", len(data))
	}
	first := data[0].(map[string]any)
	img, err := base64.StdEncoding.DecodeString(first["b64_json"].(string))
	if err != nil || len(img) != 100 || !bytes.HasPrefix(img, []byte("\xff\xd8\xff")) {
		t.Errorf("image: %d bytes, err %v; sglang's default output is a JPEG", len(img), err)
	}
	id, _ := body["id"].(string)
	if first["revised_prompt"] != "cat" || first["url"] != nil || !strings.HasSuffix(first["file_path"].(string), id+"_0.jpg") ||
		!uuidShape.MatchString(id) || body["inference_time_s"] == nil {
		t.Errorf("answer = %v", body)
	}
	// pydantic writes ImageResponse's fields in order: the id comes first,
	// ahead of the base64, where a router can read it.
	if want := `{"id":"` + id + `","created":`; !bytes.HasPrefix(r.body, []byte(want)) {
		t.Errorf("answer begins %.60s; want %s", r.body, want)
	}
	if _, ok := body["weight_version"]; ok || r.header.Get("X-Weight-Version") != "" {
		t.Errorf("the worker named a weight version: %v %v", body["weight_version"], r.header)
	}
	if s := w.Stats(); s.Jobs != 1 || s.Cost != Cost(64, 32, 4, 1, 3) || s.Busy <= 0 {
		t.Errorf("stats = %+v", s)
	}

	clamped := call(t, w, "POST", "/v1/images/generations", `{"prompt":"cat","size":"8x8","n":50,"response_format":"b64_json"}`).expect(t, 200)
	if n := len(clamped["data"].([]any)); n != maxImagesPerPrompt {
		t.Errorf("n=50 gave %d outputs, want %d", n, maxImagesPerPrompt)
	}
	png := call(t, w, "POST", "/v1/images/generations", `{"prompt":"cat","size":"8x8","response_format":"B64_JSON","output_format":"png"}`).expect(t, 200)
	if b, _ := base64.StdEncoding.DecodeString(png["data"].([]any)[0].(map[string]any)["b64_json"].(string)); !bytes.HasPrefix(b, []byte("\x89PNG")) {
		t.Errorf("output_format png gave %q", b[:4])
	}
	// An explicit null is None, not the default "url": base64 then.
	call(t, w, "POST", "/v1/images/generations", `{"prompt":"cat","size":"8x8","response_format":null}`).expect(t, 200)
	// A size that does not parse is ignored, as _parse_size does.
	call(t, w, "POST", "/v1/images/generations", `{"prompt":"cat","size":"big","num_inference_steps":1,"response_format":"b64_json"}`).expect(t, 200)
	if s := w.Stats(); s.Cost != Cost(64, 32, 4, 1, 3)+Cost(8, 8, 20, 1, 10)+2*Cost(8, 8, 20, 1, 1)+Cost(1024, 1024, 1, 1, 1) {
		t.Errorf("cost %v", s.Cost)
	}
	// Image requests run on video models too: sglang's image API does not check.
	video := start(t, Config{TaskType: "T2V"})
	call(t, video, "POST", "/v1/images/generations", `{"prompt":"p","size":"8x8","response_format":"b64_json"}`).expect(t, 200)
}

// TestMediaAnswersDeclareTheirLength: an answer that carries media in
// base64 has a Content-Length, as Starlette's JSONResponse sends it, not
// a chunked body, however large.
func TestMediaAnswersDeclareTheirLength(t *testing.T) {
	for name, tc := range map[string]struct {
		cfg        Config
		path, body string
	}{
		"image":   {Config{ImageBytes: 300 << 10}, "/v1/images/generations", `{"prompt":"cat","size":"64x32","num_inference_steps":1,"n":3,"response_format":"b64_json"}`},
		"rollout": {Config{ImageBytes: 300 << 10, RolloutJSON: true}, "/rollout/generate", rolloutBody},
	} {
		w := start(t, tc.cfg)
		r := call(t, w, "POST", tc.path, tc.body)
		if r.status != 200 || r.header.Get("Content-Length") != strconv.Itoa(len(r.body)) || len(r.body) < 300<<10 {
			t.Errorf("%s: status %d, Content-Length %q for %d bytes", name, r.status, r.header.Get("Content-Length"), len(r.body))
		}
	}
}

func TestImageGenerationErrors(t *testing.T) {
	tests := []struct {
		name, body string
		status     int
		detail     string // a substring of a string detail, the type of the first field error, or "" for plain text
		jobs       int    // jobs the worker ran anyway
	}{
		{"invalid JSON", `{"prompt":`, 422, "json_invalid", 0},
		{"empty body", ``, 422, "missing", 0},
		{"no prompt", `{"n":1}`, 422, "missing", 0},
		{"n not an int", `{"prompt":"p","n":"two"}`, 422, "int_type", 0},
		{"zero steps", `{"prompt":"p","num_inference_steps":0}`, 500, "", 0},
		{"stream", `{"prompt":"p","stream":true}`, 400, "Use /v1/images/generations/stream for realtime streaming responses.", 0},
		{"default format is url", `{"prompt":"p","size":"8x8"}`, 400, "response_format='url' requires cloud storage to be configured.", 1},
		{"url format", `{"prompt":"p","size":"8x8","response_format":"url"}`, 400, "cloud storage", 1},
		{"unknown format", `{"prompt":"p","size":"8x8","response_format":"gif"}`, 400, "response_format=gif is not supported", 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := start(t, Config{})
			r := call(t, w, "POST", "/v1/images/generations", tt.body)
			switch {
			case tt.detail == "":
				r.plain500(t)
			case tt.status == 422:
				if got := firstFieldError(t, r.expect(t, 422))["type"]; got != tt.detail {
					t.Errorf("field error type %v, want %s", got, tt.detail)
				}
			default:
				if d, _ := r.expect(t, tt.status)["detail"].(string); !strings.Contains(d, tt.detail) {
					t.Errorf("detail %q, want it to contain %q", d, tt.detail)
				}
			}
			if got := w.Stats().Jobs; got != tt.jobs {
				t.Errorf("%d jobs ran, want %d", got, tt.jobs)
			}
		})
	}
}

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
	if ok["data"].([]any)[0].(map[string]any)["b64_json"] == nil {
		t.Errorf("edits default to b64_json: %v", ok)
	}
	if s := w.Stats(); s.Cost != Cost(64, 64, 3, 1, 2) {
		t.Errorf("cost %v", s.Cost)
	}
	// Without cloud storage, a "url" edit names the worker's own copy.
	url := postForm(t, w, "/v1/images/edits", map[string]string{"prompt": "p", "response_format": "url"}, "image").expect(t, 200)
	item := url["data"].([]any)[0].(map[string]any)
	if want := "/v1/images/" + url["id"].(string) + "/content"; item["url"] != want || item["b64_json"] != nil {
		t.Errorf("url edit = %v, want url %s", item, want)
	}
	if r := call(t, w, "GET", item["url"].(string), ""); r.status != 200 {
		t.Errorf("GET %s: %d", item["url"], r.status)
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

func TestImageContentAndDelete(t *testing.T) {
	w := start(t, Config{ImageBytes: 50})
	made := call(t, w, "POST", "/v1/images/generations", `{"prompt":"p","size":"8x8","response_format":"b64_json","output_format":"webp"}`).expect(t, 200)
	id := made["id"].(string)
	content := call(t, w, "GET", "/v1/images/"+id+"/content", "")
	if content.status != 200 || content.header.Get("Content-Type") != "image/webp" || len(content.body) != 50 ||
		!bytes.HasPrefix(content.body, []byte("RIFF")) || content.header.Get("Content-Disposition") != `attachment; filename="`+id+`.webp"` {
		t.Errorf("content: %d %v %d bytes", content.status, content.header, len(content.body))
	}
	// A url request fails after the job, but its images are kept.
	before := w.Stats().Jobs
	call(t, w, "POST", "/v1/images/generations", `{"prompt":"p","size":"8x8"}`).expect(t, 400)
	if w.Stats().Jobs != before+1 {
		t.Error("the url request did not run")
	}
	if deleted := call(t, w, "DELETE", "/v1/images/"+id, "").expect(t, 200); deleted["id"] != id || deleted["status"] != "deleted" {
		t.Errorf("delete = %v", deleted)
	}
	for _, r := range []reply{
		call(t, w, "GET", "/v1/images/"+id+"/content", ""),
		call(t, w, "DELETE", "/v1/images/"+id, ""),
		call(t, w, "GET", "/v1/images/unknown/content", ""),
	} {
		if body := r.expect(t, 404); body["detail"] != "Image not found" {
			t.Errorf("unknown image = %v", body)
		}
	}
}

func TestCloudStorage(t *testing.T) {
	w := start(t, Config{CloudStorage: "http://bucket.test/outputs/"})
	body := call(t, w, "POST", "/v1/images/generations", `{"prompt":"p","size":"8x8","n":2}`).expect(t, 200)
	id := body["id"].(string)
	data := body["data"].([]any)
	if item := data[0].(map[string]any); len(data) != 1 || item["url"] != "http://bucket.test/outputs/"+id+"_0.jpg" || item["b64_json"] != nil {
		t.Errorf("url answer = %v; sglang names the first upload only", body)
	}
	r := call(t, w, "GET", "/v1/images/"+id+"/content", "").expect(t, 400)
	if r["detail"] != "Image has been uploaded to cloud storage. Please use the cloud URL: http://bucket.test/outputs/"+id+"_0.jpg" {
		t.Errorf("content of an uploaded image = %v", r)
	}

	video := start(t, Config{TaskType: "T2V", CloudStorage: "http://bucket.test"})
	vid := call(t, video, "POST", "/v1/videos", `{"prompt":"p","size":"8x8","num_frames":1,"num_inference_steps":1}`).expect(t, 200)["id"].(string)
	var job map[string]any
	waitFor(t, "video", func() bool {
		job = call(t, video, "GET", "/v1/videos/"+vid, "").expect(t, 200)
		return job["status"] == "completed"
	})
	if job["url"] != "http://bucket.test/"+vid+".mp4" || job["file_path"] != nil {
		t.Errorf("uploaded video = %v", job)
	}
	if r := call(t, video, "GET", "/v1/videos/"+vid+"/content", "").expect(t, 400); !strings.HasPrefix(r["detail"].(string), "Video has been uploaded to cloud storage") {
		t.Errorf("content of an uploaded video = %v", r)
	}
}

// events reads a server-sent event stream.
func events(t *testing.T, body []byte) (evs []map[string]any, done bool) {
	t.Helper()
	for _, block := range strings.Split(strings.TrimSuffix(string(body), "\n\n"), "\n\n") {
		lines := strings.Split(block, "\n")
		data, ok := strings.CutPrefix(lines[len(lines)-1], "data: ")
		if !ok {
			t.Fatalf("event without data: %q", block)
		}
		if data == "[DONE]" {
			return evs, true
		}
		var ev map[string]any
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			t.Fatalf("event %q: %v", data, err)
		}
		if want := "id: " + strconv.Itoa(int(ev["seq"].(float64))); lines[0] != want {
			t.Errorf("event id line %q, want %q", lines[0], want)
		}
		evs = append(evs, ev)
	}
	return evs, false
}

func TestImageStream(t *testing.T) {
	w := start(t, Config{ImageBytes: 20})
	r := call(t, w, "POST", "/v1/images/generations/stream", `{"prompt":"p","size":"8x8","response_format":"b64_json"}`)
	if r.status != 200 || r.header.Get("Content-Type") != "text/event-stream; charset=utf-8" {
		t.Fatalf("stream: %d %v", r.status, r.header)
	}
	evs, done := events(t, r.body)
	if len(evs) != 2 || !done {
		t.Fatalf("events %v, [DONE] %v", evs, done)
	}
	accepted, completed := evs[0], evs[1]
	id := accepted["id"].(string)
	if !uuidShape.MatchString(id) {
		t.Errorf("stream id %q is not a uuid", id)
	}
	if accepted["type"] != "accepted" || accepted["kind"] != "image" || accepted["cancel_on_disconnect"] != false || accepted["expires_at"] == nil {
		t.Errorf("accepted = %v", accepted)
	}
	result, _ := completed["result"].(map[string]any)
	if completed["type"] != "completed" || completed["id"] != id || result["id"] != id || len(result["data"].([]any)) != 1 {
		t.Errorf("completed = %v", completed)
	}
	if r := call(t, w, "GET", "/v1/images/"+id+"/content", ""); r.status != 200 {
		t.Errorf("content of a streamed job: %d", r.status)
	}
	if d := call(t, w, "DELETE", "/v1/images/"+id, "").expect(t, 200); d["status"] != "deleted" {
		t.Errorf("delete of a finished stream = %v", d)
	}

	// The default response_format, url, fails in the stream once the job ran.
	evs, _ = events(t, call(t, w, "POST", "/v1/images/generations/stream", `{"prompt":"p","size":"8x8"}`).body)
	if last := evs[len(evs)-1]; last["type"] != "error" || last["error"] != "400: response_format='url' requires cloud storage to be configured." {
		t.Errorf("url stream ended with %v", last)
	}
	call(t, w, "POST", "/v1/images/generations/stream", `{"prompt":"p","realtime_session_ttl_seconds":-1}`).expect(t, 400)

	// A DELETE cancels a streamed job that has not ended.
	slow := start(t, Config{UnitMs: 10})
	got := make(chan reply)
	go func() { got <- call(t, slow, "POST", "/v1/images/generations/stream", imageBody(100)) }()
	var id2 string
	waitFor(t, "stream job", func() bool {
		slow.mu.Lock()
		defer slow.mu.Unlock()
		for k := range slow.images.entries {
			id2 = k
		}
		return id2 != ""
	})
	if d := call(t, slow, "DELETE", "/v1/images/"+id2, "").expect(t, 200); d["status"] != "cancelling" {
		t.Errorf("delete of a running stream = %v", d)
	}
	evs, done = events(t, (<-got).body)
	if last := evs[len(evs)-1]; last["type"] != "cancelled" || !done {
		t.Errorf("cancelled stream ended with %v", evs)
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
			call(t, w, "POST", "/v1/images/generations", imageBody(steps)).expect(t, 200)
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
	go func() { done <- call(t, w, "POST", "/v1/images/generations", imageBody(100)) }()
	waitQueue(t, w, 0)

	ctx, cancel := context.WithCancel(context.Background())
	left := make(chan error)
	go func() {
		_, err := send(ctx, "POST", w.URL()+"/v1/images/generations", "application/json", []byte(imageBody(1)))
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
		_, err := send(ctx, "POST", w.URL()+"/v1/images/generations", "application/json", []byte(imageBody(10)))
		left <- err
	}()
	waitQueue(t, w, 0)
	cancel()
	if err := <-left; err == nil {
		t.Fatal("cancelled request succeeded")
	}
	call(t, w, "POST", "/v1/images/generations", imageBody(1)).expect(t, 200)
	if elapsed := time.Since(begin); elapsed < 100*time.Millisecond {
		t.Errorf("second job done after %v: it did not wait for the abandoned 100 ms job", elapsed)
	}
	if s := w.Stats(); s.Jobs != 2 {
		t.Errorf("%d jobs, want 2", s.Jobs)
	}
}

func TestVideoLifecycle(t *testing.T) {
	w := start(t, Config{TaskType: "T2V", ImageBytes: 64})
	stopped := time.Now()
	w.mu.Lock()
	w.clock = func() time.Time { return stopped }
	w.mu.Unlock()
	created := call(t, w, "POST", "/v1/videos", `{"prompt":"p","size":"1024x1024","num_inference_steps":10,"num_frames":20}`).expect(t, 200)
	id, _ := created["id"].(string)
	if created["object"] != "video" || created["status"] != "queued" || created["model"] != "sora-2" ||
		created["size"] != "1024x1024" || created["seconds"] != "1" || !strings.HasPrefix(id, "video_") ||
		created["url"] != nil || !strings.HasSuffix(created["file_path"].(string), id+".mp4") {
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
	if _, ok := job["weight_version"]; ok || job["progress"] != 100.0 || job["completed_at"] == nil || job["inference_time_s"] == nil {
		t.Errorf("completed job = %v", job)
	}
	content := call(t, w, "GET", "/v1/videos/"+id+"/content", "")
	if content.status != 200 || content.header.Get("Content-Type") != "video/mp4" || content.header.Get("X-Weight-Version") != "" ||
		len(content.body) != 64 || string(content.body[4:8]) != "ftyp" ||
		content.header.Get("Content-Disposition") != `attachment; filename="`+id+`.mp4"` {
		t.Errorf("content: %d %v %d bytes", content.status, content.header, len(content.body))
	}
	if s := w.Stats(); s.Jobs != 1 || s.Cost != 200 {
		t.Errorf("stats %+v", s)
	}

	second := call(t, w, "POST", "/v1/videos", `{"prompt":"q","size":"64x64","extra_body":{"num_frames":4}}`).expect(t, 200)
	secondID := second["id"].(string)
	w.mu.Lock()
	w.clock = func() time.Time { return stopped.Add(time.Second) }
	w.mu.Unlock()
	third := call(t, w, "POST", "/v1/videos", `{"prompt":"r","size":"64x64","num_frames":1}`).expect(t, 200)["id"].(string)
	listIDs := func(query string) []string {
		var ids []string
		for _, j := range call(t, w, "GET", "/v1/videos"+query, "").expect(t, 200)["data"].([]any) {
			ids = append(ids, j.(map[string]any)["id"].(string))
		}
		return ids
	}
	// By created_at, in seconds; jobs of the same second stay in creation
	// order, descending or not, as Python's stable sort leaves them.
	for query, want := range map[string][]string{
		"":                              {third, id, secondID},
		"?order=asc":                    {id, secondID, third},
		"?order=sideways":               {third, id, secondID},
		"?limit=1":                      {third},
		"?order=asc&after=" + id:        {secondID, third},
		"?after=unknown":                nil,
		"?video_id=" + secondID:         {third, id, secondID}, // not a filter: the whole list
		"?video_id=x&order=asc&limit=2": {id, secondID},
	} {
		if got := listIDs(query); !slices.Equal(got, want) {
			t.Errorf("list%s = %v, want %v", query, got, want)
		}
	}
	for query, typ := range map[string]string{"0": "greater_than_equal", "101": "less_than_equal", "x": "int_parsing"} {
		if fe := firstFieldError(t, call(t, w, "GET", "/v1/videos?limit="+query, "").expect(t, 422)); fe["type"] != typ {
			t.Errorf("limit=%s: %v", query, fe)
		}
	}

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
	noReference := "input_reference or reference_url is required for image-to-video generation"
	for body, want := range map[string]string{
		`{"seconds":4}`:  "Invalid request body: 400: " + noReference,
		`{"prompt":`:     "Invalid request body: 400: " + noReference,
		`{"prompt":"p"}`: "Invalid request body: 400: " + noReference,
		`{"seconds":4,"reference_url":"http://x/i.png"}`: "Invalid request body: ",
	} {
		r := call(t, w, "POST", "/v1/videos", body).expect(t, 400)
		if d, _ := r["detail"].(string); !strings.HasPrefix(d, want) {
			t.Errorf("%s: %v, want %q", body, r, want)
		}
	}
	fields := map[string]string{"prompt": "p", "size": "64x64", "num_frames": "4"}
	noRef := postForm(t, w, "/v1/videos", fields).expect(t, 400)
	if noRef["detail"] != noReference {
		t.Errorf("no input_reference: %v", noRef)
	}
	noPrompt := postForm(t, w, "/v1/videos", map[string]string{"size": "64x64"}, "input_reference").expect(t, 400)
	if noPrompt["detail"] != "prompt is required" {
		t.Errorf("no prompt: %v", noPrompt)
	}
	if ok := postForm(t, w, "/v1/videos", fields, "input_reference").expect(t, 200); ok["status"] != "queued" {
		t.Errorf("multipart video = %v", ok)
	}
	call(t, w, "POST", "/v1/videos", `{"prompt":"p","size":"64x64","num_frames":1,"input_reference":"/in.png"}`).expect(t, 200)
	if r := call(t, w, "POST", "/v1/videos", `{"prompt":"p","num_frames":0,"input_reference":"/in.png"}`).expect(t, 400); !strings.Contains(r["detail"].(string), "must be positive") {
		t.Errorf("zero frames: %v", r)
	}

	// sglang's video API takes a request on any model.
	image := start(t, Config{TaskType: "T2I"})
	if r := call(t, image, "POST", "/v1/videos", `{"prompt":"p","size":"8x8","num_frames":1}`).expect(t, 200); r["status"] != "queued" {
		t.Errorf("image model: %v", r)
	}
}

func TestFailedVideo(t *testing.T) {
	w := start(t, Config{TaskType: "T2V", FailRate: 1})
	id := call(t, w, "POST", "/v1/videos", `{"prompt":"p","size":"8x8","num_frames":1}`).expect(t, 200)["id"].(string)
	var job map[string]any
	waitFor(t, "failure", func() bool {
		job = call(t, w, "GET", "/v1/videos/"+id, "").expect(t, 200)
		return job["status"] == "failed"
	})
	if e := job["error"].(map[string]any); e["message"] != "Model generation returned no output. Error from scheduler: injected failure (--fail-rate)" {
		t.Errorf("failed job = %v", job)
	}
	if r := call(t, w, "GET", "/v1/videos/"+id+"/content", "").expect(t, 404); r["detail"] != "Generation is still in-progress" {
		t.Errorf("content of a failed job = %v", r)
	}
}

func TestWeightUpdateWaitsForQueuedJobs(t *testing.T) {
	w := start(t, Config{UnitMs: 10})
	type result struct {
		name    string
		r       reply
		weights string // what the worker ran when the answer came
	}
	results := make(chan result, 3)
	submit := func(name, path, body string, waiting int) {
		go func() {
			r := call(t, w, "POST", path, body)
			results <- result{name, r, w.Weights()}
		}()
		waitQueue(t, w, waiting)
	}
	submit("before", "/v1/images/generations", imageBody(50), 0)
	submit("update", "/update_weights_from_disk", `{"model_path":"/ckpt/2","weight_version":"v2"}`, 1)
	submit("after", "/v1/images/generations", imageBody(1), 2)

	var order []string
	got := map[string]result{}
	for range 3 {
		res := <-results
		order = append(order, res.name)
		got[res.name] = res
	}
	if !slices.Equal(order, []string{"before", "update", "after"}) {
		t.Errorf("completion order %v", order)
	}
	if got["before"].weights != "fake/diffusion-model" {
		t.Errorf("job queued before the update ended on %q", got["before"].weights)
	}
	u := got["update"].r.expect(t, 200)
	if len(u) != 2 || u["success"] != true || u["message"] != "Updated 3 modules (transformer, vae, text_encoder)." {
		t.Errorf("update = %v", u)
	}
	got["after"].r.expect(t, 200)
	if got["after"].weights != "/ckpt/2" || got["after"].r.header.Get("X-Weight-Version") != "" {
		t.Errorf("job queued after the update: weights %q, header %q", got["after"].weights, got["after"].r.header.Get("X-Weight-Version"))
	}
	if on := w.Stats().JobsOn; len(on) != 2 || on["fake/diffusion-model"] != 1 || on["/ckpt/2"] != 1 {
		t.Errorf("jobs by weights %v; want one on each", on)
	}

	partial := call(t, w, "POST", "/update_weights_from_disk", `{"model_path":"/ckpt/3","target_modules":["transformer"]}`).expect(t, 200)
	if w.Weights() != "/ckpt/3" || partial["message"] != "Updated 1 modules (transformer)." {
		t.Errorf("weights %q after %v", w.Weights(), partial)
	}
	for body, want := range map[string]string{
		`{"flush_cache":true}`:                         "model_path is required",
		`{"model_path":""}`:                            "model_path is required",
		`{"model_path":"x","target_modules":["unet"]}`: "Module(s) requested for update not found in pipeline: ['unet']. Available Module(s): ['transformer', 'vae', 'text_encoder']",
		`{"model_path":"x","target_modules":"vae"}`:    "Module(s) requested for update not found in pipeline: ['v', 'a', 'e']. Available Module(s): ['transformer', 'vae', 'text_encoder']",
	} {
		if r := call(t, w, "POST", "/update_weights_from_disk", body).expect(t, 400); r["success"] != false || r["message"] != want {
			t.Errorf("%s: %v, want %q", body, r, want)
		}
	}
	for _, body := range []string{``, `{"model_path":`, `["x"]`, `null`} {
		call(t, w, "POST", "/update_weights_from_disk", body).plain500(t)
	}
	if w.Weights() != "/ckpt/3" {
		t.Errorf("refused updates changed the weights to %q", w.Weights())
	}
}

func TestUpdateFail(t *testing.T) {
	w := start(t, Config{UpdateFail: true})
	disk := call(t, w, "POST", "/update_weights_from_disk", `{"model_path":"/ckpt/2"}`).expect(t, 400)
	if disk["success"] != false || disk["message"] != "Failed to update module 'transformer': injected failure (--update-fail). All modules rolled back to original weights." {
		t.Errorf("failed update = %v", disk)
	}
	tensor := call(t, w, "POST", "/update_weights_from_tensor", tensorBody(map[string][]byte{"w": {1}}, "")).expect(t, 400)
	if d, _ := tensor["message"].(string); tensor["success"] != false || !strings.HasPrefix(d, "Failed to update module 'transformer' from tensor: ") {
		t.Errorf("failed tensor update = %v", tensor)
	}
	if w.Weights() != "fake/diffusion-model" {
		t.Errorf("failed updates left %q", w.Weights())
	}
}

func TestSleepAndWake(t *testing.T) {
	w := start(t, Config{TaskType: "T2V"})
	for i, want := range []string{"released GPU memory (moved active modules to CPU)", "already sleeping"} {
		r := call(t, w, "POST", "/release_memory_occupation", "").expect(t, 200)
		if len(r) != 3 || r["success"] != true || r["sleeping"] != true || r["message"] != want {
			t.Errorf("release %d = %v", i, r)
		}
	}
	const asleep = "Server is sleeping. Call resume_memory_occupation first."
	call(t, w, "POST", "/v1/images/generations", imageBody(1)).plain500(t)
	call(t, w, "POST", "/v1/diffusion/generate", `{"prompt":"p","size":"8x8"}`).plain500(t)
	if r := call(t, w, "POST", "/rollout/generate", `{"prompt":"p","seed":1}`).expect(t, 500); r["detail"] != asleep {
		t.Errorf("rollout while asleep = %v", r)
	}
	evs, _ := events(t, call(t, w, "POST", "/v1/images/generations/stream", imageBody(1)).body)
	if last := evs[len(evs)-1]; last["error"] != "Model generation returned no output. Error from scheduler: "+asleep {
		t.Errorf("stream while asleep ended with %v", last)
	}
	vid := call(t, w, "POST", "/v1/videos", `{"prompt":"p","size":"8x8","num_frames":1}`).expect(t, 200)["id"].(string)
	waitFor(t, "video failure", func() bool {
		return call(t, w, "GET", "/v1/videos/"+vid, "").expect(t, 200)["status"] == "failed"
	})
	update := call(t, w, "POST", "/update_weights_from_disk", `{"model_path":"/ckpt/2"}`).expect(t, 500)
	if update["success"] != false || update["message"] != "Cannot update weights while the server is sleeping. Call resume_memory_occupation first." {
		t.Errorf("update while asleep = %v", update)
	}
	call(t, w, "POST", "/update_weights_from_tensor", tensorBody(map[string][]byte{"w": {1}}, "")).expect(t, 200)
	if got := checksums(t, w)["transformer"]; got != trainerChecksum(map[string][]byte{"w": {1}}) {
		t.Errorf("checksum after a transfer while asleep: %v", got)
	}

	for i, want := range []string{"resumed GPU memory (restored modules to original devices)", "already awake"} {
		r := call(t, w, "POST", "/resume_memory_occupation", "").expect(t, 200)
		if r["success"] != true || r["sleeping"] != false || r["message"] != want {
			t.Errorf("resume %d = %v", i, r)
		}
	}
	call(t, w, "POST", "/v1/images/generations", imageBody(1)).expect(t, 200)
	if s := w.Stats(); s.Jobs != 1 {
		t.Errorf("%d jobs, want 1", s.Jobs)
	}
}

func TestLora(t *testing.T) {
	w := start(t, Config{})
	for _, c := range []struct{ body, want string }{ // in order: a loads before it is set again by name
		{`{"lora_nickname":"a","lora_path":"/loras/a"}`, "Successfully set LoRA adapter(s): a (target: all, strength: 1.00)"},
		{`{"lora_nickname":"a"}`, "Successfully set LoRA adapter(s): a (target: all, strength: 1.00)"},
		{`{"lora_nickname":["a","b"],"lora_path":["/loras/a","/loras/b"],"target":["transformer","transformer_2"],"strength":[0.5,1]}`,
			"Successfully set LoRA adapter(s): a, b (target: transformer, transformer_2, strength: 0.50, 1.00)"},
	} {
		if r := call(t, w, "POST", "/v1/set_lora", c.body).expect(t, 200); len(r) != 2 || r["status"] != "ok" || r["message"] != c.want {
			t.Errorf("%s: %v, want %q", c.body, r, c.want)
		}
	}
	if r := call(t, w, "POST", "/v1/set_lora", `{"lora_nickname":"c"}`).expect(t, 500); !strings.HasPrefix(r["detail"].(string), "Failed to set LoRA adapter: ") {
		t.Errorf("unknown adapter without a path = %v", r)
	}
	if fe := firstFieldError(t, call(t, w, "POST", "/v1/set_lora", `{"lora_path":"/x"}`).expect(t, 422)); fe["type"] != "missing" {
		t.Errorf("no nickname: %v", fe)
	}
	for path, body := range map[string]string{
		"Successfully merged LoRA weights (target: all, strength: 1.0)":         "",
		"Successfully merged LoRA weights (target: transformer, strength: 0.5)": `{"target":"transformer","strength":0.5}`,
		"Successfully unmerged LoRA weights (target: all)":                      "-",
		"Successfully unmerged LoRA weights (target: transformer_2)":            `-{"target":"transformer_2"}`,
	} {
		endpoint := "/v1/merge_lora_weights"
		if rest, ok := strings.CutPrefix(body, "-"); ok {
			endpoint, body = "/v1/unmerge_lora_weights", rest
		}
		if r := call(t, w, "POST", endpoint, body).expect(t, 200); r["message"] != path {
			t.Errorf("%s %s: %v", endpoint, body, r)
		}
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
	call(t, w, "POST", "/v1/images/generations", imageBody(1)).plain500(t)
	if r := call(t, w, "POST", "/rollout/generate", `{"prompt":"p","size":"8x8","seed":1}`).expect(t, 500); r["detail"] != "injected failure (--fail-rate)" {
		t.Errorf("rollout failure = %v", r)
	}
	if s := w.Stats(); s.Failed != 2 || s.Jobs != 0 {
		t.Errorf("stats %+v", s)
	}

	statuses := func() []int {
		w := start(t, Config{FailRate: 0.5, Seed: 42})
		var got []int
		for range 8 {
			got = append(got, call(t, w, "POST", "/v1/images/generations", imageBody(1)).status)
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
	call(t, w, "POST", "/v1/images/generations", imageBody(1)).expect(t, 200)
	if r, err := send(context.Background(), "POST", w.URL()+"/v1/images/generations", "application/json", []byte(imageBody(1))); err == nil {
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
	call(t, w, "POST", "/v1/images/generations", imageBody(1)).expect(t, 200)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	hung := make(chan error, 1)
	go func() {
		_, err := send(ctx, "POST", w.URL()+"/v1/images/generations", "application/json", []byte(imageBody(1)))
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
		_, err := send(context.Background(), "POST", w.URL()+"/v1/images/generations", "application/json", []byte(imageBody(1)))
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

// A held job keeps the worker, with jobs queued behind it, until the test
// releases it; then it and they end as any job does, the later ones after
// their service time. A job the worker refuses (asleep) leaves the hold
// to the next that runs.
func TestHoldEndsTheNextJobWhenReleased(t *testing.T) {
	w := start(t, Config{UnitMs: 50})
	release := w.Hold()
	call(t, w, "POST", "/release_memory_occupation", "{}").expect(t, 200)
	call(t, w, "POST", "/v1/images/generations", imageBody(1)).plain500(t) // asleep: refused
	call(t, w, "POST", "/resume_memory_occupation", "{}").expect(t, 200)

	answers := make(chan time.Duration, 2)
	send := func() {
		began := time.Now()
		call(t, w, "POST", "/v1/images/generations", imageBody(1)).expect(t, 200)
		answers <- time.Since(began)
	}
	go send()
	waitQueue(t, w, 0) // the held job runs
	go send()
	waitQueue(t, w, 1)
	select {
	case <-answers:
		t.Fatal("a job was answered while the worker was held")
	case <-time.After(100 * time.Millisecond):
	}
	release()
	release()
	for range 2 {
		<-answers
	}
	began := time.Now()
	call(t, w, "POST", "/v1/images/generations", imageBody(1)).expect(t, 200)
	if took := time.Since(began); took < 50*time.Millisecond {
		t.Fatalf("a job after the held one took %v; want its service time, 50 ms", took)
	}
	if s := w.Stats(); s.Jobs != 3 {
		t.Errorf("%d jobs, want 3", s.Jobs)
	}
}

func TestFaultsChangedAtRunTime(t *testing.T) {
	w := start(t, Config{Name: "w"})
	w.SetFailRate(1)
	call(t, w, "POST", "/v1/images/generations", imageBody(1)).plain500(t)
	w.SetFailRate(0)
	call(t, w, "POST", "/v1/images/generations", imageBody(1)).expect(t, 200)

	w.Hang()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if r, err := send(ctx, "POST", w.URL()+"/v1/images/generations", "application/json", []byte(imageBody(1))); err == nil {
		t.Errorf("job on a hung worker answered %d", r.status)
	}
	call(t, w, "GET", "/health", "").expect(t, 200) // the GPU hangs, not the server

	w.Crash()
	if r, err := send(context.Background(), "GET", w.URL()+"/health", "", nil); err == nil {
		t.Errorf("crashed worker still answers: %d", r.status)
	}
	if s := w.Stats(); s.Jobs != 1 || s.Failed != 1 {
		t.Errorf("stats %+v, want 1 job and 1 failure", s)
	}
}

func TestStartOnTheAddressOfAClosedWorker(t *testing.T) {
	old := start(t, Config{Name: "w", HangAfter: 1})
	call(t, old, "POST", "/v1/images/generations", imageBody(1)).expect(t, 200)
	old.Crash()

	cfg := old.Config()
	cfg.Addr = strings.TrimPrefix(old.URL(), "http://")
	restarted := start(t, cfg)
	// The old process's connections are dead, whether or not the client
	// has noticed yet.
	http.DefaultClient.CloseIdleConnections()
	if restarted.URL() != old.URL() {
		t.Fatalf("restarted on %s, want %s", restarted.URL(), old.URL())
	}
	// A fresh process: its job count starts again, so HangAfter is not yet
	// reached.
	r := call(t, restarted, "POST", "/v1/images/generations", imageBody(1))
	r.expect(t, 200)
	if got := r.header.Get("X-Fake-Worker"); got != "w" {
		t.Errorf("X-Fake-Worker %q, want w", got)
	}
	if s := restarted.Stats(); s.Jobs != 1 {
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
	if out, _ := base64.StdEncoding.DecodeString(body["output_b64"].(string)); len(out) != 32 || body["output_format"] != "png" ||
		!strings.HasSuffix(body["file_path"].(string), body["id"].(string)+".png") {
		t.Errorf("output: %d bytes, answer %v", len(out), body)
	}
	traj := body["trajectory"].(map[string]any)
	if h := npyHeader(t, traj["latents"].(string)); !strings.Contains(h, "'shape': (2, 3, 16, 1, 8, 8)") {
		t.Errorf("latents header %q", h)
	}
	if traj["log_probs"] != nil {
		t.Errorf("log_probs %v: sglang's pipeline is not asked for them", traj["log_probs"])
	}
	if ts := traj["timesteps"].([]any); len(ts) != 2 || !strings.Contains(npyHeader(t, ts[0].(string)), "'shape': ()") {
		t.Errorf("timesteps %v", ts)
	}
	for _, req := range []string{`{"prompt":"p","size":"64x64"}`, `{"prompt":"p","size":"64x64","get_log_probs":true}`} {
		if plain := call(t, w, "POST", "/v1/diffusion/generate", req).expect(t, 200); plain["trajectory"] != nil {
			t.Errorf("%s: unrequested trajectory %v", req, plain["trajectory"])
		}
	}
	call(t, w, "POST", "/v1/diffusion/generate", `{"size":"64x64"}`).expect(t, 422)
}

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
		ns[i] = int(v.(float64))
	}
	return ns
}

// TestRollout reads rollout answers in both forms: msgpack, as
// rollout_api.py answers now, and the older JSON list (RolloutJSON).
func TestRollout(t *testing.T) {
	for _, form := range []struct {
		json        bool
		contentType string
		ditKeys     int // the msgpack form added dit_trajectory.sigmas
	}{{false, "application/msgpack", 3}, {true, "application/json", 2}} {
		t.Run(form.contentType, func(t *testing.T) { testRollout(t, form.json, form.contentType, form.ditKeys) })
	}
}

func testRollout(t *testing.T, rolloutJSON bool, contentType string, ditKeys int) {
	w := start(t, Config{ImageBytes: 40, RolloutJSON: rolloutJSON})
	r := call(t, w, "POST", "/rollout/generate",
		`{"prompt":"p","width":64,"height":64,"num_inference_steps":3,"num_outputs_per_prompt":2,"seed":7,"rollout_return_dit_trajectory":true,"rollout_return_denoising_env":true}`)
	if r.status != 200 || r.header.Get("Content-Type") != contentType || r.header.Get("X-Weight-Version") != "" {
		t.Fatalf("rollout: %d %v", r.status, r.header)
	}
	samples := r.list(t)
	if len(samples) != 2 {
		t.Fatalf("%d samples, want 2", len(samples))
	}
	s := samples[0]
	keys := []string{"request_id", "prompt", "seed", "generated_output", "rollout_log_probs", "rollout_debug_tensors",
		"denoising_env", "dit_trajectory", "inference_time_s", "peak_memory_mb"}
	if len(s) != len(keys) {
		t.Errorf("sample keys %v, want %v", s, keys)
	}
	if s["seed"] != 7.0 || s["prompt"] != "p" || s["request_id"] != samples[1]["request_id"] || s["peak_memory_mb"] != nil {
		t.Errorf("sample = %v", s)
	}
	if h := safetensorsHeader(t, s["generated_output"]); h["dtype"] != "F32" {
		t.Errorf("generated_output header %v", h)
	}
	safetensorsHeader(t, s["rollout_log_probs"])
	if debug := s["rollout_debug_tensors"].(map[string]any); len(debug) != 4 {
		t.Errorf("debug tensors %v", debug)
	}
	if env := s["denoising_env"].(map[string]any); len(env) != 4 {
		t.Errorf("denoising_env %v", env)
	}
	dit := s["dit_trajectory"].(map[string]any)
	if shape := toInts(dit["latents"].(map[string]any)["shape"].([]any)); len(dit) != ditKeys || !slices.Equal(shape, []int{4, 16, 1, 8, 8}) {
		t.Errorf("dit_trajectory %v, latents shape %v", dit, shape)
	}
	safetensorsHeader(t, dit["timesteps"])
	if !rolloutJSON {
		safetensorsHeader(t, dit["sigmas"])
	}

	eval := call(t, w, "POST", "/rollout/generate", `{"prompt":"p","width":64,"height":64,"rollout":false,"seed":1}`).list(t)
	if s := eval[0]; len(s) != len(keys) || s["rollout_log_probs"] != nil || s["rollout_debug_tensors"] != nil || s["generated_output"] == nil {
		t.Errorf("evaluation sample: %v", s)
	}
	noDebug := call(t, w, "POST", "/rollout/generate", `{"prompt":"p","width":8,"height":8,"rollout_debug_mode":false,"seed":1}`).list(t)
	if s := noDebug[0]; s["rollout_debug_tensors"] != nil || s["rollout_log_probs"] == nil {
		t.Errorf("without debug mode: %v", s)
	}
	extra := call(t, w, "POST", "/rollout/generate", `{"prompt":"p","width":8,"height":8,"seed":1,"extra_sampling_params":{"num_outputs_per_prompt":3}}`).list(t)
	if len(extra) != 3 {
		t.Errorf("extra_sampling_params asked for 3 outputs, got %d", len(extra))
	}
	call(t, w, "POST", "/rollout/generate", `{"prompt":1}`).expect(t, 422)
	if r := call(t, w, "POST", "/rollout/generate", `{"prompt":"p","num_inference_steps":0,"seed":1}`).expect(t, 400); !strings.HasPrefix(r["detail"].(string), "Invalid sampling params: ") {
		t.Errorf("zero steps: %v", r)
	}
	jobs := w.Stats().Jobs
	call(t, w, "POST", "/rollout/generate", `{"prompt":"p","width":8,"height":8}`).plain500(t)
	if w.Stats().Jobs != jobs+1 {
		t.Error("a rollout without a seed fails only after its job, as sglang's does")
	}
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
	r, err := send(context.Background(), "POST", srv.URL+"/v1/images/generations", "application/json", []byte(imageBody(1)))
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

// FastAPI redirects a path it has no route for to its twin with or
// without a trailing slash, whatever the method, as an absolute URL on
// the Host it was sent; uvicorn names itself in Server.
func TestTrailingSlashRedirectsAsFastAPI(t *testing.T) {
	w := start(t, Config{})
	noFollow := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	host := strings.TrimPrefix(w.URL(), "http://")
	for _, c := range []struct{ method, path, location string }{
		{"POST", "/v1/set_lora/", "http://" + host + "/v1/set_lora"},
		{"GET", "/v1/set_lora/", "http://" + host + "/v1/set_lora"},
		{"GET", "/health/?x=1", "http://" + host + "/health?x=1"},
		{"DELETE", "/v1/videos/abc/", "http://" + host + "/v1/videos/abc"},
		{"GET", "/v1/videos//", "http://" + host + "/v1/videos"},
		{"GET", "/nothing/", ""},
		{"GET", "/v1/set_lora", ""},
	} {
		req, _ := http.NewRequest(c.method, w.URL()+c.path, nil)
		resp, err := noFollow.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if got := resp.Header.Get("Location"); got != c.location || (c.location != "") != (resp.StatusCode == http.StatusTemporaryRedirect) {
			t.Errorf("%s %s: %d, Location %q; want Location %q", c.method, c.path, resp.StatusCode, got, c.location)
		}
		if server := resp.Header.Get("Server"); server != "uvicorn" {
			t.Errorf("%s %s: Server %q; want uvicorn", c.method, c.path, server)
		}
	}
}
