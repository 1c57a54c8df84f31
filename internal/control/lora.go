package control

import (
	"context"
	"errors"
	"net/http"
	"reflect"
	"slices"
	"strings"

	"github.com/miles-rollout/miles-diffusion-router/internal/answer"
	"github.com/miles-rollout/miles-diffusion-router/internal/fleet"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/strictjson"
)

// LoRA adapters are how many diffusion RL setups sync weights after each
// step. Without adapters declared, the LoRA calls are fleet operations
// with the same barrier as update_weights_from_disk: drain, every worker,
// stale on failure, one operation at a time; the adapter becomes part of
// the weight version, "<base>+lora:<nickname>" while one is set. With
// adapters declared, the pool places them on workers, and set_lora
// publishes a new path for one of them (servePublish).

// loraTargets are the transformers a LoRA call may name.
var loraTargets = []string{"all", "transformer", "transformer_2", "critic"}

// serveLora is POST /v1/set_lora, /v1/merge_lora_weights and
// /v1/unmerge_lora_weights, sent to every worker.
func (a *API) serveLora(w http.ResponseWriter, r *http.Request) {
	if a.Pool.AdaptersOn() {
		a.servePublish(w, r)
		return
	}
	req, status, msg := a.readLoraRequest(r)
	if status != 0 {
		_ = answer.WriteError(w, status, msg)
		return
	}
	a.runUpdate(w, r, req, strings.TrimPrefix(r.URL.Path, "/v1/"))
}

// readLoraRequest checks a LoRA call's body as the workers read it and
// works out the weight version it leads to.
func (a *API) readLoraRequest(r *http.Request) (scheduler.Update, int, string) {
	req := scheduler.Update{Path: r.URL.Path, Mode: scheduler.ModeDrain}
	body, members, status, msg := readControlObject(r)
	if status != 0 {
		return req, status, msg
	}
	if target, ok := stringField(strictjson.Member(members, "target"), "all"); !ok || !slices.Contains(loraTargets, target) {
		return req, http.StatusBadRequest, "target must be one of " + strings.Join(loraTargets, ", ")
	}
	base, _, _ := strings.Cut(a.Pool.Version(), scheduler.LoraSuffix)
	req.Version = base
	switch r.URL.Path {
	case "/v1/set_lora":
		nicknames, ok := stringOrList(strictjson.Member(members, "lora_nickname"))
		if !ok || len(nicknames) == 0 {
			return req, http.StatusBadRequest, "lora_nickname is required: a string or a list of strings"
		}
		paths, ok := stringOrList(strictjson.Member(members, "lora_path"))
		if !ok {
			return req, http.StatusBadRequest, "lora_path must be a string or a list of strings"
		}
		for _, p := range paths {
			if status, msg := a.checkWeightsPath("lora_path", p); status != 0 {
				return req, status, msg
			}
		}
		req.Version = base + scheduler.LoraSuffix + strings.Join(nicknames, ",")
		if status, msg := checkWeightVersion("lora_nickname", req.Version); status != 0 {
			return req, status, msg
		}
	case "/v1/merge_lora_weights":
		req.Version = a.Pool.Version() // merging changes how, not what, is served
	}
	req.Body = body
	return req, 0, ""
}

// serveChecksum is /get_weights_checksum: every worker's checksum of its
// weights, and whether they all agree, which is how an RL user checks
// that every engine holds the same weights.
func (a *API) serveChecksum(w http.ResponseWriter, r *http.Request) {
	body, _, status, msg := readControlObject(r)
	if status != 0 {
		_ = answer.WriteError(w, status, msg)
		return
	}
	results, err := a.Fleet.Checksums(r.Context(), body, a.Weights)
	if err != nil {
		_ = answer.WriteError(w, http.StatusServiceUnavailable, err.Error())
		return
	}
	code, agree := http.StatusOK, true
	for _, res := range results {
		if !res.OK {
			code, agree = http.StatusBadGateway, false
		} else if !reflect.DeepEqual(res.Body, results[0].Body) {
			agree = false
		}
	}
	_ = answer.WriteJSON(w, code, map[string]any{"success": code == http.StatusOK, "consistent": agree, "results": results})
}

// stringOrList reads a field given as a string or a list of non-empty
// strings; absent or null is an empty list.
func stringOrList(v any) ([]string, bool) {
	switch v := v.(type) {
	case nil:
		return nil, true
	case string:
		return []string{v}, v != ""
	case []any:
		out := make([]string, len(v))
		for i, x := range v {
			s, ok := x.(string)
			if !ok || s == "" {
				return nil, false
			}
			out[i] = s
		}
		return out, true
	}
	return nil, false
}

// servePublish is POST /v1/set_lora while the pool places adapters: a new
// path for a declared adapter, which is how a trainer sends each step's
// LoRA. Only that adapter's holders drain and load it; no job of it runs
// on the old path once the call is made, and the call answers once every
// holder has loaded the new one (or failed to). Merging and unmerging
// are placement's, so those calls are refused.
func (a *API) servePublish(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/v1/set_lora" {
		_ = answer.WriteError(w, http.StatusBadRequest, "adapters are declared in this pool: the router merges and unmerges them as it places them; publish a new path with /v1/set_lora")
		return
	}
	name, path, strength, status, msg := a.readPublish(r)
	if status != 0 {
		_ = answer.WriteError(w, status, msg)
		return
	}
	var version string
	rep, ok := a.runOperation(w, r, "set_lora", name, func(ctx context.Context) ([]fleet.Result, error) {
		holders, v, err := a.Pool.Publish(name, path, strength)
		if err != nil {
			return nil, err
		}
		version = v
		switched := a.Pool.WaitSwitched(ctx.Done(), holders, name, a.Weights.DrainTimeout+a.Weights.Timeout)
		results := publishResults(holders, switched)
		a.count("set_lora", nil, results)
		return results, nil
	})
	if !ok {
		return
	}
	switch {
	case errors.Is(rep.Err, scheduler.ErrSamePath):
		_ = answer.WriteError(w, http.StatusBadRequest, rep.Err.Error())
	case rep.Err != nil:
		_ = answer.WriteError(w, http.StatusServiceUnavailable, rep.Err.Error())
	default:
		code := http.StatusOK
		if slices.ContainsFunc(rep.Results, failed) {
			code = http.StatusBadGateway
		}
		_ = answer.WriteJSON(w, code, a.durable(r.Context(), map[string]any{"success": code == http.StatusOK, "weight_version": version, "results": rep.Results}))
	}
}

// readPublish reads a publish: one declared nickname, a path that is not
// its current one, and an optional strength.
func (a *API) readPublish(r *http.Request) (name, path string, strength float64, status int, msg string) {
	_, members, status, msg := readControlObject(r)
	if status != 0 {
		return "", "", 0, status, msg
	}
	names, ok := stringOrList(strictjson.Member(members, "lora_nickname"))
	declared := a.Pool.AdapterNames()
	if !ok || len(names) != 1 || !slices.Contains(declared, names[0]) {
		return "", "", 0, http.StatusBadRequest, "lora_nickname must name one declared adapter: " + strings.Join(declared, ", ")
	}
	path, ok = strictjson.Member(members, "lora_path").(string)
	if !ok || path == "" {
		return "", "", 0, http.StatusBadRequest, "lora_path is required: the path of the adapter's new weights"
	}
	if status, msg := a.checkWeightsPath("lora_path", path); status != 0 {
		return "", "", 0, status, msg
	}
	if a.Pool.AdapterPath(names[0]) == path {
		return "", "", 0, http.StatusBadRequest, "adapter " + names[0] + " is loaded from " + path + " already: " + scheduler.ErrSamePath.Error()
	}
	if s := strictjson.Member(members, "strength"); s != nil {
		f, ok := s.(float64)
		if !ok || f < 0 {
			return "", "", 0, http.StatusBadRequest, "strength must be a positive number, as an adapter's in the config"
		}
		strength = f
	}
	return names[0], path, strength, 0, ""
}

// publishResults is each holder's result of a publish: how its switch
// went, or 504 while it still switches.
func publishResults(holders []string, switched map[string]scheduler.SwitchResult) []fleet.Result {
	results := make([]fleet.Result, len(holders))
	for i, u := range holders {
		res, done := switched[u]
		r := fleet.Result{WorkerURL: u, StatusCode: res.Status, OK: res.OK, Body: map[string]any{"success": res.OK, "message": res.Message}}
		if !done {
			r.StatusCode, r.Body = http.StatusGatewayTimeout, map[string]any{"success": false, "message": "still loading the new path: its jobs had not ended, or its switch had not answered, within drain_timeout + weights_timeout; it serves the adapter once it has"}
		}
		results[i] = r
	}
	return results
}
