package fakeworker

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"
	"unicode/utf8"
)

// Engine operations keep the worker busy for this many cost units.
const (
	weightUpdateUnits = 5
	memoryToggleUnits = 1
)

// serverVersion is what /server_info reports as the sglang version.
const serverVersion = "fake"

// The paths follow sglang's runtime/entrypoints: http_server.py (health,
// /models, /server_info, /model_info), openai/common_api.py (/v1/...),
// openai/image_api.py, openai/video_api.py, diffusion_api.py and
// post_training/{rollout_api,weights_api}.py.
func (w *Worker) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", w.handleHealth)
	mux.HandleFunc("GET /health_generate", w.handleHealth)
	mux.HandleFunc("GET /models", w.handleLegacyModels)
	mux.HandleFunc("GET /server_info", w.handleServerInfo)
	mux.HandleFunc("GET /model_info", w.handleModelInfo)
	mux.HandleFunc("GET /v1/model_info", w.handleV1ModelInfo)
	mux.HandleFunc("GET /v1/models", w.handleModels)
	mux.HandleFunc("GET /v1/models/{model...}", w.handleModel)

	mux.HandleFunc("POST /v1/images/generations", w.breakable(w.handleImageGenerations))
	mux.HandleFunc("POST /v1/images/generations/stream", w.handleImageStream)
	mux.HandleFunc("POST /v1/images/edits", w.breakable(w.handleImageEdits))
	mux.HandleFunc("GET /v1/images/{id}/content", w.breakable(w.handleImageContent))
	mux.HandleFunc("DELETE /v1/images/{id}", w.handleDeleteImage)
	mux.HandleFunc("POST /v1/videos", w.breakable(w.handleCreateVideo))
	mux.HandleFunc("GET /v1/videos", w.handleListVideos)
	mux.HandleFunc("GET /v1/videos/{id}", w.handleGetVideo)
	mux.HandleFunc("DELETE /v1/videos/{id}", w.handleDeleteVideo)
	mux.HandleFunc("GET /v1/videos/{id}/content", w.breakable(w.handleVideoContent))
	mux.HandleFunc("POST /v1/diffusion/generate", w.breakable(w.handleDiffusionGenerate))
	mux.HandleFunc("POST /rollout/generate", w.breakable(w.handleRollout))

	mux.HandleFunc("POST /update_weights_from_disk", w.handleUpdateFromDisk)
	mux.HandleFunc("POST /update_weights_from_tensor", w.handleUpdateFromTensor)
	mux.HandleFunc("POST /get_weights_checksum", w.handleChecksum)
	mux.HandleFunc("POST /release_memory_occupation", w.handleMemory(true))
	mux.HandleFunc("POST /resume_memory_occupation", w.handleMemory(false))
	mux.HandleFunc("POST /v1/set_lora", w.handleSetLora)
	mux.HandleFunc("POST /v1/merge_lora_weights", w.handleMergeLora)
	mux.HandleFunc("POST /v1/unmerge_lora_weights", w.handleUnmergeLora)
	mux.HandleFunc("GET /v1/list_loras", w.handleListLoras)

	// The answers of the generation endpoints (wrapped in breakable) can
	// be broken on purpose; the event stream of
	// /v1/images/generations/stream cannot.
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if w.crashed.Load() {
			panic(http.ErrAbortHandler)
		}
		rw.Header().Set("X-Fake-Worker", w.cfg.Name)
		rw.Header().Set("Server", "uvicorn") // uvicorn's server_header, on by default
		if !redirectSlash(mux, rw, r) {
			mux.ServeHTTP(rw, r)
		}
	})
}

// redirectSlash answers, as FastAPI's router does (starlette's Router
// with redirect_slashes), a path no route takes whose twin with or
// without a trailing slash one does, whatever the method: 307 to the
// twin, as an absolute URL on the Host the request named (starlette's
// URL(scope=...)). It reports whether it answered.
func redirectSlash(mux *http.ServeMux, rw http.ResponseWriter, r *http.Request) bool {
	path := r.URL.Path
	if path == "/" || hasRoute(mux, r, path) {
		return false
	}
	twin := strings.TrimRight(path, "/")
	if twin == path {
		twin += "/"
	}
	if !hasRoute(mux, r, twin) {
		return false
	}
	location := "http://" + r.Host + twin
	if r.URL.RawQuery != "" {
		location += "?" + r.URL.RawQuery
	}
	rw.Header().Set("Location", location)
	rw.WriteHeader(http.StatusTemporaryRedirect)
	return true
}

// hasRoute reports whether a route of mux takes path, by any method.
func hasRoute(mux *http.ServeMux, r *http.Request, path string) bool {
	for _, method := range []string{http.MethodGet, http.MethodPost, http.MethodDelete} {
		if _, pattern := mux.Handler(&http.Request{Method: method, Host: r.Host, URL: &url.URL{Path: path}}); pattern != "" {
			return true
		}
	}
	return false
}

// handleHealth serves /health and /health_generate, which sglang answers
// {"status": "ok"} without asking the scheduler; --health-fail and
// --health-delay are faults of the fake.
func (w *Worker) handleHealth(rw http.ResponseWriter, r *http.Request) {
	if d := w.cfg.HealthDelay; d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
		case <-r.Context().Done():
			return
		}
	}
	if w.healthFail.Load() {
		writeJSON(rw, http.StatusServiceUnavailable, map[string]string{"status": "unhealthy"})
		return
	}
	writeJSON(rw, http.StatusOK, map[string]string{"status": "ok"})
}

// handleServerInfo is http_server.py's /server_info, the fields the model
// gateway discovers workers by.
func (w *Worker) handleServerInfo(rw http.ResponseWriter, _ *http.Request) {
	writeJSON(rw, http.StatusOK, map[string]any{
		"model_path":        w.cfg.ModelPath,
		"served_model_name": w.cfg.ModelPath,
		"tp_size":           1,
		"dp_size":           1,
		"version":           serverVersion,
	})
}

// handleModelInfo is http_server.py's /model_info.
func (w *Worker) handleModelInfo(rw http.ResponseWriter, _ *http.Request) {
	imageInput := strings.HasPrefix(w.cfg.TaskType, "I") || strings.HasPrefix(w.cfg.TaskType, "TI")
	writeJSON(rw, http.StatusOK, map[string]any{
		"model_path":              w.cfg.ModelPath,
		"is_generation":           true,
		"model_type":              "diffusion",
		"architectures":           []string{w.cfg.PipelineClass},
		"has_image_understanding": imageInput,
		"has_audio_understanding": false,
		"task_type":               w.cfg.TaskType,
		"is_image_gen":            !w.isVideoTask(),
	})
}

// handleV1ModelInfo is common_api.py's /v1/model_info.
func (w *Worker) handleV1ModelInfo(rw http.ResponseWriter, _ *http.Request) {
	writeJSON(rw, http.StatusOK, map[string]any{"model_path": w.cfg.ModelPath})
}

// handleLegacyModels is http_server.py's deprecated /models.
func (w *Worker) handleLegacyModels(rw http.ResponseWriter, _ *http.Request) {
	writeJSON(rw, http.StatusOK, map[string]any{
		"model_path":     w.cfg.ModelPath,
		"num_gpus":       1,
		"task_type":      w.cfg.TaskType,
		"dit_precision":  "bf16",
		"vae_precision":  "fp32",
		"pipeline_name":  w.cfg.PipelineName,
		"pipeline_class": w.cfg.PipelineClass,
	})
}

// modelCard is common_api.py's DiffusionModelCard.
func (w *Worker) modelCard() map[string]any {
	return map[string]any{
		"id":             w.cfg.ModelPath,
		"object":         "model",
		"created":        time.Now().Unix(),
		"owned_by":       "sglang",
		"root":           w.cfg.ModelPath,
		"parent":         nil,
		"max_model_len":  nil,
		"num_gpus":       1,
		"task_type":      w.cfg.TaskType,
		"dit_precision":  "bf16",
		"vae_precision":  "fp32",
		"pipeline_name":  w.cfg.PipelineName,
		"pipeline_class": w.cfg.PipelineClass,
	}
}

func (w *Worker) handleModels(rw http.ResponseWriter, _ *http.Request) {
	writeJSON(rw, http.StatusOK, map[string]any{"object": "list", "data": []any{w.modelCard()}})
}

// handleModel answers an unknown model with the OpenAI error shape, as
// sglang's retrieve_model does.
func (w *Worker) handleModel(rw http.ResponseWriter, r *http.Request) {
	if model := r.PathValue("model"); model != w.cfg.ModelPath {
		writeJSON(rw, http.StatusNotFound, map[string]any{"error": map[string]any{
			"message": fmt.Sprintf("The model '%s' does not exist", model),
			"type":    "invalid_request_error",
			"param":   "model",
			"code":    "model_not_found",
		}})
		return
	}
	writeJSON(rw, http.StatusOK, w.modelCard())
}

// writeResult answers the weight endpoints: {"success", "message"}, 200
// on success and 400 on failure, as weights_api.py does.
func writeResult(rw http.ResponseWriter, status int, message string) {
	writeJSON(rw, status, map[string]any{"success": status == http.StatusOK, "message": message})
}

// failControl answers a weight or memory operation that raised: 500 with
// the exception's text.
func (w *Worker) failControl(rw http.ResponseWriter, err error) {
	if w.crashed.Load() {
		panic(http.ErrAbortHandler)
	}
	writeResult(rw, http.StatusInternalServerError, err.Error())
}

// errUpdateAsleep is what the scheduler raises for an update from disk
// while the memory occupation is released.
const errUpdateAsleep = "Cannot update weights while the server is sleeping. Call resume_memory_occupation first."

// targetModules resolves a target_modules field as WeightsUpdater does:
// null or absent gives def; names the pipeline lacks are an error (a string
// is iterated, as Python would, character by character).
func targetModules(raw json.RawMessage, def []string) ([]string, string) {
	var v any
	if len(raw) > 0 {
		json.Unmarshal(raw, &v) // readObject parsed the whole body already
	}
	var names []string
	switch v := v.(type) {
	case nil:
		return def, ""
	case string:
		names = strings.Split(v, "")
	case []any:
		for _, n := range v {
			names = append(names, fmt.Sprint(n))
		}
	default:
		names = []string{fmt.Sprint(v)}
	}
	var unknown []string
	for _, n := range names {
		if !slices.Contains(modules, n) {
			unknown = append(unknown, n)
		}
	}
	if len(unknown) > 0 {
		return nil, fmt.Sprintf("Module(s) requested for update not found in pipeline: %s. Available Module(s): %s",
			pyList(unknown), pyList(modules))
	}
	if len(names) == 0 {
		return nil, fmt.Sprintf("No matching modules found for update. Requested: []. Available nn.Module(s): %s", pyList(modules))
	}
	return names, ""
}

// handleUpdateFromDisk is weights_api.py's update_weights_from_disk. The
// update waits for the jobs queued before it, so no job runs on a mix of
// weights. sglang ignores any weight_version in the body; so does the fake.
func (w *Worker) handleUpdateFromDisk(rw http.ResponseWriter, r *http.Request) {
	body, ok := readObject(rw, r)
	if !ok {
		return
	}
	if !truthy(body["model_path"]) {
		writeResult(rw, http.StatusBadRequest, "model_path is required")
		return
	}
	var modelPath string
	if json.Unmarshal(body["model_path"], &modelPath) != nil {
		modelPath = string(body["model_path"])
	}
	load := weightLoad{refuseAsleep: true}
	load.next = func(_ moduleWeights, module string) moduleWeights { return diskWeights(modelPath, module) }
	load.targets, load.refusal = targetModules(body["target_modules"], modules)
	if load.refusal == "" {
		load.failure = fmt.Sprintf("Failed to update module '%s': injected failure (--update-fail). All modules rolled back to original weights.", load.targets[0])
		load.success = fmt.Sprintf("Updated %d modules (%s).", len(load.targets), strings.Join(load.targets, ", "))
	}
	w.loadWeights(rw, r, load)
}

// weightLoad is an update of some modules' weights, from disk or from
// tensors, as the scheduler runs it: after the jobs queued before it.
type weightLoad struct {
	targets []string
	// refusal is why the worker refuses the update (400), if it does.
	refusal string
	// next is what a target module holds afterwards.
	next func(old moduleWeights, module string) moduleWeights
	// refuseAsleep refuses the update while the server sleeps, as
	// update_weights_from_disk is.
	refuseAsleep bool
	failure      string // the message of an injected failure (--update-fail)
	success      string // the message of a success
}

// loadWeights runs load and answers with its result.
func (w *Worker) loadWeights(rw http.ResponseWriter, r *http.Request, load weightLoad) {
	status, message := 0, ""
	err := w.runControl(r.Context(), func() time.Duration {
		switch {
		case load.refuseAsleep && w.asleep:
			status, message = http.StatusInternalServerError, errUpdateAsleep
			return 0
		case load.refusal != "":
			status, message = http.StatusBadRequest, load.refusal
			return 0
		case w.cfg.UpdateFail:
			status, message = http.StatusBadRequest, load.failure
		default:
			status, message = http.StatusOK, load.success
		}
		if w.updateHung {
			return forever
		}
		return w.serviceTime(weightUpdateUnits)
	}, func() {
		if status == http.StatusOK {
			for _, m := range load.targets {
				w.weights[m] = load.next(w.weights[m], m)
			}
		}
	})
	if err != nil {
		w.failControl(rw, err)
		return
	}
	writeResult(rw, status, message)
}

// handleUpdateFromTensor is weights_api.py's update_weights_from_tensor,
// as GPUWorker and WeightsUpdater run it on one GPU. Its payload must be
// base64, as MultiprocessingSerializer.deserialize decodes it; the fake
// cannot unpickle what a real trainer sends, CUDA IPC handles, so it loads
// a safetensors file as named tensors (TensorPayload) and any other bytes
// as an opaque whole (see moduleWeights.withTensors), whatever load_format
// says. Like sglang it keeps no weight_version, and it ignores
// weight_update_mode and the LoRA fields.
func (w *Worker) handleUpdateFromTensor(rw http.ResponseWriter, r *http.Request) {
	body, ok := readObject(rw, r)
	if !ok {
		return
	}
	if !truthy(body["serialized_named_tensors"]) {
		writeResult(rw, http.StatusBadRequest, "serialized_named_tensors is required")
		return
	}
	payload, refusal, ok := ownPayload(body["serialized_named_tensors"], body["payload_gpu_uuids"])
	if !ok {
		internalServerError(rw)
		return
	}
	load := weightLoad{refusal: refusal}
	load.next = func(old moduleWeights, _ string) moduleWeights { return old.withTensors(payload) }
	if refusal == "" {
		load.targets, load.refusal = targetModules(body["target_modules"], []string{"transformer"})
	}
	if load.refusal == "" && payload.named && len(load.targets) > 1 {
		// sglang takes a dict of payloads by module; a safetensors file is a list.
		load.refusal = fmt.Sprintf("Ambiguous tensor payload for multi-module update. Provide a dict mapping module_name -> module payload, requested modules: %s.", pyList(load.targets))
	}
	if load.refusal == "" {
		load.failure = fmt.Sprintf("Failed to update module '%s' from tensor: injected failure (--update-fail). "+
			"The pipeline may be partially updated. Please discard the whole weights and reload from a known-good checkpoint.", load.targets[0])
		load.success = fmt.Sprintf("Updated %d modules from tensor (%s).", len(load.targets), strings.Join(load.targets, ", "))
	}
	w.loadWeights(rw, r, load)
}

// ownPayload is GPUWorker's choice of the payload its GPU loads, for a
// world of one GPU, and its deserialization: the payload, or why it is
// refused. Without payload_gpu_uuids there must be one payload; with them,
// one label per payload, and the fake, which has no GPU, takes the first.
// ok is false where sglang fails with a TypeError (len of a number).
func ownPayload(raw, uuids json.RawMessage) (p tensorPayload, refusal string, ok bool) {
	var payloads []json.RawMessage
	if json.Unmarshal(raw, &payloads) != nil {
		return p, "serialized_named_tensors must be a list", true
	}
	labels, ok := pyLen(uuids)
	switch {
	case !ok:
		return p, "", false
	case labels < 0 && len(payloads) != 1:
		return p, fmt.Sprintf("serialized_named_tensors size must be 1 or world_size (1), got %d", len(payloads)), true
	case labels >= 0 && labels != len(payloads):
		return p, fmt.Sprintf("payload_gpu_uuids needs one entry per payload, got %d for %d payloads", labels, len(payloads)), true
	}
	p, reason := decodePayload(payloads[0])
	if reason != "" {
		return p, "Failed to deserialize serialized_named_tensors: " + reason, true
	}
	return p, "", true
}

// pyLen is Python's len of a JSON value: -1 for null or no value, and ok
// false where len raises (a number or a bool).
func pyLen(raw json.RawMessage) (n int, ok bool) {
	var v any
	json.Unmarshal(raw, &v) // readObject parsed the whole body already
	switch v := v.(type) {
	case nil:
		return -1, true
	case string:
		return utf8.RuneCountInString(v), true
	case []any:
		return len(v), true
	case map[string]any:
		return len(v), true
	}
	return 0, false
}

// handleChecksum is weights_api.py's get_weights_checksum: a SHA-256 per
// module (all by default, "not_found" for a name the pipeline lacks), in
// the order asked, of the weights each holds (see moduleWeights), so that
// tests tell weights apart as RL trainers do. A string of names is
// iterated, as Python would, character by character.
func (w *Worker) handleChecksum(rw http.ResponseWriter, r *http.Request) {
	body, ok := readObject(rw, r)
	if !ok {
		return
	}
	names, ok := moduleNames(body["module_names"])
	if !ok {
		internalServerError(rw)
		return
	}
	sums := make(map[string]string, len(names))
	err := w.runControl(r.Context(), func() time.Duration {
		w.stats.ChecksumCalls++
		for _, m := range names {
			sums[m] = "not_found"
			if weights, ok := w.weights[m]; ok {
				sums[m] = weights.sum
			}
		}
		return 0
	}, nil)
	if err != nil {
		w.fail(rw, err)
		return
	}
	writeOrdered(rw, names, sums)
}

// moduleNames reads the module_names of a checksum request: every module
// for null or no value, the characters of a string, or a list of strings.
// ok is false for anything else, which sglang fails on.
func moduleNames(raw json.RawMessage) (names []string, ok bool) {
	var v any
	json.Unmarshal(raw, &v) // readObject parsed the whole body already
	if s, isString := v.(string); isString {
		return strings.Split(s, ""), true
	}
	if json.Unmarshal(raw, &names) != nil && len(raw) > 0 {
		return nil, false
	}
	if names == nil {
		return modules, true
	}
	return names, true
}

// writeOrdered answers 200 with a JSON object of values in the order of
// keys, the first of each, as a Python dict keeps it.
func writeOrdered(rw http.ResponseWriter, keys []string, values map[string]string) {
	var b bytes.Buffer
	seen := make(map[string]bool, len(keys))
	for _, k := range keys {
		if seen[k] {
			continue
		}
		seen[k] = true
		key, _ := json.Marshal(k) // strings always marshal
		value, _ := json.Marshal(values[k])
		b.WriteByte(',')
		b.Write(key)
		b.WriteByte(':')
		b.Write(value)
	}
	rw.Header().Set("Content-Type", "application/json")
	rw.WriteHeader(http.StatusOK)
	fmt.Fprintf(rw, "{%s}", bytes.TrimPrefix(b.Bytes(), []byte(","))) // a write error means the client left
}

// handleMemory puts the worker to sleep or wakes it, after the jobs queued
// before, and answers as MemoryOccupationController does: {"success",
// "sleeping", "message"}. Both directions are idempotent.
func (w *Worker) handleMemory(sleep bool) http.HandlerFunc {
	return func(rw http.ResponseWriter, r *http.Request) {
		var message string
		err := w.runControl(r.Context(), func() time.Duration {
			if w.asleep == sleep {
				message = "already awake"
				if sleep {
					message = "already sleeping"
				}
				return 0
			}
			message = "resumed GPU memory (restored modules to original devices)"
			if sleep {
				message = "released GPU memory (moved active modules to CPU)"
			}
			return w.serviceTime(memoryToggleUnits)
		}, func() { w.asleep = sleep })
		if err != nil {
			w.failControl(rw, err)
			return
		}
		writeJSON(rw, http.StatusOK, map[string]any{"success": true, "sleeping": sleep, "message": message})
	}
}
