package fakeworker

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
)

// Tensor is one named tensor of a weight transfer: its raw bytes as the
// trainer holds them (contiguous, little-endian).
type Tensor struct {
	Name string
	Data []byte
}

// TensorPayload is an entry of update_weights_from_tensor's
// serialized_named_tensors that the fake loads as named tensors: base64 of
// a safetensors file holding each tensor as bytes (dtype U8, one
// dimension). Names must differ. A real trainer sends a pickle of CUDA IPC
// handles instead, which the fake cannot open (see tensorPayload).
func TensorPayload(tensors ...Tensor) string {
	header := make(map[string]any, len(tensors))
	var data []byte
	for _, t := range tensors {
		header[t.Name] = map[string]any{
			"dtype":        "U8",
			"shape":        []int{len(t.Data)},
			"data_offsets": []int{len(data), len(data) + len(t.Data)},
		}
		data = append(data, t.Data...)
	}
	h, _ := json.Marshal(header) // strings and ints always marshal
	h = append(h, bytes.Repeat([]byte(" "), (8-len(h)%8)%8)...)
	b := binary.LittleEndian.AppendUint64(nil, uint64(len(h)))
	b = append(append(b, h...), data...)
	return base64.StdEncoding.EncodeToString(b)
}

// Checksum is what get_weights_checksum reports for a module that holds
// tensors: sglang's compute_weights_checksum, which miles_diffusion's
// trainer mirrors to verify a transfer (_sha256_named_tensors): SHA-256
// over the tensors sorted by name, each its name in UTF-8, then its raw
// bytes, nothing between.
func Checksum(tensors ...Tensor) string {
	sorted := slices.Clone(tensors)
	slices.SortStableFunc(sorted, func(a, b Tensor) int { return strings.Compare(a.Name, b.Name) })
	h := sha256.New()
	for _, t := range sorted {
		h.Write([]byte(t.Name))
		h.Write(t.Data)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// tensorPayload is what an entry of serialized_named_tensors loads. A
// safetensors file gives named tensors; any other bytes, such as a real
// trainer's pickle, stand whole for the module's weights, as one tensor
// with no name.
type tensorPayload struct {
	tensors map[string][]byte
	named   bool
}

// decodePayload reads an entry of serialized_named_tensors as
// MultiprocessingSerializer.deserialize starts to: a str is base64 that
// pybase64 decodes with validate=True, and anything else must be bytes.
// When it cannot, it gives what deserialize would raise on such input.
func decodePayload(raw json.RawMessage) (tensorPayload, string) {
	var v any
	json.Unmarshal(raw, &v) // readObject parsed the whole body already
	s, ok := v.(string)
	switch {
	case v == nil:
		return tensorPayload{}, errNoInput // io.BytesIO(None) is empty
	case !ok:
		return tensorPayload{}, fmt.Sprintf("a bytes-like object is required, not '%s'", pyType(raw))
	}
	b, err := base64.StdEncoding.DecodeString(s)
	if err != nil || strings.ContainsAny(s, "\r\n") {
		return tensorPayload{}, "Non-base64 digit found" // pybase64's binascii.Error
	}
	if len(b) == 0 {
		return tensorPayload{}, errNoInput
	}
	if tensors, ok := readSafetensors(b); ok {
		return tensorPayload{tensors, true}, ""
	}
	return tensorPayload{map[string][]byte{"": b}, false}, ""
}

// errNoInput is the unpickler's EOFError on empty input.
const errNoInput = "Ran out of input"

// readSafetensors reads the tensors of a safetensors file: an 8-byte
// little-endian header length, a JSON header giving each tensor's dtype,
// shape and data_offsets, then the data. It reports false for anything
// else.
func readSafetensors(b []byte) (map[string][]byte, bool) {
	if len(b) < 8 {
		return nil, false
	}
	n := binary.LittleEndian.Uint64(b)
	if n > uint64(len(b)-8) {
		return nil, false
	}
	var header map[string]json.RawMessage
	if json.Unmarshal(b[8:8+n], &header) != nil || header == nil {
		return nil, false
	}
	data := b[8+n:]
	tensors := make(map[string][]byte, len(header))
	for name, raw := range header {
		if name == "__metadata__" {
			continue
		}
		var info struct {
			Dtype   string   `json:"dtype"`
			Offsets []uint64 `json:"data_offsets"`
		}
		if json.Unmarshal(raw, &info) != nil || info.Dtype == "" || len(info.Offsets) != 2 ||
			info.Offsets[0] > info.Offsets[1] || info.Offsets[1] > uint64(len(data)) {
			return nil, false
		}
		tensors[name] = data[info.Offsets[0]:info.Offsets[1]]
	}
	return tensors, true
}

// pyType is the name of the Python type json.loads gives for a JSON
// value that is not a string or null.
func pyType(raw json.RawMessage) string {
	switch raw[0] {
	case 't', 'f':
		return "bool"
	case '[':
		return "list"
	case '{':
		return "dict"
	}
	if bytes.ContainsAny(raw, ".eE") {
		return "float"
	}
	return "int"
}

// moduleWeights is what one of the pipeline's modules holds.
type moduleWeights struct {
	label string // names the weights for Weights and Stats().JobsOn
	sum   string // the module's get_weights_checksum
	// tensors are, by name, the tensors loaded into the module from
	// tensor payloads since it was last loaded from disk; nil until then.
	tensors map[string][]byte
	named   bool // tensors came from safetensors payloads
}

// diskWeights is a module loaded from the model at path. The fake has no
// weights to hash: its checksum is of the path and the module's name.
func diskWeights(path, module string) moduleWeights {
	sum := sha256.Sum256([]byte(path + "/" + module))
	return moduleWeights{label: path, sum: hex.EncodeToString(sum[:])}
}

// withTensors is m after p loaded into it. Named tensors replace those of
// the same name and keep the others, as a real module's parameters do; the
// module then holds only tensors it was sent since it was loaded from disk.
// An opaque payload replaces everything.
func (m moduleWeights) withTensors(p tensorPayload) moduleWeights {
	if p.named && len(p.tensors) == 0 {
		return m
	}
	tensors := make(map[string][]byte)
	if p.named && m.named {
		maps.Copy(tensors, m.tensors)
	}
	maps.Copy(tensors, p.tensors)
	list := make([]Tensor, 0, len(tensors))
	for name, data := range tensors {
		list = append(list, Tensor{name, data})
	}
	sum := Checksum(list...)
	return moduleWeights{label: "tensor:" + sum, sum: sum, tensors: tensors, named: p.named}
}
