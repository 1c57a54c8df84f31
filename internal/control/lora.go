package control

import (
	"net/http"
	"reflect"
	"slices"
	"strings"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/strictjson"
)

// LoRA adapters are how many diffusion RL setups sync weights after each
// step, so the LoRA calls are fleet operations with the same barrier as
// update_weights_from_disk: drain, every worker, stale on failure, one
// operation at a time. The adapter becomes part of the weight version:
// "<base>+lora:<nickname>" while one is set.

// loraTargets are the transformers a LoRA call may name.
var loraTargets = []string{"all", "transformer", "transformer_2", "critic"}

// loraSuffix starts the LoRA part of a weight version.
const loraSuffix = "+lora:"

// serveLora is POST /v1/set_lora, /v1/merge_lora_weights and
// /v1/unmerge_lora_weights, sent to every worker.
func (a *API) serveLora(w http.ResponseWriter, r *http.Request) {
	req, status, msg := a.readLoraRequest(r)
	if status != 0 {
		_ = WriteError(w, status, msg)
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
	base, _, _ := strings.Cut(a.Pool.Version(), loraSuffix)
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
		req.Version = base + loraSuffix + strings.Join(nicknames, ",")
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
		_ = WriteError(w, status, msg)
		return
	}
	results, err := a.Fleet.Checksums(r.Context(), body, a.Weights)
	if err != nil {
		_ = WriteError(w, http.StatusServiceUnavailable, err.Error())
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
	_ = WriteJSON(w, code, map[string]any{"success": code == http.StatusOK, "consistent": agree, "results": results})
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
