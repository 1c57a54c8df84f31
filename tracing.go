package diffusionrouter

import (
	"context"
	"net/http"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/spans"
)

// A site with Caddy's tracing directive traces each job under the span
// Caddy starts for its request: a span for its wait in the queue, one for
// each attempt on a worker (a hedge's copy among them), and events for
// each re-run and hedge. Each attempt's span goes to its worker as W3C
// trace context, so a worker that traces continues the job's trace. A site
// without tracing pays one context lookup per job.

const tracerName = "github.com/miles-rollout/miles-diffusion-router"

// traceContext writes an attempt's span into its request's headers.
var traceContext = propagation.TraceContext{}

// tracerOf returns the tracer of r's span, or nil when r is not traced.
func tracerOf(r *http.Request) trace.Tracer {
	span := trace.SpanFromContext(r.Context())
	if !span.SpanContext().IsValid() {
		return nil
	}
	return span.TracerProvider().Tracer(tracerName)
}

// traceQueue starts the span of t's wait for a worker, when tracer is set.
func traceQueue(ctx context.Context, tracer trace.Tracer, t *scheduler.Ticket) (context.Context, spans.End) {
	if tracer == nil {
		return ctx, spans.None
	}
	return spans.Start(ctx, tracer, "diffusion_router.queue",
		attribute.String("diffusion.endpoint", t.Route.Class), attribute.Float64("diffusion.cost", t.Cost),
		attribute.Int("diffusion.priority", t.Priority), attribute.String("diffusion.tenant", t.Tenant))
}

// injectTraceContext writes the span of r's attempt into r's headers, for
// its worker. r is reverse_proxy's own copy of the request.
func injectTraceContext(r *http.Request) {
	if trace.SpanContextFromContext(r.Context()).IsValid() {
		traceContext.Inject(r.Context(), propagation.HeaderCarrier(r.Header))
	}
}
