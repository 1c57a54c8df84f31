package request

import (
	"bytes"
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
)

var testCosts = Model{Steps: 20, Width: 1024, Height: 1024, Frames: 96, CFGFactor: 2}

// cost is what the endpoint at path charges for f.
func cost(path string, f Fields) (float64, error) {
	return Endpoints.Match(http.MethodPost, &url.URL{Path: path}).Cost(testCosts, f)
}

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
		got, err := cost(tc.path, f)
		if err != nil || got != tc.want {
			t.Errorf("cost(%s %s) = %v, %v; want %v", tc.path, tc.body, got, err, tc.want)
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
			_, err = cost("/v1/images/generations", f)
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
		if _, err := cost("/v1/videos", f); err == nil || !strings.HasPrefix(err.Error(), field) {
			t.Errorf("video %s: error %v; want one naming %s", body, err, field)
		}
	}
	for _, body := range []string{`{"prompt":`, `[1,2]`, `"x"`, `null`, `{} {}`} {
		if _, err := jsonFields([]byte(body)); err == nil {
			t.Errorf("%s was read as a JSON object", body)
		}
	}
}

func TestCostReadsExactKeys(t *testing.T) {
	// Python ignores a key it does not know, whatever its likeness to one
	// it knows; so does the cost model.
	f, err := jsonFields([]byte(`{"Num_Inference_Steps":1,"SIZE":"1x1","extra_body":{"N":9}}`))
	if err != nil || len(f) != 0 {
		t.Fatalf("fields %v, %v; want none", f, err)
	}
	if _, err := jsonFields([]byte(`{"extra_body":[1]}`)); err == nil || !strings.HasPrefix(err.Error(), "extra_body") {
		t.Errorf("extra_body that is not an object: %v", err)
	}
	if _, err := jsonFields([]byte(`{"extra_body":null,"size":"8x8"}`)); err != nil {
		t.Errorf("extra_body null: %v", err)
	}
}

func TestCostRefusesAmbiguousFormParts(t *testing.T) {
	part := func(header, value string) string {
		return "--b\r\nContent-Disposition: " + header + "\r\n\r\n" + value + "\r\n"
	}
	for name, body := range map[string]string{
		"steps twice":      part(`form-data; name="num_inference_steps"`, "1") + part(`form-data; name="num_inference_steps"`, "50"),
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
	f, err := jsonFields([]byte(`{"fps":1e10,"seconds":1e10}`))
	if err != nil {
		t.Fatal(err)
	}
	if c, err := cost("/v1/videos", f); err == nil {
		t.Fatalf("1e20 frames cost %v", c)
	}
}
