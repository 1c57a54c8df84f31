package fakeworker

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"time"
)

// Engine operations keep the worker busy for this many cost units.
const (
	weightUpdateUnits = 5
	memoryToggleUnits = 1
)

// serverVersion is what /server_info reports as the sglang version.
const serverVersion = "fake"

func (w *Worker) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", w.handleHealth)
	mux.HandleFunc("GET /health_generate", w.handleHealth)
	for _, path := range []string{"/model_info", "/v1/model_info", "/server_info"} {
		mux.HandleFunc("GET "+path, w.handleInfo)
	}
	mux.HandleFunc("GET /v1/models", w.handleModels)
	mux.HandleFunc("GET /v1/models/{model...}", w.handleModel)

	mux.HandleFunc("POST /v1/images/generations", w.handleImageGenerations)
	mux.HandleFunc("POST /v1/images/edits", w.handleImageEdits)
	mux.HandleFunc("POST /v1/videos", w.handleCreateVideo)
	mux.HandleFunc("GET /v1/videos", w.handleListVideos)
	mux.HandleFunc("GET /v1/videos/{id}", w.handleGetVideo)
	mux.HandleFunc("DELETE /v1/videos/{id}", w.handleDeleteVideo)
	mux.HandleFunc("GET /v1/videos/{id}/content", w.handleVideoContent)
	mux.HandleFunc("POST /v1/diffusion/generate", w.handleDiffusionGenerate)
	mux.HandleFunc("POST /rollout/generate", w.handleRollout)

	mux.HandleFunc("POST /update_weights_from_disk", w.handleUpdateFromDisk)
	mux.HandleFunc("POST /update_weights_from_tensor", w.handleUpdateFromTensor)
	mux.HandleFunc("POST /get_weights_checksum", w.handleChecksum)
	mux.HandleFunc("POST /release_memory_occupation", w.handleMemory(true))
	mux.HandleFunc("POST /resume_memory_occupation", w.handleMemory(false))

	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if w.crashed.Load() {
			panic(http.ErrAbortHandler)
		}
		rw.Header().Set("X-Fake-Worker", w.cfg.Name)
		mux.ServeHTTP(rw, r)
	})
}

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

// handleInfo serves /model_info and /server_info. sglang's /model_info has
// only model_path; one superset serves both.
func (w *Worker) handleInfo(rw http.ResponseWriter, _ *http.Request) {
	w.mu.Lock()
	version, asleep := w.version, w.asleep
	w.mu.Unlock()
	writeVersioned(rw, version, map[string]any{
		"model_path":        w.cfg.ModelPath,
		"served_model_name": w.cfg.ModelPath,
		"task_type":         w.cfg.TaskType,
		"num_gpus":          1,
		"tp_size":           1,
		"dp_size":           1,
		"version":           serverVersion,
		"weight_version":    version,
		"is_sleeping":       asleep,
		"fake_worker":       w.cfg.Name,
	})
}

func (w *Worker) modelCard() map[string]any {
	return map[string]any{
		"id":            w.cfg.ModelPath,
		"object":        "model",
		"created":       time.Now().Unix(),
		"owned_by":      "sglang",
		"root":          w.cfg.ModelPath,
		"parent":        nil,
		"max_model_len": nil,
		"num_gpus":      1,
		"task_type":     w.cfg.TaskType,
		"dit_precision": "bf16",
		"vae_precision": "fp32",
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

// writeResult answers the weight and memory endpoints: {"success",
// "message"}, 200 on success.
func writeResult(rw http.ResponseWriter, status int, message string) {
	writeJSON(rw, status, map[string]any{"success": status == http.StatusOK, "message": message})
}

// failControl answers a weight or memory operation that could not run.
func (w *Worker) failControl(rw http.ResponseWriter, err error) {
	if w.crashed.Load() {
		panic(http.ErrAbortHandler)
	}
	writeResult(rw, http.StatusInternalServerError, err.Error())
}

// decodeControl reads the JSON body of a weight endpoint; sglang reads these
// bodies without a schema, so a bad one is simply a 400.
func decodeControl(rw http.ResponseWriter, r *http.Request, v any) bool {
	if err := decodeJSON(r, v); err != nil {
		writeResult(rw, http.StatusBadRequest, "invalid request body: "+err.Error())
		return false
	}
	return true
}

// updateFromDiskRequest is sglang's UpdateWeightFromDiskReqInput plus
// weight_version. Fields the fake ignores are declared so that their types are
// checked.
type updateFromDiskRequest struct {
	ModelPath     string   `json:"model_path"`
	FlushCache    *bool    `json:"flush_cache"`
	TargetModules []string `json:"target_modules"`
	WeightVersion string   `json:"weight_version"`
}

// handleUpdateFromDisk swaps the weights once the jobs queued before it are
// done, so no job runs on a mix of versions.
func (w *Worker) handleUpdateFromDisk(rw http.ResponseWriter, r *http.Request) {
	var req updateFromDiskRequest
	if !decodeControl(rw, r, &req) {
		return
	}
	if req.ModelPath == "" {
		writeResult(rw, http.StatusBadRequest, "model_path is required")
		return
	}
	version := cmp.Or(req.WeightVersion, req.ModelPath)
	w.updateWeights(rw, r, version, "Updated model weights from "+req.ModelPath)
}

type updateFromTensorRequest struct {
	SerializedNamedTensors []any    `json:"serialized_named_tensors"`
	TargetModules          []string `json:"target_modules"`
	WeightVersion          string   `json:"weight_version"`
}

// handleUpdateFromTensor accepts any non-empty serialized_named_tensors and
// changes the weight version only if the body names one.
func (w *Worker) handleUpdateFromTensor(rw http.ResponseWriter, r *http.Request) {
	var req updateFromTensorRequest
	if !decodeControl(rw, r, &req) {
		return
	}
	if len(req.SerializedNamedTensors) == 0 {
		writeResult(rw, http.StatusBadRequest, "serialized_named_tensors is required")
		return
	}
	w.updateWeights(rw, r, req.WeightVersion, fmt.Sprintf("Updated %d tensors", len(req.SerializedNamedTensors)))
}

// updateWeights queues a weight update that sets the weight version, unless
// version is empty.
func (w *Worker) updateWeights(rw http.ResponseWriter, r *http.Request, version, message string) {
	err := w.runControl(r.Context(), w.serviceTime(weightUpdateUnits), func() {
		if version != "" && !w.cfg.UpdateFail {
			w.version = version
		}
	})
	if err == nil && w.cfg.UpdateFail {
		err = errors.New("Failed to load weights; rolled back to the previous weights")
	}
	if err != nil {
		w.failControl(rw, err)
		return
	}
	writeResult(rw, http.StatusOK, message)
}

// handleChecksum answers a checksum per module that changes with the weight
// version, so tests can tell versions apart as RL trainers do.
func (w *Worker) handleChecksum(rw http.ResponseWriter, r *http.Request) {
	var req struct {
		ModuleNames []string `json:"module_names"`
	}
	if r.ContentLength != 0 && !decodeControl(rw, r, &req) {
		return
	}
	if len(req.ModuleNames) == 0 {
		req.ModuleNames = []string{"transformer", "vae", "text_encoder"}
	}
	sums := make(map[string]string, len(req.ModuleNames))
	err := w.runControl(r.Context(), 0, func() {
		for _, m := range req.ModuleNames {
			sum := sha256.Sum256([]byte(w.version + "/" + m))
			sums[m] = hex.EncodeToString(sum[:])
		}
	})
	if err != nil {
		w.fail(rw, err)
		return
	}
	writeJSON(rw, http.StatusOK, sums)
}

// handleMemory puts the worker to sleep or wakes it, after the jobs queued
// before; both directions are idempotent.
func (w *Worker) handleMemory(sleep bool) http.HandlerFunc {
	return func(rw http.ResponseWriter, r *http.Request) {
		var message string
		err := w.runControl(r.Context(), w.serviceTime(memoryToggleUnits), func() {
			message = memoryMessage(sleep, w.asleep == sleep)
			w.asleep = sleep
		})
		if err != nil {
			w.failControl(rw, err)
			return
		}
		writeResult(rw, http.StatusOK, message)
	}
}

func memoryMessage(sleep, already bool) string {
	switch {
	case sleep && already:
		return "memory occupation already released"
	case sleep:
		return "memory occupation released"
	case already:
		return "memory occupation already resumed"
	}
	return "memory occupation resumed"
}
