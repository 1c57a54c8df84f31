package control

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/answer"
	"github.com/miles-rollout/miles-diffusion-router/internal/fleet"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/workerurl"
)

// A trainer that moves new weights into the engines itself, as
// miles_diffusion does over CUDA IPC through each engine's own node,
// pauses them through the router first, as miles' LLM side pauses SGLang
// engines: pause_generation answers once the paused workers' jobs have
// ended, the trainer transfers, and continue_generation lets them serve
// again. Meanwhile the jobs waiting go to the workers not paused, or wait.

// pauseModes are the values of SGLang's PauseGenerationReqInput.mode,
// which the router accepts and ignores: it never aborts or keeps a job
// in place on a worker, it waits for the jobs to end.
var pauseModes = []string{"abort", "retract", "in_place"}

// servePause is POST /pause_generation.
func (a *API) servePause(w http.ResponseWriter, r *http.Request) {
	_, urls, status, msg := a.readGenerationCall(r, "pause_generation", map[string]func(json.RawMessage) string{"mode": checkPauseMode})
	if status != 0 {
		_ = answer.WriteError(w, status, msg)
		return
	}
	rep, ok := a.runOperation(w, r, "pause_generation", "", func(ctx context.Context) ([]fleet.Result, error) {
		results, err := a.Fleet.PauseGeneration(ctx, urls, a.Weights)
		a.count("pause_generation", err, results)
		a.logGeneration("workers paused", results, err)
		return results, err
	})
	if !ok {
		return
	}
	if errors.Is(rep.Err, fleet.ErrDrainTimeout) {
		_ = answer.WriteError(w, http.StatusGatewayTimeout, fmt.Sprintf("jobs on the workers paused did not finish within drain_timeout (%s); the pause is undone and they serve again", a.Weights.DrainTimeout))
		return
	}
	a.answerGeneration(w, r, rep, "Generation paused.")
}

// serveContinue is POST /continue_generation: the workers named, or every
// paused one, serve again. With new_version it declares first what they
// hold, as update_weight_version does, and a worker whose checksums do
// not match serves no job, stale.
func (a *API) serveContinue(w http.ResponseWriter, r *http.Request) {
	d, declared, status, msg := a.readDeclaration(r, "continue_generation", map[string]func(json.RawMessage) string{
		"torch_empty_cache": checkBoolean("torch_empty_cache"),
	})
	if status != 0 {
		_ = answer.WriteError(w, status, msg)
		return
	}
	if declared {
		a.runDeclaration(w, r, "continue_generation", d, a.Fleet.ContinueWithVersion)
		return
	}
	urls := d.Workers
	rep, ok := a.runOperation(w, r, "continue_generation", "", func(context.Context) ([]fleet.Result, error) {
		results, err := a.Fleet.ContinueGeneration(urls)
		a.count("continue_generation", err, results)
		a.logGeneration("workers continued", results, err)
		return results, err
	})
	if !ok {
		return
	}
	if errors.Is(rep.Err, scheduler.ErrNothingToDo) { // calling twice is harmless
		_ = answer.WriteJSON(w, http.StatusOK, map[string]any{"success": true, "status": "ok", "message": "No worker is paused.", "results": []fleet.Result{}})
		return
	}
	a.answerGeneration(w, r, rep, "Generation continued.")
}

// logGeneration logs a pause or a continue: which workers it changed, or
// why it failed (a pause that ran out of time is undone, and says so).
func (a *API) logGeneration(msg string, results []fleet.Result, err error) {
	if err != nil {
		a.Logger.Warn(msg+" failed", zap.Error(err))
		return
	}
	urls := make([]string, len(results))
	for i, res := range results {
		urls[i] = res.WorkerURL
	}
	a.Logger.Info(msg, zap.Strings("workers", urls))
}

// answerGeneration answers a pause or a continue that ended as rep says,
// with SGLang's "status" and "message" beside each worker's result.
func (a *API) answerGeneration(w http.ResponseWriter, r *http.Request, rep fleet.Report, message string) {
	switch err := rep.Err; {
	case errors.Is(err, scheduler.ErrNoWorker):
		_ = answer.WriteError(w, http.StatusServiceUnavailable, "No workers registered in the pool that an operator has not held back")
	case errors.Is(err, scheduler.ErrUnknownWorker): // it left since the call was read
		_ = answer.WriteError(w, http.StatusNotFound, err.Error())
	case err != nil:
		_ = answer.WriteError(w, http.StatusServiceUnavailable, "the "+rep.Operation+" did not run to its end: "+err.Error())
	default:
		_ = answer.WriteJSON(w, http.StatusOK, a.durable(r.Context(), map[string]any{"success": true, "status": "ok", "message": message, "results": rep.Results}))
	}
}

// readGenerationCall reads the body of a pause, a continue or a
// declaration (op): an optional JSON object whose "workers" names workers
// of the pool, and whose other fields are those of checks, each checked
// by its function (a message refuses it). It returns the object's members
// and the workers named in the pool's spelling, nil when none are. A
// non-zero status refuses the call.
func (a *API) readGenerationCall(r *http.Request, op string, checks map[string]func(json.RawMessage) string) (map[string]json.RawMessage, []string, int, string) {
	members, err := decodeJSONBody(r)
	if err != nil {
		return nil, nil, http.StatusBadRequest, err.Error()
	}
	for _, f := range slices.Sorted(maps.Keys(members)) {
		check, ok := checks[f]
		switch {
		case f == "workers":
		case !ok:
			return nil, nil, http.StatusBadRequest, fmt.Sprintf("unknown field %q: %s takes %s", f, op, strings.Join(append(slices.Sorted(maps.Keys(checks)), "workers"), ", "))
		default:
			if msg := check(members[f]); msg != "" {
				return nil, nil, http.StatusBadRequest, msg
			}
		}
	}
	urls, status, msg := a.namedWorkers(members["workers"])
	return members, urls, status, msg
}

// namedWorkers reads "workers": absent or null names none (nil); else a
// non-empty list of URLs of the pool's workers, returned in the pool's
// spelling, each once.
func (a *API) namedWorkers(raw json.RawMessage) ([]string, int, string) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, 0, ""
	}
	var named []string
	if json.Unmarshal(raw, &named) != nil || len(named) == 0 {
		return nil, http.StatusBadRequest, "workers must be a non-empty list of worker URLs"
	}
	out := make([]string, 0, len(named))
	for i, raw := range named {
		u, err := workerurl.Parse(raw)
		if err != nil {
			return nil, http.StatusBadRequest, fmt.Sprintf("workers[%d]: %v", i, err)
		}
		info, ok := a.Pool.Worker(u)
		if !ok {
			return nil, http.StatusNotFound, fmt.Sprintf("workers[%d]: %s is not a worker of the pool", i, u)
		}
		if !slices.Contains(out, info.URL) {
			out = append(out, info.URL)
		}
	}
	return out, 0, ""
}

// checkPauseMode checks SGLang's mode, which the router then ignores.
func checkPauseMode(raw json.RawMessage) string {
	var mode string
	if json.Unmarshal(raw, &mode) != nil || !slices.Contains(pauseModes, mode) {
		return "mode must be one of " + strings.Join(pauseModes, ", ") + " (SGLang's; the router accepts it and waits for the jobs to end whatever it says)"
	}
	return ""
}

// checkBoolean checks that a field named field is a boolean.
func checkBoolean(field string) func(json.RawMessage) string {
	return func(raw json.RawMessage) string {
		var b bool
		if string(raw) == "null" || json.Unmarshal(raw, &b) != nil {
			return field + " must be a boolean"
		}
		return ""
	}
}
