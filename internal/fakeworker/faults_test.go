package fakeworker

import (
	"context"
	"errors"
	"io"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/msgpack"
	"github.com/miles-rollout/miles-diffusion-router/internal/strictjson"
)

// TestRolloutMsgpackIsMsgspecs checks the msgpack answer as
// msgspec.msgpack.encode writes [r.model_dump() for r in responses]: one
// map per output with RolloutResponse's fields in order, null fields
// present, seed an integer, tensor data a str (base64, not bin), and a
// Content-Length.
func TestRolloutMsgpackIsMsgspecs(t *testing.T) {
	w := start(t, Config{ImageBytes: 400})
	r := call(t, w, "POST", "/rollout/generate", `{"prompt":"p","width":8,"height":8,"num_inference_steps":2,"seed":-3,"num_outputs_per_prompt":2}`)
	if r.status != 200 || r.header.Get("Content-Length") != strconv.Itoa(len(r.body)) {
		t.Fatalf("%d, Content-Length %q for %d bytes", r.status, r.header.Get("Content-Length"), len(r.body))
	}
	if err := msgpack.Whole(r.body); err != nil {
		t.Fatal(err)
	}
	v, err := msgpack.UnmarshalOrdered(r.body)
	if err != nil {
		t.Fatal(err)
	}
	list := v.([]any)
	if len(list) != 2 {
		t.Fatalf("%d samples", len(list))
	}
	s := list[0].(msgpack.Map)
	want := []string{"request_id", "prompt", "seed", "generated_output", "rollout_log_probs", "rollout_debug_tensors",
		"denoising_env", "dit_trajectory", "inference_time_s", "peak_memory_mb"}
	if !slices.Equal(s.Keys(), want) {
		t.Errorf("fields %v, want %v", s.Keys(), want)
	}
	if seed, _ := s.Get("seed"); seed != int64(-3) {
		t.Errorf("seed %#v, want the integer -3", seed)
	}
	if took, _ := s.Get("inference_time_s"); took == nil {
		t.Error("inference_time_s is null")
	}
	if peak, ok := s.Get("peak_memory_mb"); !ok || peak != nil {
		t.Errorf("peak_memory_mb %v, %v; want present and null", peak, ok)
	}
	out, _ := s.Get("generated_output")
	tensor := out.(msgpack.Map)
	if !slices.Equal(tensor.Keys(), []string{"__tensor__", "data", "shape", "dtype"}) {
		t.Errorf("tensor fields %v", tensor.Keys())
	}
	if data, _ := tensor.Get("data"); data != w.outputTensor() {
		t.Errorf("tensor data %T; want the base64 str of the safetensors file", data)
	}
}

// get sends a request and reads the answer, returning the error of
// whichever step failed.
func get(t *testing.T, client *http.Client, method, url, body string) (*http.Response, []byte, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(context.Background(), method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return nil, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp, b, err
}

const rolloutBody = `{"prompt":"p","width":8,"height":8,"num_inference_steps":2,"seed":1}`

// TestBrokenAnswers breaks every successful generation answer each way,
// on each form of answer, and checks what a client sees.
func TestBrokenAnswers(t *testing.T) {
	for _, c := range []struct {
		path, body string
		whole      func([]byte) error
		cfg        Config
	}{
		{"/rollout/generate", rolloutBody, msgpack.Whole, Config{}},
		{"/rollout/generate", rolloutBody, strictjson.Whole, Config{RolloutJSON: true}},
		{"/v1/images/generations", imageBody(1), strictjson.Whole, Config{}},
		{"/v1/diffusion/generate", `{"prompt":"p","size":"8x8","num_inference_steps":1}`, strictjson.Whole, Config{}},
		{"/v1/videos", `{"prompt":"p","size":"8x8","num_frames":1,"num_inference_steps":1}`, strictjson.Whole, Config{TaskType: "T2V"}},
	} {
		t.Run(c.path+"/"+strconv.FormatBool(c.cfg.RolloutJSON), func(t *testing.T) {
			cfg := c.cfg
			cfg.ImageBytes = 4096
			w := start(t, cfg)
			client := &http.Client{Transport: &http.Transport{}}
			t.Cleanup(client.CloseIdleConnections)
			resp, whole, err := get(t, client, "POST", w.URL()+c.path, c.body)
			if err != nil || resp.StatusCode != 200 || c.whole(whole) != nil {
				t.Fatalf("unbroken answer: %v %v %v", resp, err, c.whole(whole))
			}

			w.SetBreakRate(BreakTruncate, 1)
			resp, b, err := get(t, client, "POST", w.URL()+c.path, c.body)
			// Answers differ by a few bytes (inference_time_s); a cut one
			// is half as long.
			if err != nil || resp.StatusCode != 200 || resp.ContentLength != int64(len(b)) || len(b) > len(whole)*3/4 {
				t.Fatalf("truncated: %v, %d bytes of Content-Length %d, whole %d; err %v", resp, len(b), resp.ContentLength, len(whole), err)
			}
			if err := c.whole(b); err == nil || !strings.Contains(err.Error(), "ends inside") {
				t.Errorf("the truncated body passes the wholeness check: %v", err)
			}
			w.SetBreakRate(BreakTruncate, 0)

			w.SetBreakRate(BreakClose, 1)
			resp, b, err = get(t, client, "POST", w.URL()+c.path, c.body)
			if !errors.Is(err, io.ErrUnexpectedEOF) || resp.StatusCode != 200 || resp.ContentLength < int64(len(whole)-8) || len(b) != int(resp.ContentLength)/2 {
				t.Fatalf("closed: %v, %d bytes; err %v", resp, len(b), err)
			}
			w.SetBreakRate(BreakClose, 0)

			w.SetBreakRate(BreakReset, 1)
			_, _, err = get(t, client, "POST", w.URL()+c.path, c.body)
			if !errors.Is(err, syscall.ECONNRESET) {
				t.Fatalf("reset: %v; want the connection reset", err)
			}
			w.SetBreakRate(BreakReset, 0)

			// The connection a truncated answer came on was reused; the
			// worker still answers whole once the faults end.
			if resp, b, err := get(t, client, "POST", w.URL()+c.path, c.body); err != nil || resp.StatusCode != 200 || c.whole(b) != nil {
				t.Fatalf("after the faults: %v %v", resp, err)
			}
			if s := w.Stats(); s.Broken != 3 {
				t.Errorf("Broken = %d, want 3", s.Broken)
			}
		})
	}
}

// TestBrokenAnswersSpareErrors: only successes break; an error answer is
// sent whole, so a router reads the worker's own error.
func TestBrokenAnswersSpareErrors(t *testing.T) {
	w := start(t, Config{FailRate: 1, TruncateRate: 1, CloseRate: 1})
	if r := call(t, w, "POST", "/rollout/generate", rolloutBody).expect(t, 500); r["detail"] != "injected failure (--fail-rate)" {
		t.Errorf("rollout failure = %v", r)
	}
	call(t, w, "POST", "/rollout/generate", `{"prompt":1}`).expect(t, 422)
	if s := w.Stats(); s.Broken != 0 {
		t.Errorf("Broken = %d", s.Broken)
	}
}

// TestBreakRate breaks about that share of answers, drawn from Seed.
func TestBreakRate(t *testing.T) {
	w := start(t, Config{TruncateRate: 0.5, Seed: 3})
	broken := 0
	for range 40 {
		r := call(t, w, "POST", "/rollout/generate", rolloutBody)
		if msgpack.Whole(r.body) != nil {
			broken++
		}
	}
	if broken < 10 || broken > 30 || w.Stats().Broken != broken {
		t.Errorf("%d of 40 broken, Stats says %d; want about half", broken, w.Stats().Broken)
	}
}

// TestOOMByShape: a job whose width×height reaches OOMPixels fails after
// its first step as each endpoint reports a scheduler error, and smaller
// jobs run.
func TestOOMByShape(t *testing.T) {
	const big = `"width":1536,"height":1536`
	w := start(t, Config{OOMPixels: 1536 * 1536, UnitMs: 10})
	began := time.Now()
	r := call(t, w, "POST", "/rollout/generate", `{"prompt":"p",`+big+`,"num_inference_steps":50,"seed":1}`)
	took := time.Since(began)
	detail, _ := r.expect(t, 500)["detail"].(string)
	if r.header.Get("Content-Type") != "application/json" ||
		!regexp.MustCompile(`^Error executing request [0-9a-f-]{36}: CUDA out of memory\. Tried to allocate [0-9.]+ GiB\. GPU 0 has a total capacity`).MatchString(detail) {
		t.Errorf("rollout OOM: %q %q", r.header.Get("Content-Type"), detail)
	}
	// One step of a 1536² job at 10 ms a unit is 22.5 ms; all 50 would be 1.1 s.
	if one := w.serviceTime(Cost(1536, 1536, 1, 1, 1)); took < one || took > 25*one {
		t.Errorf("the OOM took %v; one step is %v", took, one)
	}
	call(t, w, "POST", "/v1/images/generations", `{"prompt":"p","size":"1536x1536","response_format":"b64_json"}`).plain500(t)
	call(t, w, "POST", "/v1/diffusion/generate", `{"prompt":"p","size":"2048x1536","num_inference_steps":1}`).plain500(t)
	if r := call(t, w, "POST", "/rollout/generate", `{"prompt":"p","width":1536,"height":1535,"num_inference_steps":1,"seed":1}`); r.status != 200 {
		t.Errorf("a job just under the threshold: %d %.200q", r.status, r.body)
	}
	if s := w.Stats(); s.Failed != 3 || s.Jobs != 1 {
		t.Errorf("stats %+v; want 3 failed, 1 done", s)
	}

	v := start(t, Config{TaskType: "T2V", OOMPixels: 1280 * 720})
	job := call(t, v, "POST", "/v1/videos", `{"prompt":"p","size":"1280x720","num_frames":1,"num_inference_steps":1}`).expect(t, 200)
	waitFor(t, "the video to fail", func() bool {
		j := call(t, v, "GET", "/v1/videos/"+job["id"].(string), "").object(t)
		e, _ := j["error"].(map[string]any)
		msg, _ := e["message"].(string)
		return j["status"] == "failed" && strings.HasPrefix(msg, "Model generation returned no output. Error from scheduler: Error executing request ") &&
			strings.Contains(msg, "CUDA out of memory")
	})
	v.SetOOMPixels(0)
	job = call(t, v, "POST", "/v1/videos", `{"prompt":"p","size":"1280x720","num_frames":1,"num_inference_steps":1}`).expect(t, 200)
	waitFor(t, "the video to complete", func() bool {
		return call(t, v, "GET", "/v1/videos/"+job["id"].(string), "").object(t)["status"] == "completed"
	})
}

// TestHungUpdate: once HangUpdates is called, a weight update holds the
// worker and never answers, the jobs behind it wait, /health still
// answers and the weights stay; only Close ends it.
func TestHungUpdate(t *testing.T) {
	w := start(t, Config{})
	call(t, w, "POST", "/update_weights_from_disk", `{"model_path":"/ckpt/1"}`).expect(t, 200)
	w.HangUpdates()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	update := make(chan error, 1)
	go func() {
		r, err := send(ctx, "POST", w.URL()+"/update_weights_from_disk", "application/json", []byte(`{"model_path":"/ckpt/2"}`))
		if err == nil {
			err = errors.New("answered " + strconv.Itoa(r.status))
		}
		update <- err
	}()
	waitQueue(t, w, 0) // the update has the worker
	queued := make(chan error, 1)
	go func() {
		_, err := send(context.Background(), "POST", w.URL()+"/v1/images/generations", "application/json", []byte(imageBody(1)))
		queued <- err
	}()
	waitQueue(t, w, 1)
	call(t, w, "GET", "/health", "").expect(t, 200)

	cancel()
	if err := <-update; !errors.Is(err, context.Canceled) {
		t.Errorf("hung update: %v", err)
	}
	waitQueue(t, w, 1) // the update keeps the worker after its caller gave up
	if got := w.Weights(); got != "/ckpt/1" {
		t.Errorf("weights %q during a hung update", got)
	}
	w.Close()
	select {
	case <-queued:
	case <-time.After(30 * time.Second):
		t.Fatal("Close did not end the job queued behind the hung update")
	}
	if got := w.Weights(); got != "/ckpt/1" {
		t.Errorf("a hung update left weights %q", got)
	}
}
