// Package spans starts and ends the OpenTelemetry spans of a traced job
// (its wait in the queue, each attempt) at no cost to a job that is not
// traced.
package spans

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// Start starts the span name under ctx's; its end records err, if any,
// and one more attribute.
func Start(ctx context.Context, tracer trace.Tracer, name string, attrs ...attribute.KeyValue) (context.Context, End) {
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

// End ends a span, recording err, if any, and attr. Its attribute is
// passed by value, not as a variadic slice, so that a job that is not
// traced allocates none.
type End func(err error, attr attribute.KeyValue)

// None is the end of the span a job that is not traced does not have.
func None(error, attribute.KeyValue) {}

// Event adds the event name to the span of ctx, when tracer is set: the
// job is traced.
func Event(ctx context.Context, tracer trace.Tracer, name string, attrs ...attribute.KeyValue) {
	if tracer != nil {
		trace.SpanFromContext(ctx).AddEvent(name, trace.WithAttributes(attrs...))
	}
}
