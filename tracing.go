package diffusionrouter

import (
	"context"
	"net/http"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
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

// startSpan starts the span name under ctx's; its end records err, if
// any, and one more attribute.
func startSpan(ctx context.Context, tracer trace.Tracer, name string, attrs ...attribute.KeyValue) (context.Context, endSpan) {
	ctx, span := tracer.Start(ctx, name, trace.WithAttributes(attrs...))
	return ctx, func(err error, attr attribute.KeyValue) {
		span.SetAttributes(attr)
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}
}

// endSpan ends a span, recording err, if any, and attr. Its attribute
// is passed by value, not as a variadic slice, so that a job that is not
// traced allocates none.
type endSpan func(err error, attr attribute.KeyValue)

// noSpan is the end of the span a job that is not traced does not have.
func noSpan(error, attribute.KeyValue) {}

// traceQueue starts the span of t's wait for a worker, when tracer is set.
func traceQueue(ctx context.Context, tracer trace.Tracer, t *scheduler.Ticket) (context.Context, endSpan) {
	if tracer == nil {
		return ctx, noSpan
	}
	return startSpan(ctx, tracer, "diffusion_router.queue",
		attribute.String("diffusion.endpoint", t.Route.Class), attribute.Float64("diffusion.cost", t.Cost),
		attribute.Int("diffusion.priority", t.Priority), attribute.String("diffusion.tenant", t.Tenant))
}

// traceAttempt starts the span of t's attempt on its worker, when tracer
// is set; copy says it is a hedge's copy of the job.
func traceAttempt(ctx context.Context, tracer trace.Tracer, t *scheduler.Ticket, copy bool) (context.Context, endSpan) {
	if tracer == nil {
		return ctx, noSpan
	}
	return startSpan(ctx, tracer, "diffusion_router.attempt",
		attribute.String("diffusion.worker", t.ServedBy()), attribute.Int("diffusion.attempt", t.Attempts),
		attribute.Bool("diffusion.hedge", copy))
}

// traceEvent adds the event name to the span of ctx's request, when traced.
func traceEvent(ctx context.Context, tracer trace.Tracer, name string, attrs ...attribute.KeyValue) {
	if tracer != nil {
		trace.SpanFromContext(ctx).AddEvent(name, trace.WithAttributes(attrs...))
	}
}

// injectTraceContext writes the span of r's attempt into r's headers, for
// its worker. r is reverse_proxy's own copy of the request.
func injectTraceContext(r *http.Request) {
	if trace.SpanContextFromContext(r.Context()).IsValid() {
		traceContext.Inject(r.Context(), propagation.HeaderCarrier(r.Header))
	}
}
