package diffusionrouter

import (
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// weights.version_policy, a string as the Caddyfile writes it, becomes
// the policy of the jobs that ask for none; unset, they have none.
func TestVersionPolicyOption(t *testing.T) {
	for option, k := range map[string]int{"": -1, "latest": 0, "max_staleness 0": 0, "max_staleness 3": 3, "max_staleness 1000": 1000} {
		h := Handler{Weights: Weights{VersionPolicy: option}}
		if err := h.provisionOptions(); err != nil {
			t.Fatalf("%q: %v", option, err)
		}
		want := scheduler.VersionPolicy{}
		if k >= 0 {
			want, _ = scheduler.Staleness(k)
		}
		if h.maxStale != want {
			t.Errorf("version_policy %q provisioned %+v; want %+v", option, h.maxStale, want)
		}
	}
}
