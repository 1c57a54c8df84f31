package attempt

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// StartSpan starts the span name under ctx's; its end records err, if
// any, and one more attribute.
func StartSpan(ctx context.Context, tracer trace.Tracer, name string, attrs ...attribute.KeyValue) (context.Context, EndSpan) {
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

// EndSpan ends a span, recording err, if any, and attr. Its attribute
// is passed by value, not as a variadic slice, so that a job that is not
// traced allocates none.
type EndSpan func(err error, attr attribute.KeyValue)

// NoSpan is the end of the span a job that is not traced does not have.
func NoSpan(error, attribute.KeyValue) {}

// traceAttempt starts the span of t's attempt on its worker, when tracer
// is set; copy says it is a hedge's copy of the job.
func traceAttempt(ctx context.Context, tracer trace.Tracer, t *scheduler.Ticket, copy bool) (context.Context, EndSpan) {
	if tracer == nil {
		return ctx, NoSpan
	}
	return StartSpan(ctx, tracer, "diffusion_router.attempt",
		attribute.String("diffusion.worker", t.ServedBy()), attribute.Int("diffusion.attempt", t.Attempts),
		attribute.Bool("diffusion.hedge", copy))
}

// event adds the event name to the span of ctx's request, when traced.
func event(ctx context.Context, tracer trace.Tracer, name string, attrs ...attribute.KeyValue) {
	if tracer != nil {
		trace.SpanFromContext(ctx).AddEvent(name, trace.WithAttributes(attrs...))
	}
}
