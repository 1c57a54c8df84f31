package fakeworker

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"maps"
	"slices"
	"strings"
	"testing"
)

// trainerChecksum is miles_diffusion's _sha256_named_tensors written out
// again, apart from the fake's code: SHA-256 over the tensors sorted by
// name, each name then its raw bytes.
func trainerChecksum(tensors map[string][]byte) string {
	h := sha256.New()
	for _, name := range slices.Sorted(maps.Keys(tensors)) {
		h.Write([]byte(name))
		h.Write(tensors[name])
	}
	return hex.EncodeToString(h.Sum(nil))
}

// tensorBody is an update_weights_from_tensor body with tensors in one
// payload, as miles_diffusion sends a bucket, plus extra fields.
func tensorBody(tensors map[string][]byte, extra string) string {
	var list []Tensor
	for name, data := range tensors {
		list = append(list, Tensor{name, data})
	}
	return `{"serialized_named_tensors":["` + TensorPayload(list...) + `"],"load_format":"flattened_bucket","target_modules":["transformer"]` + extra + `}`
}

func checksums(t *testing.T, w *Worker) map[string]any {
	t.Helper()
	return call(t, w, "POST", "/get_weights_checksum", `{}`).expect(t, 200)
}

func diskChecksum(path, module string) string {
	sum := sha256.Sum256([]byte(path + "/" + module))
	return hex.EncodeToString(sum[:])
}

func TestTensorTransfersAreToldApart(t *testing.T) {
	step1 := map[string][]byte{"blocks.0.attn.weight": {1, 2, 3, 4}, "blocks.0.norm.bias": {5, 6}, "proj_out.weight": {7}}
	step2 := map[string][]byte{"blocks.0.attn.weight": {1, 2, 3, 5}, "blocks.0.norm.bias": {5, 6}, "proj_out.weight": {7}}
	a, b, fresh := start(t, Config{}), start(t, Config{}), start(t, Config{})
	before := checksums(t, a)

	r := call(t, a, "POST", "/update_weights_from_tensor", tensorBody(step1, `,"weight_version":"1"`)).expect(t, 200)
	if len(r) != 2 || r["success"] != true || r["message"] != "Updated 1 modules from tensor (transformer)." {
		t.Errorf("update = %v", r)
	}
	after := checksums(t, a)
	want := trainerChecksum(step1)
	if after["transformer"] != want || after["vae"] != before["vae"] || after["text_encoder"] != before["text_encoder"] {
		t.Errorf("checksums %v after %v; want transformer %s as the trainer computes it, the others unchanged", after, before, want)
	}
	if a.Weights() != "tensor:"+want {
		t.Errorf("Weights() = %q", a.Weights())
	}
	answer := call(t, a, "POST", "/v1/images/generations", imageBody(1))
	if answer.expect(t, 200); answer.header.Get(WeightsHeader) != "tensor:"+want {
		t.Errorf("the job's answer names the weights %q", answer.header.Get(WeightsHeader))
	}
	if on := a.Stats().JobsOn; on["tensor:"+want] != 1 {
		t.Errorf("jobs by weights %v", on)
	}

	// The same tensors give the same checksum whatever a worker held
	// before and whatever version is sent; other tensors another.
	call(t, b, "POST", "/update_weights_from_disk", `{"model_path":"/ckpt/9"}`).expect(t, 200)
	call(t, b, "POST", "/update_weights_from_tensor", tensorBody(step1, `,"weight_version":"other"`)).expect(t, 200)
	call(t, fresh, "POST", "/update_weights_from_tensor", tensorBody(step2, "")).expect(t, 200)
	if got := checksums(t, b)["transformer"]; got != want {
		t.Errorf("same tensors on another worker: %v, want %s", got, want)
	}
	if got := checksums(t, fresh)["transformer"]; got != trainerChecksum(step2) || got == want {
		t.Errorf("other tensors: %v, want %s", got, trainerChecksum(step2))
	}
	call(t, a, "POST", "/update_weights_from_tensor", tensorBody(step2, "")).expect(t, 200)
	if got := checksums(t, a)["transformer"]; got != trainerChecksum(step2) {
		t.Errorf("the second step: %v, want %s", got, trainerChecksum(step2))
	}
}

func TestBucketsOfATransferAddUp(t *testing.T) {
	all := map[string][]byte{"a.weight": {1}, "b.weight": {2, 2}, "c.weight": {3, 3, 3}}
	w := start(t, Config{})
	call(t, w, "POST", "/update_weights_from_tensor", tensorBody(map[string][]byte{"a.weight": {9}, "b.weight": {2, 2}}, "")).expect(t, 200)
	if got := checksums(t, w)["transformer"]; got != trainerChecksum(map[string][]byte{"a.weight": {9}, "b.weight": {2, 2}}) {
		t.Errorf("after the first bucket: %v", got)
	}
	// The next step in two buckets: a tensor sent again is replaced, the
	// others stay, as a module's parameters do.
	call(t, w, "POST", "/update_weights_from_tensor", tensorBody(map[string][]byte{"a.weight": {1}}, "")).expect(t, 200)
	call(t, w, "POST", "/update_weights_from_tensor", tensorBody(map[string][]byte{"c.weight": {3, 3, 3}}, "")).expect(t, 200)
	if got := checksums(t, w)["transformer"]; got != trainerChecksum(all) {
		t.Errorf("after two buckets: %v, want %s", got, trainerChecksum(all))
	}
	// An empty bucket changes nothing.
	call(t, w, "POST", "/update_weights_from_tensor", tensorBody(nil, "")).expect(t, 200)
	if got := checksums(t, w)["transformer"]; got != trainerChecksum(all) {
		t.Errorf("after an empty bucket: %v", got)
	}
}

func TestChecksumAfterUpdateFromDisk(t *testing.T) {
	w := start(t, Config{})
	if got := checksums(t, w); got["transformer"] != diskChecksum("fake/diffusion-model", "transformer") || got["vae"] != diskChecksum("fake/diffusion-model", "vae") {
		t.Errorf("at start: %v", got)
	}
	call(t, w, "POST", "/update_weights_from_tensor", tensorBody(map[string][]byte{"x": {1}, "y": {2}}, "")).expect(t, 200)
	call(t, w, "POST", "/update_weights_from_disk", `{"model_path":"/ckpt/2","target_modules":["transformer","vae"]}`).expect(t, 200)
	got := checksums(t, w)
	if got["transformer"] != diskChecksum("/ckpt/2", "transformer") || got["vae"] != diskChecksum("/ckpt/2", "vae") ||
		got["text_encoder"] != diskChecksum("fake/diffusion-model", "text_encoder") || w.Weights() != "/ckpt/2" {
		t.Errorf("after the update from disk: %v, weights %q", got, w.Weights())
	}
	// The tensors sent before the load from disk are gone from the module.
	call(t, w, "POST", "/update_weights_from_tensor", tensorBody(map[string][]byte{"y": {2}}, "")).expect(t, 200)
	if got := checksums(t, w)["transformer"]; got != trainerChecksum(map[string][]byte{"y": {2}}) {
		t.Errorf("tensors after the load from disk: %v", got)
	}
}

func TestTensorPayloadsTheFakeCannotOpen(t *testing.T) {
	w := start(t, Config{})
	pickle := []byte("\x80\x05\x95 a pickle of CUDA IPC handles")
	body := `{"serialized_named_tensors":["` + base64.StdEncoding.EncodeToString(pickle) + `"],"target_modules":["transformer","vae"]}`
	if r := call(t, w, "POST", "/update_weights_from_tensor", body).expect(t, 200); r["message"] != "Updated 2 modules from tensor (transformer, vae)." {
		t.Errorf("opaque update = %v", r)
	}
	sum := sha256.Sum256(pickle)
	if got := checksums(t, w); got["transformer"] != hex.EncodeToString(sum[:]) || got["vae"] != got["transformer"] {
		t.Errorf("checksums %v, want the SHA-256 of the decoded payload", got)
	}

	// A safetensors file as torch saves it (a dtype, __metadata__) loads
	// its tensors' bytes, whatever their dtype.
	header := `{"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}`
	file := binary.LittleEndian.AppendUint64(nil, uint64(len(header)))
	file = append(append(file, header...), 0, 0, 128, 63, 0, 0, 0, 64)
	body = `{"serialized_named_tensors":["` + base64.StdEncoding.EncodeToString(file) + `"],"payload_gpu_uuids":["GPU-1"]}`
	call(t, w, "POST", "/update_weights_from_tensor", body).expect(t, 200)
	if got := checksums(t, w)["transformer"]; got != trainerChecksum(map[string][]byte{"w": {0, 0, 128, 63, 0, 0, 0, 64}}) {
		t.Errorf("torch's safetensors: %v", got)
	}
}

func TestBadTensorUpdates(t *testing.T) {
	w := start(t, Config{})
	before := checksums(t, w)
	good := TensorPayload(Tensor{"w", []byte{1}})
	for _, c := range []struct{ body, want string }{
		{`{}`, "serialized_named_tensors is required"},
		{`{"serialized_named_tensors":[],"weight_version":"v1"}`, "serialized_named_tensors is required"},
		{`{"serialized_named_tensors":"abc"}`, "serialized_named_tensors must be a list"},
		{`{"serialized_named_tensors":{"transformer":"abc"}}`, "serialized_named_tensors must be a list"},
		{`{"serialized_named_tensors":["` + good + `","` + good + `"]}`, "serialized_named_tensors size must be 1 or world_size (1), got 2"},
		{`{"serialized_named_tensors":["` + good + `"],"payload_gpu_uuids":["GPU-1","GPU-2"]}`, "payload_gpu_uuids needs one entry per payload, got 2 for 1 payloads"},
		{`{"serialized_named_tensors":["abc"]}`, "Failed to deserialize serialized_named_tensors: Non-base64 digit found"},
		{`{"serialized_named_tensors":["YWJj\nZA=="]}`, "Failed to deserialize serialized_named_tensors: Non-base64 digit found"},
		{`{"serialized_named_tensors":[""]}`, "Failed to deserialize serialized_named_tensors: Ran out of input"},
		{`{"serialized_named_tensors":[null]}`, "Failed to deserialize serialized_named_tensors: Ran out of input"},
		{`{"serialized_named_tensors":[7]}`, "Failed to deserialize serialized_named_tensors: a bytes-like object is required, not 'int'"},
		{`{"serialized_named_tensors":[7.5]}`, "Failed to deserialize serialized_named_tensors: a bytes-like object is required, not 'float'"},
		{`{"serialized_named_tensors":[{"transformer":"x"}]}`, "Failed to deserialize serialized_named_tensors: a bytes-like object is required, not 'dict'"},
		{`{"serialized_named_tensors":["` + good + `"],"target_modules":["unet"]}`, "Module(s) requested for update not found in pipeline: ['unet']. Available Module(s): ['transformer', 'vae', 'text_encoder']"},
		{`{"serialized_named_tensors":["` + good + `"],"target_modules":[]}`, "No matching modules found for update. Requested: []. Available nn.Module(s): ['transformer', 'vae', 'text_encoder']"},
		{`{"serialized_named_tensors":["` + good + `"],"target_modules":["transformer","vae"]}`, "Ambiguous tensor payload for multi-module update. Provide a dict mapping module_name -> module payload, requested modules: ['transformer', 'vae']."},
	} {
		if r := call(t, w, "POST", "/update_weights_from_tensor", c.body).expect(t, 400); len(r) != 2 || r["success"] != false || r["message"] != c.want {
			t.Errorf("%.120s: %v, want %q", c.body, r, c.want)
		}
	}
	for _, body := range []string{``, `[1]`, `null`, `{"serialized_named_tensors":["` + good + `"],"payload_gpu_uuids":5}`} {
		call(t, w, "POST", "/update_weights_from_tensor", body).plain500(t)
	}
	if after := checksums(t, w); !maps.Equal(after, before) || w.Weights() != "fake/diffusion-model" {
		t.Errorf("refused updates changed the weights: %v, was %v", after, before)
	}
	call(t, w, "POST", "/v1/images/generations", imageBody(1)).expect(t, 200)
}

func TestChecksumRequests(t *testing.T) {
	w := start(t, Config{})
	r := call(t, w, "POST", "/get_weights_checksum", `{"module_names":["vae","transformer","unet","vae"]}`)
	want := `{"vae":"` + diskChecksum("fake/diffusion-model", "vae") + `","transformer":"` +
		diskChecksum("fake/diffusion-model", "transformer") + `","unet":"not_found"}`
	if r.status != 200 || r.header.Get("Content-Type") != "application/json" || string(r.body) != want {
		t.Errorf("got %d %s, want the modules in the order asked: %s", r.status, r.body, want)
	}
	for body, keys := range map[string]string{
		`{}`:                     "text_encoder,transformer,vae",
		`{"module_names":null}`:  "text_encoder,transformer,vae",
		`{"module_names":[]}`:    "",
		`{"module_names":"vae"}`: "a,e,v", // a str is iterated
		`{"module_names":["transformer"],"weight_version":"v1"}`: "transformer",
	} {
		got := call(t, w, "POST", "/get_weights_checksum", body).expect(t, 200)
		if k := strings.Join(slices.Sorted(maps.Keys(got)), ","); k != keys {
			t.Errorf("%s: modules %q, want %q", body, k, keys)
		}
	}
	for _, body := range []string{``, `[]`, `{"module_names":[1]}`, `{"module_names":5}`} {
		call(t, w, "POST", "/get_weights_checksum", body).plain500(t)
	}
}

func TestNoAnswerTellsTheWeightVersion(t *testing.T) {
	w := start(t, Config{})
	call(t, w, "POST", "/update_weights_from_tensor", tensorBody(map[string][]byte{"w": {1}}, `,"weight_version":"step-7"`)).expect(t, 200)
	for _, path := range []string{"/server_info", "/model_info", "/v1/models", "/models"} {
		if r := call(t, w, "GET", path, ""); strings.Contains(string(r.body), "step-7") {
			t.Errorf("GET %s tells the version sent: %s", path, r.body)
		}
	}
	var sums map[string]string
	if json.Unmarshal(call(t, w, "POST", "/get_weights_checksum", `{}`).body, &sums) != nil || strings.Contains(strings.Join(slices.Collect(maps.Values(sums)), ""), "step-7") {
		t.Errorf("checksums %v", sums)
	}
}
