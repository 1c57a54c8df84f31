package request

import (
	"bytes"
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
)

var testCosts = Model{Steps: 20, Width: 1024, Height: 1024, Frames: 96, CFGFactor: 2, MaxPixels: DefaultMaxPixels}

// cost is what the endpoint at path charges for f.
func cost(path string, f Fields) (float64, error) {
	return Endpoints.Match(http.MethodPost, &url.URL{Path: path}).Cost(testCosts, f)
}

// costOf reads body as JSON and costs it at path.
func costOf(path, body string) (float64, error) {
	f, err := jsonFields([]byte(body))
	if err != nil {
		return 0, err
	}
	return cost(path, f)
}

func TestCostOfEveryFieldForm(t *testing.T) {
	for _, tc := range []struct {
		path, body string
		want       float64
	}{
		{"/v1/images/generations", `{"prompt":"x"}`, 20},
		{"/v1/images/generations", `{"size":"512x512","num_inference_steps":8}`, 2},
		{"/v1/images/generations", `{"size":"2048X2048","num_inference_steps":50,"n":2}`, 400},
		{"/v1/images/generations", `{"size":" 1_536 x 1536 ","num_inference_steps":"50"}`, 112.5},
		{"/v1/images/generations", `{"width":512,"height":2048,"num_inference_steps":10}`, 10},
		{"/v1/images/generations", `{"size":"512x512","width":1024}`, 10},
		{"/v1/images/generations", `{"num_inference_steps":10,"guidance_scale":7.5}`, 20},
		{"/v1/images/generations", `{"num_inference_steps":10,"true_cfg_scale":4,"guidance_scale":1}`, 20},
		{"/v1/images/generations", `{"num_inference_steps":10,"guidance_scale":1.0}`, 10},
		{"/v1/images/generations", `{"size":null,"n":null}`, 20},
		{"/v1/images/generations", `{"num_inference_steps":2.0,"n":true}`, 2}, // pydantic's lax int
		{"/v1/videos", `{"size":"1024x1024","num_inference_steps":10}`, 960},
		{"/v1/videos", `{"size":"1024x1024","num_inference_steps":10,"num_frames":33}`, 330},
		{"/v1/videos", `{"size":"1024x1024","num_inference_steps":10,"seconds":"2"}`, 480},
		{"/v1/videos", `{"size":"1024x1024","num_inference_steps":10,"fps":16,"seconds":5}`, 800},
		{"/v1/videos", `{"size":"1024x1024","extra_body":{"num_inference_steps":10,"num_frames":2}}`, 20},
		{"/v1/videos", `{"num_frames":1,"num_inference_steps":1,"n":3}`, 3},
		{"/v1/videos", `{"num_frames":1,"num_inference_steps":1,"n":3,"num_outputs_per_prompt":2}`, 2},
		{"/v1/diffusion/generate", `{"width":1024,"height":1024,"num_inference_steps":10,"num_outputs_per_prompt":4}`, 40},
		{"/rollout/generate", `{"width":512,"height":512,"num_inference_steps":8,"num_frames":5,"seed":7}`, 10},
	} {
		if got, err := costOf(tc.path, tc.body); err != nil || got != tc.want {
			t.Errorf("cost(%s %s) = %v, %v; want %v", tc.path, tc.body, got, err, tc.want)
		}
	}
}

// The router costs the job the worker runs: the values it takes are the
// ones sglang-diffusion applies last, clamped and defaulted as it does.
func TestCostIsWhatTheWorkerRuns(t *testing.T) {
	for _, tc := range []struct {
		path, body string
		want       float64
		why        string
	}{
		{"/rollout/generate", `{"seed":1,"num_inference_steps":1,"extra_sampling_params":{"num_inference_steps":150}}`, 150,
			"rollout_api.py: sampling_kwargs.update(request.extra_sampling_params)"},
		{"/rollout/generate", `{"seed":1,"width":512,"height":512,"num_outputs_per_prompt":1,"extra_sampling_params":{"num_outputs_per_prompt":4,"width":1024}}`, 40,
			"every rollout field can be overridden"},
		{"/rollout/generate", `{"seed":1,"num_inference_steps":10,"extra_sampling_params":{"num_inference_steps":null}}`, 20,
			"a null there is dropped after the update: the model's default"},
		{"/rollout/generate", `{"seed":1,"size":"512x512","num_inference_steps":4}`, 4,
			"RolloutRequest has no size"},
		{"/rollout/generate", `{"seed":1,"num_inference_steps":4,"width":1024,"extra_sampling_params":{"size":"512x512"}}`, 2,
			"build_sampling_params fills from size only the dimension not given"},
		{"/rollout/generate", `{"seed":1,"num_inference_steps":4,"extra_sampling_params":{"size":512}}`, 4,
			"_parse_size passes over a size that is not a string"},
		{"/rollout/generate", `{"seed":1,"num_inference_steps":4,"n":10}`, 4, "RolloutRequest has no n"},
		{"/v1/images/generations", `{"num_inference_steps":1,"n":1000}`, 10, "image_api.py: max(1, min(int(request.n or 1), 10))"},
		{"/v1/images/generations", `{"num_inference_steps":1,"n":0}`, 1, "n or 1"},
		{"/v1/images/generations", `{"num_inference_steps":1,"n":-5}`, 1, "max(1, ...)"},
		{"/v1/images/generations", `{"num_inference_steps":4,"extra_body":{"num_inference_steps":40}}`, 4,
			"ImageGenerationsRequest reads no extra_body"},
		{"/v1/images/generations", `{"num_inference_steps":4,"num_frames":9}`, 4, "generations passes num_frames=1"},
		{"/v1/images/generations", `{"num_inference_steps":2,"size":"abc"}`, 2, "_parse_size ignores what does not parse"},
		{"/v1/images/generations", `{"num_inference_steps":2,"size":"1536*1536"}`, 2, "_parse_size splits at x only"},
		{"/v1/images/generations", `{"num_inference_steps":2,"size":"512x512x2"}`, 2, "_parse_size wants two parts"},
		{"/v1/images/generations", `{"num_inference_steps":2,"size":""}`, 2, "if size: an empty one is none"},
		{"/v1/videos", `{"num_frames":1,"num_inference_steps":1,"extra_body":{"num_inference_steps":30}}`, 30,
			"video_api.py: payload.update(extra_body)"},
		{"/v1/videos", `{"num_frames":1,"extra_body":{"num_inference_steps":30},"extra_json":{"num_inference_steps":40}}`, 40,
			"then payload.update(extra_json)"},
		{"/v1/videos", `{"num_frames":1,"num_inference_steps":7,"extra_body":{"num_inference_steps":null}}`, 20, "None is the default"},
		{"/v1/videos", `{"num_frames":1,"extra_body":"{\"num_inference_steps\":5}"}`, 5, "a string is json.loads'd"},
		{"/v1/videos", `{"num_frames":1,"num_inference_steps":5,"extra_body":"[5]"}`, 5, "and not a dict: passed over"},
		{"/v1/videos", `{"num_frames":1,"num_inference_steps":5,"extra_body":[1]}`, 5, "isinstance(extra, dict) is false"},
		{"/v1/videos", `{"num_frames":1,"num_inference_steps":1,"n":50}`, 10, "max(1, min(int(num_outputs), 10))"},
		{"/v1/videos", `{"num_frames":1,"num_inference_steps":1,"num_outputs_per_prompt":0}`, 1, "clamped before SamplingParams"},
		{"/v1/diffusion/generate", `{"num_inference_steps":10,"n":4}`, 10, "DiffusionGenerateRequest has no n"},
	} {
		if got, err := costOf(tc.path, tc.body); err != nil || got != tc.want {
			t.Errorf("cost(%s %s) = %v, %v; want %v (%s)", tc.path, tc.body, got, err, tc.want, tc.why)
		}
	}
}

func TestCostOfMultipartFields(t *testing.T) {
	// The file's bytes are not fields.
	body, ctype := testkit.MultipartForm(bytes.Repeat([]byte("size=9999x9999 "), 1000), "prompt", "make it blue", "size", "512x512", "n", "3", "num_inference_steps", "8")
	f, err := formFields([]byte(body), ctype)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := cost("/v1/images/edits", f); err != nil || got != 6 {
		t.Fatalf("multipart cost = %v, %v; want 6", got, err)
	}
	if _, err := formFields([]byte(body), "multipart/form-data"); err == nil {
		t.Fatal("a multipart body without a boundary was read")
	}
}

// A form is read as create_video and edits read theirs: no width or
// height, n from the form alone, the rest from extra_body where the form
// lacks it.
func TestCostOfFormsIsTheWorkersReading(t *testing.T) {
	for _, tc := range []struct {
		path   string
		fields []string
		want   float64
	}{
		{"/v1/images/edits", []string{"width", "512", "height", "512", "num_inference_steps", "4"}, 4},
		{"/v1/images/edits", []string{"n", "30", "num_inference_steps", "1", "num_frames", "5"}, 10},
		{"/v1/videos", []string{"width", "512", "num_frames", "1", "num_inference_steps", "2"}, 2},
		{"/v1/videos", []string{"num_inference_steps", "2", "extra_body", `{"num_frames":3,"n":5,"num_inference_steps":9}`}, 6},
		{"/v1/videos", []string{"num_inference_steps", "1", "fps", "2", "seconds", "0"}, 8},
		{"/v1/videos", []string{"num_inference_steps", "1", "num_frames", "1", "extra_body", ""}, 1},
	} {
		body, ctype := testkit.MultipartForm([]byte("png"), append([]string{"prompt", "x"}, tc.fields...)...)
		f, err := formFields([]byte(body), ctype)
		if err != nil {
			t.Fatal(err)
		}
		if got, err := cost(tc.path, f); err != nil || got != tc.want {
			t.Errorf("%s form %v: cost %v, %v; want %v", tc.path, tc.fields, got, err, tc.want)
		}
	}
}

// The router refuses what sglang-diffusion would refuse, naming the field:
// values pydantic cannot read as the field's type, counts SamplingParams
// refuses below 1, negative guidance, extra_sampling_params values that
// are not what SamplingParams takes unconverted, sizes no GPU can make,
// and costs beyond any GPU. It no longer refuses what the worker clamps or
// ignores (n of 0, a size that does not parse): TestCostIsWhatTheWorkerRuns
// costs those.
func TestCostRefusesWhatWorkersRefuse(t *testing.T) {
	for _, tc := range []struct{ path, body, field string }{
		{"/v1/images/generations", `{"size":"0x512"}`, "size"},
		{"/v1/images/generations", `{"size":"-512x512"}`, "size"},
		{"/v1/images/generations", `{"size":512}`, "size"},
		{"/v1/images/generations", `{"width":0}`, "width"},
		{"/v1/images/generations", `{"height":-5}`, "height"},
		{"/v1/images/generations", `{"width":"wide"}`, "width"},
		{"/v1/images/generations", `{"num_inference_steps":0}`, "num_inference_steps"},
		{"/v1/images/generations", `{"num_inference_steps":-1}`, "num_inference_steps"},
		{"/v1/images/generations", `{"num_inference_steps":"many"}`, "num_inference_steps"},
		{"/v1/images/generations", `{"num_inference_steps":2.5}`, "num_inference_steps"},
		{"/v1/images/generations", `{"num_inference_steps":[20]}`, "num_inference_steps"},
		{"/v1/images/generations", `{"num_inference_steps":1e400}`, "num_inference_steps"},
		{"/v1/images/generations", `{"num_inference_steps":"NaN"}`, "num_inference_steps"},
		{"/v1/images/generations", `{"num_inference_steps":9999999999}`, "size, num_inference_steps"},
		{"/v1/images/generations", `{"n":2.5}`, "n"},
		{"/v1/images/generations", `{"n":"some"}`, "n"},
		{"/v1/images/generations", `{"guidance_scale":"strong"}`, "guidance_scale"},
		{"/v1/images/generations", `{"true_cfg_scale":-1}`, "true_cfg_scale"},
		{"/v1/diffusion/generate", `{"num_outputs_per_prompt":0}`, "num_outputs_per_prompt"},
		{"/v1/diffusion/generate", `{"num_frames":0}`, "num_frames"},
		{"/rollout/generate", `{"seed":1,"num_outputs_per_prompt":-2}`, "num_outputs_per_prompt"},
		{"/rollout/generate", `{"seed":1,"fps":0}`, "fps"},
		{"/rollout/generate", `{"seed":1,"extra_sampling_params":[1]}`, "extra_sampling_params"},
		{"/rollout/generate", `{"seed":1,"extra_sampling_params":{"num_inference_steps":"150"}}`, "extra_sampling_params.num_inference_steps"},
		{"/rollout/generate", `{"seed":1,"extra_sampling_params":{"num_inference_steps":150.0}}`, "extra_sampling_params.num_inference_steps"},
		{"/rollout/generate", `{"seed":1,"extra_sampling_params":{"num_frames":[2]}}`, "extra_sampling_params.num_frames"},
		{"/rollout/generate", `{"seed":1,"extra_sampling_params":{"guidance_scale":true}}`, "extra_sampling_params.guidance_scale"},
		{"/rollout/generate", `{"seed":1,"extra_sampling_params":{"num_inference_steps":0}}`, "num_inference_steps"},
		{"/v1/videos", `{"seconds":"0"}`, "seconds"},
		{"/v1/videos", `{"seconds":2.5}`, "seconds"},
		{"/v1/videos", `{"fps":-24}`, "fps"},
		{"/v1/videos", `{"fps":"x"}`, "fps"},
		{"/v1/videos", `{"num_frames":0}`, "num_frames"},
		{"/v1/videos", `{"extra_body":{"num_frames":0}}`, "num_frames"},
		{"/v1/videos", `{"extra_body":"{\"num_frames\":"}`, "extra_body"},
		{"/v1/videos", `{"extra_body":""}`, "extra_body"}, // json.loads("") fails; a form's empty one is none
	} {
		_, err := costOf(tc.path, tc.body)
		if err == nil || !strings.HasPrefix(err.Error(), tc.field) {
			t.Errorf("%s %s: error %v; want one naming %s", tc.path, tc.body, err, tc.field)
		}
	}
	for _, body := range []string{`{"prompt":`, `[1,2]`, `"x"`, `null`, `{} {}`} {
		if _, err := jsonFields([]byte(body)); err == nil {
			t.Errorf("%s was read as a JSON object", body)
		}
	}
	form, ctype := testkit.MultipartForm([]byte("png"), "prompt", "x", "num_frames", "0")
	f, _ := formFields([]byte(form), ctype)
	if _, err := cost("/v1/images/edits", f); err == nil || !strings.HasPrefix(err.Error(), "num_frames") {
		t.Errorf("an edit of 0 frames: %v", err)
	}
}

// TestMaxPixelsBoundsTheSize: sglang-diffusion takes any positive size,
// and a 99999x99999 image held a worker for minutes. A size beyond
// max_pixels is refused, naming the fields it was read from, however it
// was given; 4096x4096 is within the default.
func TestMaxPixelsBoundsTheSize(t *testing.T) {
	for _, tc := range []struct{ path, body, field string }{
		{"/v1/images/generations", `{"size":"99999x99999"}`, "size"},
		{"/v1/images/generations", `{"size":"4097x4096"}`, "size"},
		{"/v1/images/generations", `{"width":5000,"height":5000}`, "width and height"},
		{"/v1/images/generations", `{"size":"4096x4096","height":4100}`, "size and height"},
		{"/v1/videos", `{"extra_body":{"size":"8192x8192"}}`, "size"},
		{"/rollout/generate", `{"seed":1,"width":65536,"height":512}`, "width and height"},
		{"/rollout/generate", `{"seed":1,"extra_sampling_params":{"width":20000,"height":20000}}`, "width and height"},
	} {
		_, err := costOf(tc.path, tc.body)
		if err == nil || !strings.HasPrefix(err.Error(), tc.field+":") || !strings.Contains(err.Error(), "max_pixels") {
			t.Errorf("%s %s: error %v; want one naming %s and max_pixels", tc.path, tc.body, err, tc.field)
		}
	}
	if _, err := costOf("/v1/images/generations", `{"size":"4096x4096"}`); err != nil {
		t.Errorf("4096x4096 is within the default max_pixels: %v", err)
	}
	small := testCosts
	small.MaxPixels = 512 * 512
	if _, err := Endpoints.Match(http.MethodPost, &url.URL{Path: "/v1/images/generations"}).Cost(small, Fields{"size": "1024x1024"}); err == nil {
		t.Error("1024x1024 passed a max_pixels of 512x512")
	}
}

func TestCostReadsExactKeys(t *testing.T) {
	// Python ignores a key it does not know, whatever its likeness to one
	// it knows; so does the cost model.
	f, err := jsonFields([]byte(`{"Num_Inference_Steps":1,"SIZE":"1x1","extra_body":{"N":9},"Extra_Sampling_Params":{}}`))
	if extra, _ := f["extra_body"].(Fields); err != nil || len(f) != 1 || extra == nil || len(extra) != 0 {
		t.Fatalf("fields %v, %v; want only an empty extra_body", f, err)
	}
	if f, err := jsonFields([]byte(`{"extra_body":null,"size":"8x8"}`)); err != nil || len(f) != 1 {
		t.Errorf("extra_body null: %v, %v", f, err)
	}
}

func TestCostRefusesAmbiguousFormParts(t *testing.T) {
	part := func(header, value string) string {
		return "--b\r\nContent-Disposition: " + header + "\r\n\r\n" + value + "\r\n"
	}
	for name, body := range map[string]string{
		"steps twice":      part(`form-data; name="num_inference_steps"`, "1") + part(`form-data; name="num_inference_steps"`, "50"),
		"extra_body twice": part(`form-data; name="extra_body"`, "{}") + part(`form-data; name="extra_body"`, `{"num_frames":99}`),
		"escaped name":     part(`form-data; name="num\_inference_steps"`, "1"),
		"RFC 2231 name":    part(`form-data; name*=utf-8''num_inference_steps`, "1"),
		"unquoted name":    part(`form-data; name=num_inference_steps`, "1"),
		"no name":          part(`form-data`, "1"),
		"unparsable":       part(`form-data; name="a"; name="num_inference_steps"`, "1"),
		"RFC 2231 file":    part(`form-data; name="num_inference_steps"; filename*=utf-8''x.png`, "50"),
		"two dispositions": "--b\r\nContent-Disposition: form-data; name=\"a\"\r\nContent-Disposition: form-data; name=\"num_inference_steps\"\r\n\r\n50\r\n",
	} {
		if _, err := formFields([]byte(body+"--b--\r\n"), "multipart/form-data; boundary=b"); err == nil {
			t.Errorf("%s: form read", name)
		}
	}
	ok := part(`form-data; name="image"; filename="in.png"`, "png") + part(`form-data; name="num_inference_steps"`, "4") +
		part(`form-data; name="image"; filename="second.png"`, "png") + part(`form-data; name="tag"`, "a") + part(`form-data; name="tag"`, "b") +
		part(`form-data; name="n"; filename=x.png`, "9") // a file to every parser, quoted or not
	f, err := formFields([]byte(ok+"--b--\r\n"), "multipart/form-data; boundary=b")
	if _, n := f["n"]; err != nil || f["num_inference_steps"] != "4" || n {
		t.Fatalf("plain form: %v, %v", f, err)
	}
}

func TestCostRefusesFramesBeyondCounting(t *testing.T) {
	if c, err := costOf("/v1/videos", `{"fps":1e10,"seconds":1e10}`); err == nil {
		t.Fatalf("1e20 frames cost %v", c)
	}
}

// A form's extra_body is JSON text, read whole however long: cut short it
// would not parse.
func TestFormExtraBodyIsReadWhole(t *testing.T) {
	extra := `{"note":"` + strings.Repeat("x", 2*maxFieldBytes) + `","num_frames":3}`
	body, ctype := testkit.MultipartForm([]byte("png"), "prompt", "x", "num_inference_steps", "1", "extra_body", extra)
	f, err := formFields([]byte(body), ctype)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := cost("/v1/videos", f); err != nil || got != 3 {
		t.Fatalf("cost %v, %v; want 3 frames of one step", got, err)
	}
}

// A size is read as sglang's _parse_size reads it; what it cannot read is
// no size at all.
func TestWorkerSize(t *testing.T) {
	for s, want := range map[string][2]float64{
		"512x768": {512, 768}, "512X768": {512, 768}, " 512 x 768 ": {512, 768}, "1_024x+512": {1024, 512}, "-512x512": {-512, 512},
	} {
		if w, h, ok := workerSize(s); !ok || [2]float64{w, h} != want {
			t.Errorf("workerSize(%q) = %v, %v, %v; want %v", s, w, h, ok, want)
		}
	}
	for _, s := range []string{"", "abc", "512*512", "512x", "x512", "512x512x1", "5__12x1", "_512x1", "512_x1", "1e3x512", "+-5x5", "0x1p3"} {
		if w, h, ok := workerSize(s); ok {
			t.Errorf("workerSize(%q) = %v, %v; want no size", s, w, h)
		}
	}
	if w, _, ok := workerSize(strings.Repeat("9", 400) + "x1"); !ok || w <= 1e308 {
		t.Errorf("a 400-digit width read as %v, %v; want it infinite, for the cost bound to refuse", w, ok)
	}
}
