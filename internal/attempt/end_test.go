package attempt

import (
	"context"
	"errors"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// An answer's status is the evidence of its worker's health: a 5xx is its
// failure, a 4xx the request's fault, and nothing counts once the client
// left.
func TestEvidenceOfAnAnswer(t *testing.T) {
	live := context.Background()
	gone, cancel := context.WithCancel(live)
	cancel()
	for _, tc := range []struct {
		ctx    context.Context
		err    error
		status int
		want   scheduler.Evidence
	}{
		{live, nil, 200, scheduler.Succeeded},
		{live, nil, 400, scheduler.Refused},
		{live, nil, 422, scheduler.Refused},
		{live, nil, 500, scheduler.Failed},
		{live, nil, 502, scheduler.Failed},
		{live, errors.New("reset"), 0, scheduler.Failed},
		{gone, nil, 500, scheduler.Abandoned},
	} {
		if got := evidenceOfStatus(tc.ctx, tc.err, tc.status); got != tc.want {
			t.Errorf("evidenceOfStatus(%d, %v) = %v; want %v", tc.status, tc.err, got, tc.want)
		}
	}
}
