package diffusionrouter_test

import (
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"

	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// spanSink is an OTLP/HTTP trace receiver in the test's own process:
// Caddy's tracing exports the spans it ends to it.
type spanSink struct {
	mu    sync.Mutex
	spans []*tracepb.Span
}

func (s *spanSink) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	var req collectortrace.ExportTraceServiceRequest
	if err := proto.Unmarshal(body, &req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	s.mu.Lock()
	for _, rs := range req.ResourceSpans {
		for _, ss := range rs.ScopeSpans {
			s.spans = append(s.spans, ss.Spans...)
		}
	}
	s.mu.Unlock()
	out, _ := proto.Marshal(&collectortrace.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(out)
}

// named returns the spans named name.
func (s *spanSink) named(name string) []*tracepb.Span {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*tracepb.Span
	for _, sp := range s.spans {
		if sp.Name == name {
			out = append(out, sp)
		}
	}
	return out
}

// attr is the value of a span's attribute key, as text.
func attr(sp *tracepb.Span, key string) string {
	for _, kv := range sp.Attributes {
		if kv.Key == key {
			v := kv.Value
			switch {
			case v.GetStringValue() != "":
				return v.GetStringValue()
			case v.GetIntValue() != 0:
				return fmt.Sprint(v.GetIntValue())
			}
			return fmt.Sprint(v.GetBoolValue())
		}
	}
	return ""
}

// tracedWorker is a fake worker that keeps the traceparent headers of its
// jobs, which saw returns.
func tracedWorker(t *testing.T, cfg fakeworker.Config) (srv *httptest.Server, w *fakeworker.Worker, saw func() []string) {
	w = fakeworker.New(cfg)
	var mu sync.Mutex
	var parents []string
	srv = httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/v1/images") {
			mu.Lock()
			parents = append(parents, r.Header.Get("Traceparent"))
			mu.Unlock()
		}
		w.Handler().ServeHTTP(rw, r)
	}))
	t.Cleanup(srv.Close)
	return srv, w, func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(parents)
	}
}

// The collector of every traced test: Caddy makes one tracer provider per
// process, with the exporter the environment names when the first
// tracing config loads.
var (
	collectorOnce sync.Once
	sink          = new(spanSink)
	collectorURL  string
)

// traceToSink makes a router started after it export its spans to sink.
func traceToSink(t *testing.T) {
	collectorOnce.Do(func() { collectorURL = httptest.NewServer(sink).URL })
	t.Setenv("OTEL_TRACES_EXPORTER", "otlp")
	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", collectorURL+"/v1/traces")
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
}

// events counts the span events named name.
func (s *spanSink) events(name string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, sp := range s.spans {
		for _, ev := range sp.Events {
			if ev.Name == name {
				n++
			}
		}
	}
	return n
}

func TestTracedJobHasSpansForItsWaitAndEachAttempt(t *testing.T) {
	traceToSink(t)
	reruns := sink.events("diffusion_router.rerun")
	attempts, queues := len(sink.named("diffusion_router.attempt")), len(sink.named("diffusion_router.queue"))

	failing, fw, failingSaw := tracedWorker(t, fakeworker.Config{Name: "failing"})
	fw.SetFailRate(1)
	good, _, goodSaw := tracedWorker(t, fakeworker.Config{Name: "good"})
	r := testrouter.Start(t, "tracing\ndiffusion_router {\n workers "+failing.URL+" "+good.URL+"\n policy round_robin\n}")

	// Round robin sends one of two jobs to the failing worker first.
	for range 2 {
		rp := r.Post("/v1/images/generations", `{"response_format":"b64_json","prompt":"x","size":"64x64","num_inference_steps":2}`)
		testrouter.ExpectStatus(t, "a job", rp, 200)
	}
	testrouter.WaitFor(t, func() bool {
		return len(sink.named("diffusion_router.attempt")) >= attempts+3 && len(sink.named("diffusion_router.queue")) >= queues+2
	})

	// The job that ran twice: its trace has a queue span and two attempts.
	var queue *tracepb.Span
	byWorker := map[string]*tracepb.Span{}
	for _, q := range sink.named("diffusion_router.queue") {
		if attr(q, "diffusion.worker") == failing.URL {
			queue = q
		}
	}
	if queue == nil || attr(queue, "diffusion.endpoint") != "images" {
		t.Fatalf("no queue span of the images job that got the failing worker first")
	}
	for _, sp := range sink.named("diffusion_router.attempt") {
		if equalIDs(sp.TraceId, queue.TraceId) {
			byWorker[attr(sp, "diffusion.worker")] = sp
			if !equalIDs(sp.ParentSpanId, queue.ParentSpanId) {
				t.Errorf("attempt span is not beside the queue span, under the request's")
			}
		}
	}
	first, second := byWorker[failing.URL], byWorker[good.URL]
	if len(byWorker) != 2 || first == nil || second == nil {
		t.Fatalf("the job's attempt spans are on %v; want one on each worker", byWorker)
	}
	if attr(first, "http.response.status_code") != "500" || attr(second, "http.response.status_code") != "200" {
		t.Errorf("attempts answered %s then %s; want 500 then 200", attr(first, "http.response.status_code"), attr(second, "http.response.status_code"))
	}
	// Each worker saw its own attempt's span as the parent of its work.
	for _, c := range []struct {
		saw  func() []string
		span *tracepb.Span
	}{{failingSaw, first}, {goodSaw, second}} {
		want := "00-" + hex.EncodeToString(c.span.TraceId) + "-" + hex.EncodeToString(c.span.SpanId) + "-01"
		if !slices.Contains(c.saw(), want) {
			t.Errorf("worker saw traceparents %v; want its attempt's, %s, among them", c.saw(), want)
		}
	}
	if n := sink.events("diffusion_router.rerun") - reruns; n != 1 {
		t.Errorf("%d re-run events; want 1", n)
	}
}

func TestTracedHedgeHasTheCopysAttempt(t *testing.T) {
	traceToSink(t)
	hedges := sink.events("diffusion_router.hedge")
	hung, hw, _ := tracedWorker(t, fakeworker.Config{Name: "hung"})
	hw.Hang() // accepts jobs, never answers them; /health still answers
	good, _, _ := tracedWorker(t, fakeworker.Config{Name: "good"})
	r := testrouter.Start(t, "tracing\ndiffusion_router {\n workers "+hung.URL+" "+good.URL+"\n policy round_robin\n health_timeout 1s\n}")
	for range 2 { // one of them starts on the hung worker
		rp := r.Post("/v1/images/generations", `{"response_format":"b64_json","prompt":"x","size":"64x64","num_inference_steps":2}`)
		testrouter.ExpectStatus(t, "a job", rp, 200)
	}
	testrouter.WaitFor(t, func() bool { return sink.events("diffusion_router.hedge") > hedges })
	var onHung, copies []*tracepb.Span
	for _, sp := range sink.named("diffusion_router.attempt") {
		switch {
		case attr(sp, "diffusion.worker") == hung.URL:
			onHung = append(onHung, sp)
		case attr(sp, "diffusion.worker") == good.URL && attr(sp, "diffusion.hedge") == "true":
			copies = append(copies, sp)
		}
	}
	if len(onHung) != 1 || len(copies) != 1 || !equalIDs(onHung[0].TraceId, copies[0].TraceId) {
		t.Fatalf("%d attempts on the hung worker, %d copies on the good one; want one each, in one trace", len(onHung), len(copies))
	}
	if attr(copies[0], "http.response.status_code") != "200" {
		t.Errorf("the copy answered %s; want 200", attr(copies[0], "http.response.status_code"))
	}
}

func equalIDs(a, b []byte) bool { return hex.EncodeToString(a) == hex.EncodeToString(b) }
