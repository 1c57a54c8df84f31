package fleet

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/strictjson"
	"github.com/miles-rollout/miles-diffusion-router/internal/workerurl"
)

// What is read back from storage passes the checks of what comes through
// the control API: storage may have been written by an older router, by
// hand, or by someone with access to the volume. Each bad entry is left
// out by itself and the rest kept.

// Rules are the checks of the config loaded last.
type Rules struct {
	MaxWorkers int              // workers the pool may have; 0: no bound
	Guard      *workerurl.Guard // addresses that are never workers
	Weights    *Config          // where weights may be loaded from; nil: anywhere
}

// maxRecord bounds the record read back: a pool of 4,096 workers and a
// long history of LoRA calls takes well under a megabyte.
const maxRecord = 8 << 20

// dropped is an entry of a record left out, and why.
type dropped struct {
	entry string // e.g. workers[3]
	why   error
}

// storedRecord is a record as read, each entry apart, so that one bad
// entry costs only itself.
type storedRecord struct {
	Workers       []json.RawMessage `json:"workers"`
	WeightVersion string            `json:"weight_version"`
	Updates       []json.RawMessage `json:"updates"`
	Adapters      []json.RawMessage `json:"adapters"`
	Updating      json.RawMessage   `json:"updating"`
	Versions      []json.RawMessage `json:"versions"`
}

// readRecord reads data as a record under rules. An error means nothing
// of it can be read; otherwise it returns what passed and what was left
// out.
func readRecord(data []byte, rules Rules) (scheduler.Record, []dropped, error) {
	var stored storedRecord
	if err := json.Unmarshal(data, &stored); err != nil {
		return scheduler.Record{}, nil, err
	}
	var rec scheduler.Record
	var out []dropped
	for i, raw := range stored.Workers {
		w, err := readWorker(raw, rules)
		switch {
		case err != nil:
			out = append(out, dropped{fmt.Sprintf("workers[%d]", i), err})
		case rules.MaxWorkers > 0 && len(rec.Workers) >= rules.MaxWorkers:
			out = append(out, dropped{fmt.Sprintf("workers[%d]", i), fmt.Errorf("beyond max_workers (%d)", rules.MaxWorkers)})
		default:
			rec.Workers = append(rec.Workers, w)
		}
	}
	updates, err := readUpdates(stored, rules)
	if err != nil { // a history with a gap would bring workers to the wrong weights
		return rec, append(out, dropped{"weight_version and updates", err}), nil
	}
	rec.WeightVersion, rec.Updates = stored.WeightVersion, updates
	if rec.Updating, err = readUpdating(stored.Updating, rules); err != nil {
		out = append(out, dropped{"updating", err})
	}
	var badVersions, badAdapters []dropped
	rec.Versions, badVersions = readEach("versions", stored.Versions, readVersion)
	rec.Adapters, badAdapters = readEach("adapters", stored.Adapters, func(raw json.RawMessage) (scheduler.AdapterRecord, error) {
		return readAdapter(raw, rules)
	})
	return rec, slices.Concat(out, badVersions, badAdapters), nil
}

// readEach reads each of raws, named name[i], by read: those that pass,
// in order, and those left out.
func readEach[T any](name string, raws []json.RawMessage, read func(json.RawMessage) (T, error)) ([]T, []dropped) {
	var kept []T
	var out []dropped
	for i, raw := range raws {
		v, err := read(raw)
		if err != nil {
			out = append(out, dropped{fmt.Sprintf("%s[%d]", name, i), err})
			continue
		}
		kept = append(kept, v)
	}
	return kept, out
}

// readVersion reads one of the base-weight versions the fleet has had: a
// version as an update sets it, never empty.
func readVersion(raw json.RawMessage) (string, error) {
	var v string
	if err := json.Unmarshal(raw, &v); err != nil {
		return "", err
	}
	if v == "" {
		return "", errors.New("the weight version is empty")
	}
	return v, CheckVersion(v)
}

// readAdapter reads one adapter's publish: its path as a publish's is
// checked.
func readAdapter(raw json.RawMessage, rules Rules) (scheduler.AdapterRecord, error) {
	var a scheduler.AdapterRecord
	if err := json.Unmarshal(raw, &a); err != nil {
		return a, err
	}
	if a.Name == "" || a.Path == "" || a.Publish <= 0 {
		return a, errors.New("an adapter needs a name, a path and a publish count")
	}
	if rules.Weights != nil {
		if err := rules.Weights.CheckPath(a.Path); err != nil {
			return a, fmt.Errorf("path: %w", err)
		}
	}
	return a, nil
}

// readWorker reads one worker entry.
func readWorker(raw json.RawMessage, rules Rules) (scheduler.WorkerRecord, error) {
	var w scheduler.WorkerRecord
	if err := json.Unmarshal(raw, &w); err != nil {
		return w, err
	}
	u, err := workerurl.Parse(w.URL)
	switch {
	case err != nil:
		return w, err
	case rules.Guard != nil && rules.Guard.RefusesURL(u):
		return w, workerurl.ErrAdmin
	}
	if err := CheckVersion(w.WeightVersion); err != nil {
		return w, err
	}
	if w.WeightVersionSource != "" && !slices.Contains(scheduler.VersionSources, w.WeightVersionSource) {
		return w, fmt.Errorf("weight_version_source %q is none of %s", w.WeightVersionSource, strings.Join(scheduler.VersionSources, ", "))
	}
	w.URL = u
	return w, nil
}

// replayed are the calls an update history may hold: those the router
// itself sends to the whole fleet.
var replayed = []string{scheduler.DiskUpdatePath, "/v1/set_lora", "/v1/merge_lora_weights", "/v1/unmerge_lora_weights"}

// readUpdates reads the weights of a record: its version and the calls
// that lead there, all of them or none.
func readUpdates(stored storedRecord, rules Rules) ([]scheduler.UpdateRecord, error) {
	if err := CheckVersion(stored.WeightVersion); err != nil {
		return nil, err
	}
	out := make([]scheduler.UpdateRecord, len(stored.Updates))
	for i, raw := range stored.Updates {
		if err := json.Unmarshal(raw, &out[i]); err != nil {
			return nil, fmt.Errorf("updates[%d]: %w", i, err)
		}
		if err := checkUpdate(out[i], rules); err != nil {
			return nil, fmt.Errorf("updates[%d]: %w", i, err)
		}
	}
	return out, nil
}

// readUpdating reads the update in progress as the record was written;
// nil when none was. A worker named as having loaded it that is not a
// worker URL is left out: it is then taken for one that has not.
func readUpdating(raw json.RawMessage, rules Rules) (*scheduler.RunningRecord, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var u scheduler.RunningRecord
	if err := json.Unmarshal(raw, &u); err != nil {
		return nil, err
	}
	if err := checkUpdate(u.UpdateRecord, rules); err != nil {
		return nil, err
	}
	u.Loaded = slices.DeleteFunc(u.Loaded, func(url string) bool {
		_, err := workerurl.Parse(url)
		return err != nil
	})
	return &u, nil
}

// checkUpdate checks one call of a history as the API checks it.
func checkUpdate(u scheduler.UpdateRecord, rules Rules) error {
	if !slices.Contains(replayed, u.Path) {
		return fmt.Errorf("path %q is not a call the router sends", u.Path)
	}
	if err := CheckVersion(u.WeightVersion); err != nil {
		return err
	}
	members, err := strictjson.Object(u.Body)
	if err != nil {
		return fmt.Errorf("body: %w", err)
	}
	for _, field := range []string{"model_path", "lora_path"} {
		for _, p := range pathsOf(strictjson.Member(members, field)) {
			if rules.Weights == nil {
				continue
			}
			if err := rules.Weights.CheckPath(p); err != nil {
				return fmt.Errorf("%s %w", field, err)
			}
		}
	}
	if u.Path == scheduler.DiskUpdatePath && len(pathsOf(strictjson.Member(members, "model_path"))) != 1 {
		return errors.New("an update from disk names no model_path")
	}
	return nil
}

// pathsOf reads a path field given as a string or a list of strings.
func pathsOf(v any) []string {
	switch v := v.(type) {
	case string:
		return []string{v}
	case []any:
		var out []string
		for _, x := range v {
			if s, ok := x.(string); ok {
				out = append(out, s)
			}
		}
		return out
	}
	return nil
}
