package fakeworker

import (
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"
)

// latentChannels is the channel count of the fake latents, as in Wan and
// FLUX-style VAEs.
const latentChannels = 16

// diffusionRequest is sglang's DiffusionGenerateRequest, as far as the fake
// needs.
type diffusionRequest struct {
	promptField
	NumOutputsPerPrompt *int `json:"num_outputs_per_prompt"`
	GetLatents          bool `json:"get_latents"`
	GetLogProbs         bool `json:"get_log_probs"`
	genParams
}

// runRL decodes one of the RL APIs' requests into req, whose generation
// parameters are params and outputs, and runs it as a job. It answers the
// client itself when that fails.
func (w *Worker) runRL(rw http.ResponseWriter, r *http.Request, req interface{ hasPrompt() bool }, params *genParams, outputs **int) (shape, jobResult, bool) {
	if err := decodePrompted(r, req); err != nil {
		w.fail(rw, err)
		return shape{}, jobResult{}, false
	}
	s, err := params.shape(w.defaultSize(), w.frames(params.NumFrames), outputsPerPrompt(*outputs, math.MaxInt))
	if err != nil {
		w.fail(rw, err)
		return shape{}, jobResult{}, false
	}
	res, err := w.runJob(r.Context(), s.cost(), nil)
	if err != nil {
		w.fail(rw, err)
		return shape{}, jobResult{}, false
	}
	return s, res, true
}

// handleDiffusionGenerate serves sglang's native API, which returns the
// first output as output_b64 plus, when asked, the denoising trajectory.
func (w *Worker) handleDiffusionGenerate(rw http.ResponseWriter, r *http.Request) {
	var req diffusionRequest
	s, res, ok := w.runRL(rw, r, &req, &req.genParams, &req.NumOutputsPerPrompt)
	if !ok {
		return
	}
	format := "png"
	if w.isVideoTask() {
		format = "mp4"
	}
	w.writeMedia(rw, res.version, map[string]any{
		"id":               newID(),
		"created":          time.Now().Unix(),
		"output_b64":       w.mediaToken,
		"output_format":    format,
		"file_path":        nil,
		"peak_memory_mb":   nil,
		"inference_time_s": res.elapsed.Seconds(),
		"trajectory":       trajectory(s, req.GetLatents, req.GetLogProbs),
		"weight_version":   res.version,
	})
}

// trajectory is sglang's TrajectoryData with zero-filled .npy blobs of the
// shapes a latent diffusion model produces, or nil when none was asked for.
func trajectory(s shape, latents, logProbs bool) map[string]any {
	if !latents && !logProbs {
		return nil
	}
	t := map[string]any{
		"latents": nil, "latents_shape": nil, "latents_dtype": nil,
		"timesteps": nil, "log_probs": nil, "log_probs_shape": nil,
	}
	if latents {
		shape := append([]int{s.outputs}, latentShape(s)...)
		t["latents"], t["latents_shape"], t["latents_dtype"] = npyBase64(shape), shape, "torch.float32"
		t["timesteps"] = slices.Repeat([]string{npyBase64(nil)}, s.steps)
	}
	if logProbs {
		shape := []int{s.outputs, s.steps}
		t["log_probs"], t["log_probs_shape"] = npyBase64(shape), shape
	}
	return t
}

// latentShape is the shape of one output's latents over the denoising loop:
// steps+1 × channels × latent frames × height/8 × width/8.
func latentShape(s shape) []int {
	return []int{s.steps + 1, latentChannels, (s.frames + 3) / 4, max(1, s.height/8), max(1, s.width/8)}
}

// rolloutRequest is sglang's RolloutRequest, a JSON body, as far as the fake
// needs.
type rolloutRequest struct {
	promptField
	NumOutputsPerPrompt        *int  `json:"num_outputs_per_prompt"`
	Rollout                    *bool `json:"rollout"`            // default true
	RolloutDebugMode           *bool `json:"rollout_debug_mode"` // default true
	RolloutReturnDenoisingEnv  bool  `json:"rollout_return_denoising_env"`
	RolloutReturnDitTrajectory bool  `json:"rollout_return_dit_trajectory"`
	genParams
}

// handleRollout serves the RL rollout API: a msgpack array with one map per
// output, tensors encoded as sglang encodes them.
func (w *Worker) handleRollout(rw http.ResponseWriter, r *http.Request) {
	var req rolloutRequest
	s, res, ok := w.runRL(rw, r, &req, &req.genParams, &req.NumOutputsPerPrompt)
	if !ok {
		return
	}
	body := appendMsgpack(nil, w.rolloutSamples(req, s, res))
	rw.Header().Set("Content-Type", "application/msgpack")
	rw.Header().Set("Content-Length", strconv.Itoa(len(body)))
	rw.Header().Set("X-Weight-Version", res.version)
	rw.Write(body) // a write error means the client left; nothing to do
}

// rolloutSamples builds sglang's RolloutResponse list. generated_output is a
// flat float32 tensor of ImageBytes bytes, so that the knob sets the answer's
// size; the per-step RL tensors are small stand-ins.
func (w *Worker) rolloutSamples(req rolloutRequest, s shape, res jobResult) []any {
	var logProbs, debug, env, dit any // nil unless asked for
	if valueOr(req.Rollout, true) {
		logProbs = tensorValue(s.steps)
		if valueOr(req.RolloutDebugMode, true) {
			perStep := tensorValue(s.steps)
			debug = mpMap{
				{"rollout_variance_noises", perStep}, {"rollout_prev_sample_means", perStep},
				{"rollout_noise_std_devs", perStep}, {"rollout_model_outputs", perStep},
			}
		}
		if req.RolloutReturnDenoisingEnv {
			env = mpMap{{"image_kwargs", nil}, {"pos_cond_kwargs", nil}, {"neg_cond_kwargs", nil}, {"guidance", nil}}
		}
		if req.RolloutReturnDitTrajectory {
			dit = mpMap{
				{"latents", tensorValue(latentShape(s)...)},
				{"timesteps", tensorValue(s.steps)},
				{"sigmas", tensorValue(s.steps + 1)},
			}
		}
	}
	id, output := newID(), w.outputTensor()
	samples := make([]any, s.outputs)
	for i := range samples {
		samples[i] = mpMap{
			{"request_id", id},
			{"prompt", *req.Prompt},
			{"seed", valueOr(req.Seed, defaultSeed)},
			{"generated_output", output},
			{"rollout_log_probs", logProbs},
			{"rollout_debug_tensors", debug},
			{"denoising_env", env},
			{"dit_trajectory", dit},
			{"inference_time_s", res.elapsed.Seconds()},
			{"peak_memory_mb", nil},
			{"weight_version", res.version},
		}
	}
	return samples
}

// tensorValue is a tensor as sglang's rollout API ships it: a marker map
// whose data is base64 of a safetensors file holding one tensor, "t" (here
// zero-filled float32).
func tensorValue(shape ...int) mpMap {
	dims := make([]any, len(shape))
	for i, d := range shape {
		dims[i] = d
	}
	return mpMap{
		{"__tensor__", true},
		{"data", base64.StdEncoding.EncodeToString(safetensors(shape))},
		{"shape", dims},
		{"dtype", "torch.float32"},
	}
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
