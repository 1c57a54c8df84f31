package request

import (
	"net/http"
	"net/url"
	"testing"
)

// BenchmarkCostJSON reads and costs a typical image request body, as the
// router does for every generation: the strict key scan, then the cost.
func BenchmarkCostJSON(b *testing.B) {
	body := []byte(`{"model":"flux","prompt":"a photograph of a red fox in the snow, golden hour","size":"1024x1024","n":1,` +
		`"num_inference_steps":28,"guidance_scale":3.5,"seed":1234,"response_format":"b64_json","extra_body":{"true_cfg_scale":1}}`)
	route := Endpoints.Match(http.MethodPost, &url.URL{Path: "/v1/images/generations"})
	b.ReportAllocs()
	for b.Loop() {
		f, err := ReadFields(body, "application/json")
		if err != nil {
			b.Fatal(err)
		}
		if _, err := route.Cost(testCosts, f); err != nil {
			b.Fatal(err)
		}
	}
}
