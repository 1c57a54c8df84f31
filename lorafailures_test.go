package diffusionrouter_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// brokenLoraWorker is a fake worker whose LoRA endpoint path answers as
// the handler set last does, while one is set; every other call, and
// path once the handler is set to nil, the fake answers. It counts the
// calls of path.
type brokenLoraWorker struct {
	*httptest.Server
	path   string
	answer atomic.Pointer[http.HandlerFunc]
	calls  atomic.Int64
}

func startBrokenLoraWorker(t *testing.T, path string, answer http.HandlerFunc) *brokenLoraWorker {
	t.Helper()
	fake := fakeworker.New(fakeworker.Config{Name: "a", UnitMs: 1})
	b := &brokenLoraWorker{path: path}
	b.set(answer)
	b.Server = httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.URL.Path == b.path {
			b.calls.Add(1)
			if h := b.answer.Load(); h != nil {
				(*h)(rw, r)
				return
			}
		}
		fake.Handler().ServeHTTP(rw, r)
	}))
	t.Cleanup(b.Close)
	return b
}

// set makes the worker's endpoint answer as h does; nil: as the fake does.
func (b *brokenLoraWorker) set(h http.HandlerFunc) {
	if h == nil {
		b.answer.Store(nil)
		return
	}
	b.answer.Store(&h)
}

// How a worker's LoRA endpoint breaks.
var (
	// hangs reads the call and never answers. It reads the body first,
	// as uvicorn does, so that net/http notices when the router gives up.
	hangs = func(_ http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		<-r.Context().Done()
	}
	// answersHTML is a 200 from a proxy or a crashed app in front of
	// the worker, not sglang's JSON.
	answersHTML = func(rw http.ResponseWriter, _ *http.Request) {
		rw.Header().Set("Content-Type", "text/html")
		_, _ = rw.Write([]byte("<html><body>502 Bad Gateway</body></html>"))
	}
	// fails500 is sglang-diffusion's answer to a set_lora whose adapter
	// does not load: the pipeline's exception as a 500.
	fails500 = func(rw http.ResponseWriter, _ *http.Request) {
		rw.Header().Set("Content-Type", "application/json")
		rw.WriteHeader(http.StatusInternalServerError)
		_, _ = rw.Write([]byte(`{"detail":"Failed to set LoRA adapter: Can't find 'adapter_config.json' at '/ckpt/lora/a'"}`))
	}
)

// brokenLoraSite is a router over w with policy a declared, whose LoRA
// calls are bounded and retried quickly.
func brokenLoraSite(w *brokenLoraWorker) string {
	return "diffusion_router {\n workers " + w.URL + `
 weights_path_prefix /ckpt
 adapter a /ckpt/lora/a
 adapter_switch_prior 20ms
 adapter_switch_timeout 300ms
 adapter_retry 50ms
}`
}

// expectHealth checks what /health and /readyz say: their status codes,
// and the count of workers out for failed LoRA calls.
func expectHealth(t *testing.T, r *testrouter.Router, code, out int) {
	t.Helper()
	health := r.Get("/health")
	testrouter.ExpectStatus(t, "/health", health, code)
	if n := health.JSON(t)["adapter_failed_workers"]; n != float64(out) {
		t.Fatalf("/health says %v workers out for failed LoRA calls; want %d: %s", n, out, health.Body)
	}
	testrouter.ExpectStatus(t, "/readyz", r.Get("/readyz"), code)
}

func TestAWorkerWhoseListLorasBreaksAnswersJobsWith503(t *testing.T) {
	for name, broken := range map[string]http.HandlerFunc{"hangs": hangs, "answers HTML": answersHTML} {
		t.Run(name, func(t *testing.T) {
			w := startBrokenLoraWorker(t, "/v1/list_loras", broken)
			r := testrouter.Start(t, brokenLoraSite(w))
			rp := r.Post("/v1/images/generations", policyImage(""))
			testrouter.ExpectStatus(t, "a base job on the only worker, whose adapter cannot be read", rp, 503)
			if msg := rp.ErrorText(t); !strings.HasPrefix(msg, "no worker can serve the base weights now: every worker that could failed 3 LoRA calls in a row ("+w.URL) {
				t.Fatalf("error %q", msg)
			}
			expectHealth(t, r, 503, 1)
			if wk := r.Workers()[w.URL]; wk["adapter_out"] != "unreadable" || wk["adapter_failures"].(float64) < 3 {
				t.Fatalf("/workers shows %v", wk)
			}

			w.set(nil)
			testrouter.WaitFor(t, func() bool { return r.Get("/readyz").Status == 200 })
			expectHealth(t, r, 200, 0)
			testrouter.ExpectStatus(t, "a base job once list_loras answers", r.Post("/v1/images/generations", policyImage("")), 200)
		})
	}
}

// How a set_lora that broke is told: by the worker's answer, or, when it
// never answered, by the timeout it overran.
var setLoraFailures = map[string]struct {
	broken http.HandlerFunc
	told   string
}{
	"answers 500":   {fails500, "/v1/set_lora answered 500: Failed to set LoRA adapter: Can't find 'adapter_config.json' at '/ckpt/lora/a'"},
	"never answers": {hangs, "/v1/set_lora did not answer within adapter_switch_timeout"},
}

func TestAWorkerWhoseSetLoraBreaksServesTheBaseAndAnswersItsAdapter503(t *testing.T) {
	for name, c := range setLoraFailures {
		t.Run(name, func(t *testing.T) {
			w := startBrokenLoraWorker(t, "/v1/set_lora", c.broken)
			r := testrouter.Start(t, brokenLoraSite(w))
			rp := r.Post("/v1/images/generations", policyImage("a"))
			testrouter.ExpectStatus(t, "a job of a, which the only worker fails to switch to", rp, 503)
			if msg := rp.ErrorText(t); !strings.HasPrefix(msg, `no worker can serve adapter "a" now: every worker that could failed 3 LoRA calls in a row (`+w.URL+": switch to a: "+c.told) {
				t.Fatalf("error %q; want it to say %q", msg, c.told)
			}
			if n := w.calls.Load(); n != 3 {
				t.Fatalf("%d set_lora calls; want 3, then the worker out", n)
			}
			rp = r.Post("/v1/images/generations", policyImage(""))
			testrouter.ExpectStatus(t, "a base job on the same worker", rp, 200)
			if got := rp.Header.Get(fakeworker.AdapterHeader); got != "" {
				t.Fatalf("the base job ran on adapter %q", got)
			}
			expectHealth(t, r, 200, 1)
			wk := r.Workers()[w.URL]
			if wk["adapter_out"] != "switches failing" || wk["adapter_state"] != "ready" || wk["adapter"] != "" || wk["failures"].(float64) < 3 {
				t.Fatalf("/workers shows %v", wk)
			}
			if a := r.Get("/workers").JSON(t)["adapters"].([]any)[1].(map[string]any); a["switch_failures"] != float64(3) {
				t.Fatalf("adapter a: %v; want 3 switch failures", a)
			}
		})
	}
}

// A publish whose holder's set_lora never answers says so in its result:
// 504, the timeout it overran, not a 502 the worker never sent.
func TestAPublishToAWorkerThatNeverAnswersSaysSo(t *testing.T) {
	w := startBrokenLoraWorker(t, "/v1/set_lora", nil)
	r := testrouter.Start(t, brokenLoraSite(w))
	testrouter.ExpectStatus(t, "a job of a", r.Post("/v1/images/generations", policyImage("a")), 200)
	w.set(hangs)
	rp := r.Post("/v1/set_lora", `{"lora_nickname":"a","lora_path":"/ckpt/lora/a-2"}`)
	testrouter.ExpectStatus(t, "a publish of a, whose holder's set_lora hangs", rp, http.StatusBadGateway)
	results := rp.JSON(t)["results"].([]any)
	res := results[0].(map[string]any)
	if msg := res["body"].(map[string]any)["message"]; len(results) != 1 || res["status_code"] != 504.0 || msg != setLoraFailures["never answers"].told {
		t.Fatalf("publish results %v; want the holder's 504: %s", results, setLoraFailures["never answers"].told)
	}
	testrouter.ExpectStatus(t, "a base job meanwhile", r.Post("/v1/images/generations", policyImage("")), 200)
}
