package fakeworker

import (
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/msgpack"
)

// latentChannels is the channel count of the fake latents, as in Wan and
// FLUX-style VAEs.
const latentChannels = 16

// diffusionRequest is diffusion_api.py's DiffusionGenerateRequest, as far
// as the fake needs.
type diffusionRequest struct {
	promptField
	NumOutputsPerPrompt *int `json:"num_outputs_per_prompt"`
	GetLatents          bool `json:"get_latents"`
	GetLogProbs         bool `json:"get_log_probs"`
	genParams
}

// handleDiffusionGenerate serves sglang's native API, which returns the
// first output as output_b64 plus, with get_latents, the denoising
// trajectory. get_log_probs is accepted but, as in diffusion_api.py, asks
// the pipeline for nothing, so log_probs stay null.
func (w *Worker) handleDiffusionGenerate(rw http.ResponseWriter, r *http.Request) {
	var req diffusionRequest
	if err := decodePrompted(r, &req); err != nil {
		w.fail(rw, err)
		return
	}
	s, err := req.shape(w.defaultSize(), w.frames(req.NumFrames), outputsPerPrompt(req.NumOutputsPerPrompt, math.MaxInt))
	if err != nil {
		internalServerError(rw) // build_sampling_params raises, unhandled
		return
	}
	run, err := w.runJob(r.Context(), s, nil)
	if err != nil {
		w.failGeneration(rw, err)
		return
	}
	run.tell(rw)
	ext := "png"
	if w.isVideoTask() {
		ext = "mp4"
	}
	id := newID()
	w.writeMedia(rw, w.media(ext).b64, map[string]any{
		"id":               id,
		"created":          time.Now().Unix(),
		"output_b64":       w.mediaToken,
		"output_format":    ext,
		"file_path":        filepath.Join(outputDir, id+"."+ext),
		"peak_memory_mb":   nil,
		"inference_time_s": run.took.Seconds(),
		"trajectory":       trajectory(s, req.GetLatents),
	})
}

// trajectory is sglang's TrajectoryData with zero-filled .npy blobs of the
// shapes a latent diffusion model produces, or nil when no latents were
// asked for.
func trajectory(s shape, latents bool) map[string]any {
	if !latents {
		return nil
	}
	shape := append([]int{s.outputs}, latentShape(s)...)
	return map[string]any{
		"latents": npyBase64(shape), "latents_shape": shape, "latents_dtype": "torch.float32",
		"timesteps": slices.Repeat([]string{npyBase64(nil)}, s.steps),
		"log_probs": nil, "log_probs_shape": nil,
	}
}

// latentShape is the shape of one output's latents over the denoising loop:
// steps+1 × channels × latent frames × height/8 × width/8.
func latentShape(s shape) []int {
	return []int{s.steps + 1, latentChannels, (s.frames + 3) / 4, max(1, s.height/8), max(1, s.width/8)}
}

// rolloutRequest is io_struct.py's RolloutRequest, a JSON body, as far as
// the fake needs.
type rolloutRequest struct {
	promptField
	NumOutputsPerPrompt        *int            `json:"num_outputs_per_prompt"`
	Rollout                    *bool           `json:"rollout"`            // default true
	RolloutDebugMode           *bool           `json:"rollout_debug_mode"` // default true
	RolloutReturnDenoisingEnv  bool            `json:"rollout_return_denoising_env"`
	RolloutReturnDitTrajectory bool            `json:"rollout_return_dit_trajectory"`
	RolloutSDEStepIndices      []int           `json:"rollout_sde_step_indices"`
	RolloutReturnStepIndices   []int           `json:"rollout_return_step_indices"`
	ImagePath                  []string        `json:"image_path"`
	ExtraSamplingParams        json.RawMessage `json:"extra_sampling_params"`
	genParams
}

// rolloutParams are the sampling parameters extra_sampling_params may
// override.
type rolloutParams struct {
	NumOutputsPerPrompt *int `json:"num_outputs_per_prompt"`
	genParams
}

// tensor is a tensor as post_training/utils.py's _maybe_serialize writes
// it: base64 of a safetensors file holding it as "t".
type tensor struct {
	Tensor bool   `json:"__tensor__"`
	Data   string `json:"data"`
	Shape  []int  `json:"shape"`
	Dtype  string `json:"dtype"`
}

// zeros is a zero-filled float32 tensor.
func zeros(shape ...int) *tensor {
	return &tensor{true, base64.StdEncoding.EncodeToString(safetensors(shape)), shape, "torch.float32"}
}

type debugTensors struct {
	VarianceNoises  *tensor `json:"rollout_variance_noises"`
	PrevSampleMeans *tensor `json:"rollout_prev_sample_means"`
	NoiseStdDevs    *tensor `json:"rollout_noise_std_devs"`
	ModelOutputs    *tensor `json:"rollout_model_outputs"`
}

type denoisingEnv struct {
	ImageKwargs   any `json:"image_kwargs"`
	PosCondKwargs any `json:"pos_cond_kwargs"`
	NegCondKwargs any `json:"neg_cond_kwargs"`
	Guidance      any `json:"guidance"`
}

// ditTrajectory is the dit_trajectory of a sample. The older JSON form had
// latents and timesteps; the msgpack form added sigmas.
type ditTrajectory struct {
	Latents   *tensor `json:"latents"`
	Timesteps *tensor `json:"timesteps"`
	Sigmas    *tensor `json:"-"`
}

// rolloutResponse is io_struct.py's RolloutResponse, its fields in order.
type rolloutResponse struct {
	RequestID           string         `json:"request_id"`
	Prompt              string         `json:"prompt"`
	Seed                int            `json:"seed"`
	GeneratedOutput     *tensor        `json:"generated_output"`
	RolloutLogProbs     *tensor        `json:"rollout_log_probs"`
	RolloutDebugTensors *debugTensors  `json:"rollout_debug_tensors"`
	DenoisingEnv        *denoisingEnv  `json:"denoising_env"`
	DitTrajectory       *ditTrajectory `json:"dit_trajectory"`
	InferenceTimeS      *float64       `json:"inference_time_s"`
	PeakMemoryMB        *float64       `json:"peak_memory_mb"`
}

// handleRollout serves rollout_api.py's /rollout/generate: a list with one
// RolloutResponse per output, tensors as _maybe_serialize encodes them (the
// safetensors file in base64, a str), encoded as rollout_api.py does now,
// msgspec.msgpack.encode of [r.model_dump() ...] with media type
// application/msgpack, or with Config.RolloutJSON as the older
// ORJSONResponse did. A scheduler error is 500 {"detail"} in JSON either
// way (an HTTPException). A request without a seed runs and then fails 500
// in plain text, as sglang's does: RolloutResponse requires an int seed.
func (w *Worker) handleRollout(rw http.ResponseWriter, r *http.Request) {
	var req rolloutRequest
	if err := decodePrompted(r, &req); err != nil {
		w.fail(rw, err)
		return
	}
	params := rolloutParams{req.NumOutputsPerPrompt, req.genParams}
	if len(req.ExtraSamplingParams) > 0 && string(req.ExtraSamplingParams) != "null" {
		if err := parseJSON(req.ExtraSamplingParams, &params); err != nil {
			w.fail(rw, badRequest("Invalid sampling params: %v", err))
			return
		}
	}
	s, err := params.shape(w.defaultSize(), w.frames(params.NumFrames), outputsPerPrompt(params.NumOutputsPerPrompt, math.MaxInt))
	if err != nil {
		w.fail(rw, badRequest("Invalid sampling params: %v", err))
		return
	}
	run, err := w.runJob(r.Context(), s, nil)
	if err == nil {
		run.tell(rw)
	}
	var se schedulerError
	switch {
	case errors.As(err, &se) && !w.crashed.Load():
		writeJSON(rw, http.StatusInternalServerError, map[string]any{"detail": err.Error()})
		return
	case err != nil:
		w.fail(rw, err)
		return
	case req.Seed == nil:
		internalServerError(rw)
		return
	}
	samples := w.rolloutSamples(req, s, run.took)
	if w.cfg.RolloutJSON {
		w.writeMedia(rw, w.outputTensor(), samples)
		return
	}
	w.writeRolloutMsgpack(rw, samples)
}

// writeRolloutMsgpack answers samples as msgspec encodes the model_dump of
// each: a map per sample, its fields in RolloutResponse's order, null
// fields included, tensor data a str, and a Content-Length, as Starlette's
// Response sends.
func (w *Worker) writeRolloutMsgpack(rw http.ResponseWriter, samples []rolloutResponse) {
	list := make([]any, len(samples))
	for i, r := range samples {
		var debug, env, dit any
		if d := r.RolloutDebugTensors; d != nil {
			debug = msgpack.Map{
				{Key: "rollout_variance_noises", Value: d.VarianceNoises.msgpack(w)},
				{Key: "rollout_prev_sample_means", Value: d.PrevSampleMeans.msgpack(w)},
				{Key: "rollout_noise_std_devs", Value: d.NoiseStdDevs.msgpack(w)},
				{Key: "rollout_model_outputs", Value: d.ModelOutputs.msgpack(w)},
			}
		}
		if e := r.DenoisingEnv; e != nil {
			env = msgpack.Map{{Key: "image_kwargs"}, {Key: "pos_cond_kwargs"}, {Key: "neg_cond_kwargs"}, {Key: "guidance"}}
		}
		if d := r.DitTrajectory; d != nil {
			dit = msgpack.Map{
				{Key: "latents", Value: d.Latents.msgpack(w)},
				{Key: "timesteps", Value: d.Timesteps.msgpack(w)},
				{Key: "sigmas", Value: d.Sigmas.msgpack(w)},
			}
		}
		list[i] = msgpack.Map{
			{Key: "request_id", Value: r.RequestID},
			{Key: "prompt", Value: r.Prompt},
			{Key: "seed", Value: r.Seed},
			{Key: "generated_output", Value: r.GeneratedOutput.msgpack(w)},
			{Key: "rollout_log_probs", Value: r.RolloutLogProbs.msgpack(w)},
			{Key: "rollout_debug_tensors", Value: debug},
			{Key: "denoising_env", Value: env},
			{Key: "dit_trajectory", Value: dit},
			{Key: "inference_time_s", Value: floatOrNil(r.InferenceTimeS)},
			{Key: "peak_memory_mb", Value: floatOrNil(r.PeakMemoryMB)},
		}
	}
	b, err := msgpack.Marshal(list)
	if err != nil {
		w.fail(rw, err)
		return
	}
	rw.Header().Set("Content-Type", "application/msgpack")
	rw.Header().Set("Content-Length", strconv.Itoa(len(b)))
	rw.Write(b) // a write error means the client left; nothing to do
}

// msgpack is t as _maybe_serialize's dict, nil for no tensor; the media
// token stands for the output tensor's base64.
func (t *tensor) msgpack(w *Worker) any {
	if t == nil {
		return nil
	}
	data := t.Data
	if data == w.mediaToken {
		data = w.outputTensor()
	}
	shape := t.Shape
	if shape == nil {
		shape = []int{}
	}
	return msgpack.Map{{Key: "__tensor__", Value: t.Tensor}, {Key: "data", Value: data}, {Key: "shape", Value: shape}, {Key: "dtype", Value: t.Dtype}}
}

func floatOrNil(f *float64) any {
	if f == nil {
		return nil
	}
	return *f
}

// rolloutSamples builds the RolloutResponse list. generated_output is a
// flat float32 tensor of ImageBytes bytes, so that the knob sets the
// answer's size; the per-step RL tensors are small stand-ins.
func (w *Worker) rolloutSamples(req rolloutRequest, s shape, took time.Duration) []rolloutResponse {
	var logProbs *tensor
	var debug *debugTensors
	var env *denoisingEnv
	var dit *ditTrajectory
	if valueOr(req.Rollout, true) {
		logProbs = zeros(s.steps)
		if valueOr(req.RolloutDebugMode, true) {
			perStep := zeros(s.steps)
			debug = &debugTensors{perStep, perStep, perStep, perStep}
		}
		if req.RolloutReturnDenoisingEnv {
			env = &denoisingEnv{}
		}
		if req.RolloutReturnDitTrajectory {
			dit = &ditTrajectory{Latents: zeros(latentShape(s)...), Timesteps: zeros(s.steps), Sigmas: zeros(s.steps + 1)}
		}
	}
	id := newID()
	output := &tensor{true, w.mediaToken, []int{max(1, w.cfg.ImageBytes/4)}, "torch.float32"}
	seconds := took.Seconds()
	samples := make([]rolloutResponse, s.outputs)
	for i := range samples {
		samples[i] = rolloutResponse{
			RequestID:           id,
			Prompt:              *req.Prompt,
			Seed:                *req.Seed,
			GeneratedOutput:     output,
			RolloutLogProbs:     logProbs,
			RolloutDebugTensors: debug,
			DenoisingEnv:        env,
			DitTrajectory:       dit,
			InferenceTimeS:      &seconds,
		}
	}
	return samples
}

// safetensors is a safetensors file with one zero-filled float32 tensor "t".
func safetensors(shape []int) []byte {
	size := 4 * elements(shape)
	header := fmt.Sprintf(`{"t":{"dtype":"F32","shape":[%s],"data_offsets":[0,%d]}}`, joinInts(shape, ","), size)
	header += strings.Repeat(" ", (8-len(header)%8)%8) // the format pads the header to 8 bytes
	b := binary.LittleEndian.AppendUint64(nil, uint64(len(header)))
	b = append(b, header...)
	return append(b, make([]byte, size)...)
}

// npyBase64 is base64 of a zero-filled little-endian float32 array in NumPy's
// .npy format, version 1.0; a nil shape is a scalar.
func npyBase64(shape []int) string {
	tuple := joinInts(shape, ", ")
	if len(shape) == 1 {
		tuple += ","
	}
	header := fmt.Sprintf("{'descr': '<f4', 'fortran_order': False, 'shape': (%s), }", tuple)
	// The 10-byte preamble, the header and its closing newline fill a multiple of 64 bytes.
	header += strings.Repeat(" ", (64-(10+len(header)+1)%64)%64) + "\n"
	b := binary.LittleEndian.AppendUint16([]byte("\x93NUMPY\x01\x00"), uint16(len(header)))
	b = append(b, header...)
	b = append(b, make([]byte, 4*elements(shape))...)
	return base64.StdEncoding.EncodeToString(b)
}

func elements(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}

func joinInts(ns []int, sep string) string {
	s := make([]string, len(ns))
	for i, n := range ns {
		s[i] = strconv.Itoa(n)
	}
	return strings.Join(s, sep)
}
