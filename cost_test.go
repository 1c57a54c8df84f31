package diffusionrouter

import (
	"bytes"
	"math"
	"strings"
	"testing"
	"time"
)

var testCosts = costModel{steps: 20, width: 1024, height: 1024, frames: 96, cfgFactor: 2}

func TestCostOfEveryFieldForm(t *testing.T) {
	for _, tc := range []struct {
		path, body string
		want       float64
	}{
		{"/v1/images/generations", `{"prompt":"x"}`, 20},
		{"/v1/images/generations", `{"size":"512x512","num_inference_steps":8}`, 2},
		{"/v1/images/generations", `{"size":"2048X2048","num_inference_steps":50,"n":2}`, 400},
		{"/v1/images/generations", `{"size":"1536*1536","num_inference_steps":"50"}`, 112.5},
		{"/v1/images/generations", `{"width":512,"height":2048,"num_inference_steps":10}`, 10},
		{"/v1/images/generations", `{"size":"512x512","width":1024}`, 10},
		{"/v1/images/generations", `{"num_inference_steps":10,"guidance_scale":7.5}`, 20},
		{"/v1/images/generations", `{"num_inference_steps":10,"true_cfg_scale":4,"guidance_scale":1}`, 20},
		{"/v1/images/generations", `{"num_inference_steps":10,"guidance_scale":1.0}`, 10},
		{"/v1/images/generations", `{"size":null,"n":null}`, 20},
		{"/v1/videos", `{"size":"1024x1024","num_inference_steps":10}`, 960},
		{"/v1/videos", `{"size":"1024x1024","num_inference_steps":10,"num_frames":33}`, 330},
		{"/v1/videos", `{"size":"1024x1024","num_inference_steps":10,"seconds":"2"}`, 480},
		{"/v1/videos", `{"size":"1024x1024","num_inference_steps":10,"fps":16,"seconds":5}`, 800},
		{"/v1/videos", `{"size":"1024x1024","extra_body":{"num_inference_steps":10,"num_frames":2}}`, 20},
		{"/v1/diffusion/generate", `{"width":1024,"height":1024,"num_inference_steps":10,"num_outputs_per_prompt":4}`, 40},
		{"/rollout/generate", `{"width":512,"height":512,"num_inference_steps":8,"num_frames":5,"seed":7}`, 10},
	} {
		f, err := jsonFields([]byte(tc.body))
		if err != nil {
			t.Fatalf("%s: %v", tc.body, err)
		}
		got, err := testCosts.cost(tc.path, f)
		if err != nil || got != tc.want {
			t.Errorf("cost(%s %s) = %v, %v; want %v", tc.path, tc.body, got, err, tc.want)
		}
	}
}

func TestCostOfMultipartFields(t *testing.T) {
	// The file's bytes are not fields.
	body, ctype := multipartForm(bytes.Repeat([]byte("size=9999x9999 "), 1000), "prompt", "make it blue", "size", "512x512", "n", "3", "num_inference_steps", "8")
	f, err := formFields([]byte(body), ctype)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := testCosts.cost("/v1/images/edits", f); err != nil || got != 6 {
		t.Fatalf("multipart cost = %v, %v; want 6", got, err)
	}
	if _, err := formFields([]byte(body), "multipart/form-data"); err == nil {
		t.Fatal("a multipart body without a boundary was read")
	}
}

func TestCostRefusesValuesThatCannotBeRight(t *testing.T) {
	for body, field := range map[string]string{
		`{"size":"abc"}`:                     "size",
		`{"size":"0x512"}`:                   "size",
		`{"size":"-512x512"}`:                "size",
		`{"size":512}`:                       "size",
		`{"width":0}`:                        "width",
		`{"height":-5}`:                      "height",
		`{"width":"wide"}`:                   "width",
		`{"num_inference_steps":0}`:          "num_inference_steps",
		`{"num_inference_steps":-1}`:         "num_inference_steps",
		`{"num_inference_steps":"many"}`:     "num_inference_steps",
		`{"num_inference_steps":2.5}`:        "num_inference_steps",
		`{"num_inference_steps":true}`:       "num_inference_steps",
		`{"num_inference_steps":[20]}`:       "num_inference_steps",
		`{"n":0}`:                            "n",
		`{"num_outputs_per_prompt":-2}`:      "num_outputs_per_prompt",
		`{"num_frames":0}`:                   "num_frames",
		`{"guidance_scale":"strong"}`:        "guidance_scale",
		`{"true_cfg_scale":-1}`:              "true_cfg_scale",
		`{"num_inference_steps":1e400}`:      "num_inference_steps",
		`{"num_inference_steps":"NaN"}`:      "num_inference_steps",
		`{"num_inference_steps":9999999999}`: "num_inference_steps",
	} {
		f, err := jsonFields([]byte(body))
		if err == nil {
			_, err = testCosts.cost("/v1/images/generations", f)
		}
		if err == nil || !strings.HasPrefix(err.Error(), field) {
			t.Errorf("%s: error %v; want one naming %s", body, err, field)
		}
	}
	for body, field := range map[string]string{
		`{"seconds":"0"}`: "seconds",
		`{"fps":-24}`:     "fps",
		`{"fps":"x"}`:     "fps",
	} {
		f, _ := jsonFields([]byte(body))
		if _, err := testCosts.cost("/v1/videos", f); err == nil || !strings.HasPrefix(err.Error(), field) {
			t.Errorf("video %s: error %v; want one naming %s", body, err, field)
		}
	}
	for _, body := range []string{`{"prompt":`, `[1,2]`, `"x"`, `null`, `{} {}`} {
		if _, err := jsonFields([]byte(body)); err == nil {
			t.Errorf("%s was read as a JSON object", body)
		}
	}
}

func TestSpeedLearningConvergesAndIgnoresAStall(t *testing.T) {
	var s speedEstimate
	// A worker that turns 4 units into a second, with ±10% noise.
	for i := range 20 {
		noise := 1 + 0.1*float64(i%3-1)
		s.observe(8, time.Duration(2*noise*float64(time.Second)), 0)
	}
	if s.value < 3.6 || s.value > 4.4 {
		t.Fatalf("learned speed %v; want about 4", s.value)
	}
	before := s.value
	s.observe(8, 200*time.Second, 2*time.Second) // one job stalled for 100x its time
	if s.value < before*0.9 {
		t.Fatalf("one stalled job moved the speed from %v to %v", before, s.value)
	}
	// The worker really slows down (another model, a throttled GPU): the
	// estimate follows within a window.
	for range speedWindow {
		s.observe(8, 8*time.Second, 0)
	}
	if s.value != 1 {
		t.Fatalf("speed after slowing down: %v; want 1", s.value)
	}
}

func TestPredictionErrorTracked(t *testing.T) {
	var s speedEstimate
	s.observe(10, 2*time.Second, time.Second) // predicted half the real time
	if s.relErr != 0.5 {
		t.Fatalf("relative error %v; want 0.5", s.relErr)
	}
	for range 50 {
		s.observe(10, 2*time.Second, 2*time.Second)
	}
	if s.relErr > 0.01 {
		t.Fatalf("relative error %v after exact predictions; want near 0", s.relErr)
	}
}

func TestNewWorkerStartsFromPoolMedianSpeed(t *testing.T) {
	p, clock := poolOf(t, 3)
	teach(t, p, clock, config(leastWork{}, 0), map[string]float64{"a": 1, "b": 3, "c": 5})
	registerRaw(p, "http://d:1")
	d, _ := p.worker("http://d:1")
	if d.SpeedLearned || math.Abs(d.Speed-3) > 1e-6 {
		t.Fatalf("new worker's speed %v (learned %v); want the median 3", d.Speed, d.SpeedLearned)
	}
}
