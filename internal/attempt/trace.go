package attempt

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/spans"
)

// traceAttempt starts the span of t's attempt on its worker, when tracer
// is set; copy says it is a hedge's copy of the job.
func traceAttempt(ctx context.Context, tracer trace.Tracer, t *scheduler.Ticket, copy bool) (context.Context, spans.End) {
	if tracer == nil {
		return ctx, spans.None
	}
	return spans.Start(ctx, tracer, "diffusion_router.attempt",
		attribute.String("diffusion.worker", t.ServedBy()), attribute.Int("diffusion.attempt", t.Attempts),
		attribute.Bool("diffusion.hedge", copy))
}
