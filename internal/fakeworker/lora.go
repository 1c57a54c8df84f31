package fakeworker

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"
)

// AdapterHeader names, on every answer of a generation job that completed
// (and on a video job's GET and content answers once it ran), the LoRA
// adapter the job ran on: the nickname set_lora applied, "a,b" for
// several; absent on the base weights. sglang says nothing of it: it is
// for tests, like Stats.JobsOnAdapter.
const AdapterHeader = "X-Fake-Adapter"

// setAdapter names the adapter a job ran on in its answer.
func setAdapter(rw http.ResponseWriter, adapter string) {
	if adapter != "" {
		rw.Header().Set(AdapterHeader, adapter)
	}
}

// switchTime is how long a LoRA operation holds the worker: the switch
// time if it changed the weights (base weights restored, adapters
// merged), else nothing.
func (w *Worker) switchTime(switched bool) time.Duration {
	if switched {
		return w.cfg.LoraSwitch
	}
	return 0
}

// recordSwitch counts a LoRA operation that changed the weights. w.mu is
// held.
func (w *Worker) recordSwitch(switched bool) {
	if switched {
		w.stats.LoraSwitches++
		w.stats.LoraSwitchTime += w.cfg.LoraSwitch
	}
}

// handleSetLora is common_api.py's /v1/set_lora: lora_nickname (a string
// or a list), lora_path, target ("all"), strength (1.0), merge_mode (the
// server's, "auto") and lora_alpha. Like every LoRA call it goes through
// the scheduler's queue, behind the jobs before it; an exception of the
// pipeline becomes 500 "Failed to set LoRA adapter: …".
func (w *Worker) handleSetLora(rw http.ResponseWriter, r *http.Request) {
	req, message, err := parseSetLora(r)
	if err != nil {
		w.fail(rw, err)
		return
	}
	var switched bool
	var failure error
	err = w.runControl(r.Context(), func() time.Duration {
		switched, failure = w.lora.set(req)
		return w.switchTime(switched)
	}, func() { w.recordSwitch(switched) })
	if err == nil && failure != nil {
		err = &httpError{http.StatusInternalServerError, "Failed to set LoRA adapter: " + failure.Error()}
	}
	if err != nil {
		w.fail(rw, err)
		return
	}
	writeLoraOK(rw, message)
}

// parseSetLora reads a set_lora body, and the message of its success,
// format_lora_message's, which quotes the fields as given.
func parseSetLora(r *http.Request) (setLoraRequest, string, error) {
	body, err := loraBody(r)
	if err != nil {
		return setLoraRequest{}, "", err
	}
	if raw, ok := body["lora_nickname"]; !ok {
		return setLoraRequest{}, "", invalid(missing("body", "lora_nickname"))
	} else if isNull(raw) {
		return setLoraRequest{}, "", invalid(fieldError{Type: "string_type", Loc: []any{"body", "lora_nickname"}, Msg: "Input should be a valid string"})
	}
	var req setLoraRequest
	var targets []string
	var strengths []float64
	var targetList, strengthList bool
	req.nicknames, _, err = stringOrList(body["lora_nickname"], "lora_nickname", "")
	if err == nil {
		req.paths, _, err = stringOrList(body["lora_path"], "lora_path", "")
	}
	if err == nil {
		targets, targetList, err = stringOrList(body["target"], "target", "all")
	}
	if err == nil {
		strengths, strengthList, err = floatOrList(body["strength"])
	}
	if err == nil {
		req.alphas, err = alphas(body["lora_alpha"], len(req.nicknames))
	}
	if err == nil {
		req.mergeMode, err = mergeMode(body["merge_mode"])
	}
	if err != nil {
		return setLoraRequest{}, "", err
	}
	req.targets = broadcast(targets, targetList, len(req.nicknames))
	req.strengths = broadcast(strengths, strengthList, len(req.nicknames))
	strs := make([]string, len(strengths))
	for i, s := range strengths {
		strs[i] = fmt.Sprintf("%.2f", s)
	}
	return req, fmt.Sprintf("Successfully set LoRA adapter(s): %s (target: %s, strength: %s)",
		strings.Join(req.nicknames, ", "), strings.Join(targets, ", "), strings.Join(strs, ", ")), nil
}

// broadcast repeats a single value n times, as _normalize_lora_params
// does for a strength or target not given as a list.
func broadcast[T any](values []T, isList bool, n int) []T {
	if isList {
		return values
	}
	out := make([]T, n)
	for i := range out {
		out[i] = values[0]
	}
	return out
}

// stringOrList reads a field that takes a string or a list of strings
// (null items read as ""), and reports whether it was a list; absent or
// null, it is def.
func stringOrList(raw json.RawMessage, field string, def string) ([]string, bool, error) {
	if isNull(raw) {
		return []string{def}, false, nil
	}
	var one string
	if json.Unmarshal(raw, &one) == nil {
		return []string{one}, false, nil
	}
	var list []string
	if json.Unmarshal(raw, &list) == nil {
		return list, true, nil
	}
	return nil, false, invalid(fieldError{Type: "string_type", Loc: []any{"body", field}, Msg: "Input should be a valid string"})
}

// floatOrList reads a LoRA strength: a number, 1.0 by default, or a list
// of numbers.
func floatOrList(raw json.RawMessage) ([]float64, bool, error) {
	if len(raw) == 0 {
		return []float64{1}, false, nil
	}
	var one float64
	if json.Unmarshal(raw, &one) == nil {
		return []float64{one}, false, nil
	}
	var list []float64
	if json.Unmarshal(raw, &list) == nil {
		return list, true, nil
	}
	return nil, false, invalid(fieldError{Type: "float_type", Loc: []any{"body", "strength"}, Msg: "Input should be a valid number"})
}

// alphas reads lora_alpha: null, an integer for every adapter, or a list
// of integers and nulls.
func alphas(raw json.RawMessage, n int) ([]*int, error) {
	var one *int
	if isNull(raw) || json.Unmarshal(raw, &one) == nil {
		return broadcast([]*int{one}, false, n), nil
	}
	var list []*int
	if json.Unmarshal(raw, &list) == nil {
		return list, nil
	}
	return nil, invalid(fieldError{Type: "int_type", Loc: []any{"body", "lora_alpha"}, Msg: "Input should be a valid integer"})
}

// mergeMode reads merge_mode: a string, or null for the server's mode.
func mergeMode(raw json.RawMessage) (string, error) {
	mode := defaultLoraMergeMode
	if !isNull(raw) && json.Unmarshal(raw, &mode) != nil {
		return "", invalid(fieldError{Type: "string_type", Loc: []any{"body", "merge_mode"}, Msg: "Input should be a valid string"})
	}
	return mode, nil
}

func isNull(raw json.RawMessage) bool {
	return len(raw) == 0 || string(raw) == "null"
}

// loraBody reads the embedded Body parameters of the LoRA endpoints; an
// empty body leaves every parameter to its default.
func loraBody(r *http.Request) (map[string]json.RawMessage, error) {
	b, err := io.ReadAll(r.Body)
	if err != nil {
		return nil, badRequest("reading body: %v", err)
	}
	body := map[string]json.RawMessage{}
	if len(bytes.TrimSpace(b)) == 0 {
		return body, nil
	}
	if err := parseJSON(b, &body); err != nil {
		return nil, err
	}
	return body, nil
}

// writeLoraOK answers a LoRA operation as _handle_lora_request does.
func writeLoraOK(rw http.ResponseWriter, message string) {
	writeJSON(rw, http.StatusOK, map[string]string{"status": "ok", "message": message})
}

// handleMergeLora is common_api.py's /v1/merge_lora_weights: target
// ("all") and strength (1.0).
func (w *Worker) handleMergeLora(rw http.ResponseWriter, r *http.Request) {
	w.loraOp(rw, r, true)
}

// handleUnmergeLora is common_api.py's /v1/unmerge_lora_weights: target
// ("all").
func (w *Worker) handleUnmergeLora(rw http.ResponseWriter, r *http.Request) {
	w.loraOp(rw, r, false)
}

// loraOp merges or unmerges. sglang answers success whatever the target:
// one the pipeline lacks, or no valid target at all, only logs a warning.
func (w *Worker) loraOp(rw http.ResponseWriter, r *http.Request, merge bool) {
	body, err := loraBody(r)
	if err != nil {
		w.fail(rw, err)
		return
	}
	target := "all"
	if raw := body["target"]; len(raw) > 0 && json.Unmarshal(raw, &target) != nil {
		w.fail(rw, invalid(fieldError{Type: "string_type", Loc: []any{"body", "target"}, Msg: "Input should be a valid string"}))
		return
	}
	strength := 1.0
	if raw := body["strength"]; merge && len(raw) > 0 && json.Unmarshal(raw, &strength) != nil {
		w.fail(rw, invalid(fieldError{Type: "float_type", Loc: []any{"body", "strength"}, Msg: "Input should be a valid number"}))
		return
	}
	var switched bool
	err = w.runControl(r.Context(), func() time.Duration {
		if merge {
			switched = w.lora.merge(target, strength)
		} else {
			switched = w.lora.unmerge(target)
		}
		return w.switchTime(switched)
	}, func() { w.recordSwitch(switched) })
	if err != nil {
		w.fail(rw, err)
		return
	}
	if merge {
		writeLoraOK(rw, fmt.Sprintf("Successfully merged LoRA weights (target: %s, strength: %s)", target, pyFloat(strength)))
		return
	}
	writeLoraOK(rw, fmt.Sprintf("Successfully unmerged LoRA weights (target: %s)", target))
}

// handleListLoras is common_api.py's /v1/list_loras: the adapters loaded
// and what each module runs on (get_lora_status). It too waits its turn in
// the scheduler's queue.
func (w *Worker) handleListLoras(rw http.ResponseWriter, r *http.Request) {
	var list loraList
	err := w.runControl(r.Context(), func() time.Duration {
		list = w.lora.status()
		return 0
	}, nil)
	if err != nil {
		w.fail(rw, err)
		return
	}
	writeJSON(rw, http.StatusOK, list)
}
