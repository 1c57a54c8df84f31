package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// Switcher makes the calls by which a pool's placement changes one
// worker's LoRA adapter, and reads back the adapter a worker has active.
// Placement bounds each call by its context (adapter_switch_timeout).
type Switcher struct {
	fleet *Fleet
}

var _ scheduler.Switcher = (*Switcher)(nil)

// NewSwitcher returns the switcher of f's pool.
func NewSwitcher(f *Fleet) *Switcher {
	return &Switcher{fleet: f}
}

// loraStatus is sglang-diffusion's answer to GET /v1/list_loras (its
// pipeline's get_lora_status): the adapters loaded, and the one active on
// each transformer, absent on the base weights.
type loraStatus struct {
	Active map[string][]struct {
		Nickname string `json:"nickname"`
		Path     string `json:"path"`
	} `json:"active"`
}

// Active reads the adapter active on the worker's transformer.
func (s *Switcher) Active(ctx context.Context, workerURL string) (name, path string, err error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, workerURL+"/v1/list_loras", nil)
	if err != nil {
		return "", "", err
	}
	resp, err := s.fleet.client.Do(req)
	if err != nil {
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			return "", "", fmt.Errorf("/v1/list_loras did not answer within %s (or adapter_switch_timeout, when shorter)", scheduler.ReadTimeout)
		}
		return "", "", err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, maxAnswer))
	if err != nil {
		return "", "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", "", fmt.Errorf("/v1/list_loras answered %d: %.200s", resp.StatusCode, raw)
	}
	var status loraStatus
	if err := json.Unmarshal(raw, &status); err != nil {
		return "", "", fmt.Errorf("/v1/list_loras answered what is not its JSON: %w", err)
	}
	if active := status.Active["transformer"]; len(active) > 0 {
		return active[0].Nickname, active[0].Path, nil
	}
	return "", "", nil
}

// Switch makes a the worker's adapter, nil the base weights. With unmerge
// it first takes off what the worker has merged: the way back to the base
// weights, and the way to merge an adapter again over new base weights,
// which set_lora alone would take for merged already.
func (s *Switcher) Switch(ctx context.Context, workerURL string, a *scheduler.Adapter, unmerge bool) (int, string, error) {
	res := Result{StatusCode: http.StatusOK, OK: true}
	if unmerge {
		if res = s.fleet.post(ctx, workerURL, "/v1/unmerge_lora_weights", []byte("{}"), 0); !res.OK {
			return switchFailed(ctx, "/v1/unmerge_lora_weights", res)
		}
	}
	if a != nil {
		body, err := json.Marshal(setLora{Nickname: a.Name, Path: a.Path, Strength: a.Strength})
		if err != nil {
			return 0, "", err
		}
		if res = s.fleet.post(ctx, workerURL, "/v1/set_lora", body, 0); !res.OK {
			return switchFailed(ctx, "/v1/set_lora", res)
		}
	}
	return res.StatusCode, message(res), nil
}

// switchFailed is what Switch returns for its call of path that res
// failed, in ctx: the worker's status and message, and why the call
// failed. A call the worker gave no answer within the switch's context
// (adapter_switch_timeout) is a 504 that says so; one that could not be
// made, a 502 with the reason.
func switchFailed(ctx context.Context, path string, res Result) (int, string, error) {
	switch {
	case res.answered:
		return res.StatusCode, message(res), fmt.Errorf("%s answered %d: %s", path, res.StatusCode, message(res))
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		err := fmt.Errorf("%s did not answer within adapter_switch_timeout", path)
		return http.StatusGatewayTimeout, err.Error(), err
	}
	return res.StatusCode, message(res), fmt.Errorf("%s could not be called: %s", path, message(res))
}

// setLora is the body of a switch's /v1/set_lora.
type setLora struct {
	Nickname string  `json:"lora_nickname"`
	Path     string  `json:"lora_path"`
	Strength float64 `json:"strength,omitempty"`
}

// message is what a worker's answer says: its message, detail or error.
func message(r Result) string {
	if said, ok := r.Body.(map[string]any); ok {
		for _, k := range []string{"message", "detail", "error", "raw"} {
			if s, ok := said[k].(string); ok {
				return s
			}
		}
	}
	return http.StatusText(r.StatusCode)
}
