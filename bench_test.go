package diffusionrouter

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// BenchmarkServeHTTP measures the router's own work on a zero-cost job,
// with reverse_proxy replaced by a handler that writes a worker's answer:
// what the router adds to every job, without the network. The answer is
// held until whole and checked (held), or, with max_held_answer off,
// checked as it streams (streamed): the difference is what holding costs
// a small answer.
func BenchmarkServeHTTP(b *testing.B) {
	for _, bc := range []struct {
		name    string
		maxHeld int64
	}{{"held", 0}, {"streamed", -1}} {
		b.Run(bc.name, func(b *testing.B) { benchmarkServeHTTP(b, bc.maxHeld) })
	}
}

func benchmarkServeHTTP(b *testing.B, maxHeld int64) {
	urls := []string{"http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.0.3:30000", "http://10.0.0.4:30000"}
	// Its logger a Nop, as at the level WARN that cmd/bench/wrk runs at.
	h := provision(b, &Handler{Pool: "bench-serve", Workers: urls, Answers: Answers{MaxHeld: maxHeld}})
	answer := []byte(`{"id":"3f1c2f9e-6a0b-4c1e-9d3a-2b7e8f0a1c5d","created":1,"data":[{"b64_json":"iVBORw0KGgo="}]}`)
	worker := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(answer)))
		w.WriteHeader(http.StatusOK)
		_, err := w.Write(answer)
		return err
	})
	body := `{"prompt":"x","size":"1x1","num_inference_steps":1,"response_format":"b64_json"}`
	b.ReportAllocs()
	for b.Loop() {
		r := httptest.NewRequest(http.MethodPost, "/v1/images/generations", strings.NewReader(body))
		r.Header.Set("Content-Type", "application/json")
		repl := caddy.NewReplacer()
		rctx := context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl)
		rctx = context.WithValue(rctx, caddyhttp.VarsCtxKey, map[string]any{})
		w := httptest.NewRecorder()
		if err := h.ServeHTTP(w, r.WithContext(rctx), worker); err != nil || w.Code != http.StatusOK || w.Body.Len() != len(answer) {
			b.Fatal(w.Code, err, w.Body.String())
		}
	}
}
