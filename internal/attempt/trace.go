package attempt

import (
	"context"

	"go.opentelemetry.io/otel/attribute"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/spans"
)

// traceAttempt starts the span of t's attempt on its worker, whose
// client's end is rec, when rec's job is traced; copy says it is a
// hedge's copy of the job.
func traceAttempt(ctx context.Context, rec *Recorder, t *scheduler.Ticket, copy bool) (context.Context, spans.End) {
	if rec.Tracer == nil {
		return ctx, spans.None
	}
	return spans.Start(ctx, rec.Tracer, "diffusion_router.attempt",
		attribute.String("diffusion.worker", t.ServedBy()), attribute.Int("diffusion.attempt", rec.tries.attempts),
		attribute.Bool("diffusion.hedge", copy))
}
