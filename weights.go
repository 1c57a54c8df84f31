package diffusionrouter

import (
	"cmp"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/miles-rollout/miles-diffusion-router/internal/control"
	"github.com/miles-rollout/miles-diffusion-router/internal/fleet"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// The weights option group. Provisioned, it is the fleet.Config that the
// weight-update, sleep and wake endpoints (internal/control/weights.go)
// run under, and with them a returning worker's catch-up and the pool's
// record of its last update.

// Weights is how weight updates, sleep and wake run over the fleet.
type Weights struct {
	// Mode is how POST /update_weights_from_disk updates the fleet when
	// the body names no mode: drain (default: pause, let the jobs in
	// flight finish, update all, resume) or rolling (RollingBatch workers
	// at a time while the others serve).
	Mode string `json:"mode,omitempty"`

	// RollingBatch is how many workers a rolling update takes at once.
	// Default 1.
	RollingBatch int `json:"rolling_batch,omitempty"`

	// DrainTimeout bounds the wait for jobs in flight before an update or
	// sleep; beyond it 504 and nothing changes. Default 10m.
	DrainTimeout caddy.Duration `json:"drain_timeout,omitempty"`

	// Timeout bounds one worker's update, sleep or wake call. Default 10m.
	Timeout caddy.Duration `json:"timeout,omitempty"`

	// PathPrefixes, when set, restrict model_path to paths under one of
	// these prefixes (403 otherwise).
	PathPrefixes []string `json:"path_prefixes,omitempty"`

	// VersionPolicy bounds how stale the weights a generation job runs on
	// may be, when its request sends neither X-Weight-Version-Policy nor
	// X-Weight-Version: "latest" (a worker on the newest base weights the
	// fleet has had) or "max_staleness <k>" (on one of the last k+1, k
	// from 0 to 1000). Default: none, any serving worker.
	VersionPolicy string `json:"version_policy,omitempty"`
}

// Defaults of the weight update options.
const (
	defaultDrainTimeout   = 10 * time.Minute
	defaultWeightsTimeout = 10 * time.Minute
)

// provisionWeights reads the weight update options.
func (h *Handler) provisionWeights() error {
	o, c := &h.Weights, &h.weights
	o.Mode = cmp.Or(o.Mode, scheduler.ModeDrain)
	if o.Mode != scheduler.ModeDrain && o.Mode != scheduler.ModeRolling {
		return optionError("weights_mode", "weights.Mode", "unknown mode %q (want drain or rolling)", o.Mode)
	}
	o.RollingBatch = cmp.Or(o.RollingBatch, 1)
	o.DrainTimeout = cmp.Or(o.DrainTimeout, caddy.Duration(defaultDrainTimeout))
	o.Timeout = cmp.Or(o.Timeout, caddy.Duration(defaultWeightsTimeout))
	switch {
	case o.RollingBatch < 0:
		return optionError("rolling_batch", "weights.rolling_batch", "must be positive, got %d", o.RollingBatch)
	case o.DrainTimeout < 0:
		return optionError("drain_timeout", "weights.drain_timeout", "must be positive, got %s", time.Duration(o.DrainTimeout))
	case o.Timeout < 0:
		return optionError("weights_timeout", "weights.Timeout", "must be positive, got %s", time.Duration(o.Timeout))
	}
	for _, p := range o.PathPrefixes {
		if !strings.HasPrefix(p, "/") && !strings.Contains(p, "://") {
			return optionError("weights_path_prefix", "weights.path_prefixes", "%q is neither an absolute path nor a URL prefix", p)
		}
	}
	if o.VersionPolicy != "" {
		var err error
		if h.maxStale, err = parseVersionPolicy(o.VersionPolicy, optionStaleness); err != nil {
			return optionError("version_policy", "weights.version_policy", "%v", err)
		}
	}
	*c = fleet.Config{
		Mode: o.Mode, RollingBatch: o.RollingBatch, PathPrefixes: o.PathPrefixes,
		DrainTimeout: time.Duration(o.DrainTimeout), Timeout: time.Duration(o.Timeout),
	}
	return nil
}

// wireWeights gives the control API what its weight-update, sleep and
// wake endpoints run with: the config provisionWeights made, and the
// counter of their outcomes.
func (h *Handler) wireWeights(api *control.API) {
	api.Weights, api.Operations = &h.weights, weightUpdates
}
