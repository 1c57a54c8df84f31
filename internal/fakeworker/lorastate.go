package fakeworker

import (
	"errors"
	"fmt"
	"slices"
	"strings"
)

// The LoRA state follows sglang's pipelines_core/lora/pipeline.py
// (LoRAPipeline), which keeps it per module. The fake's pipelines have one
// module taking LoRA, the transformer: neither transformer_2 (Wan2.2) nor a
// critic.
const loraModule = "transformer"

// loraTargets are LoRAPipeline.VALID_TARGETS.
var loraTargets = []string{"all", "transformer", "transformer_2", "critic"}

// loraMergeModes are server_args.py's LORA_MERGE_MODES. The server's
// default, lora_merge_mode "auto", merges unless the weights are
// FSDP-sharded, which a fake's never are.
var loraMergeModes = []string{"auto", "merge", "dynamic"}

// defaultLoraMergeMode is ServerArgs.lora_merge_mode.
const defaultLoraMergeMode = "auto"

// loadedAdapter is an entry of loaded_adapter_paths and
// loaded_adapter_alphas.
type loadedAdapter struct {
	nickname, path string
	alpha          *int
}

// loraState is LoRAPipeline's state for the transformer. The adapter is
// worker-wide: every job runs on what the last set_lora, merge or unmerge
// left, as no generation request names an adapter.
type loraState struct {
	loaded []loadedAdapter // in load order, as the dicts keep it
	// layers is whether the LoRA layers hold an adapter's weights:
	// set_lora has applied one. name and path are cur_adapter_name and
	// cur_adapter_path, what it applied last; unmerge keeps them, and a
	// later merge merges that adapter again.
	layers     bool
	name, path string
	merged     bool        // is_lora_merged: the adapter is merged into the weights
	dynamic    bool        // the layers compute the adapter on the fly, unmerged (merge_mode "dynamic")
	strength   *float64    // cur_adapter_strength
	config     *loraConfig // cur_adapter_config, which unmerge drops
}

// loraConfig is what set_lora compares to skip a configuration already
// applied: the nicknames and strengths, in order.
type loraConfig struct {
	nicknames []string
	strengths []float64
}

// setLoraRequest is a set_lora call with its lists normalized as
// _normalize_lora_params leaves them, lengths not yet checked.
type setLoraRequest struct {
	nicknames []string
	paths     []string // "" where none was given
	targets   []string
	strengths []float64
	alphas    []*int
	mergeMode string
}

// inEffect names the adapter jobs run on: "" for the base weights.
func (s *loraState) inEffect() string {
	if s.layers && (s.merged || s.dynamic) {
		return s.name
	}
	return ""
}

// set is LoRAPipeline.set_lora. It loads the adapters not loaded yet, or
// loaded from another path, then applies them per target unless the
// transformer runs exactly that configuration already (the early return:
// same nicknames, strengths and merge mode, nothing reloaded). It reports
// whether it applied anything, which costs a switch. Adapters loaded
// before an error stay loaded, as in sglang.
func (s *loraState) set(req setLoraRequest) (switched bool, err error) {
	if !slices.Contains(loraMergeModes, req.mergeMode) {
		return false, fmt.Errorf("Invalid LoRA merge mode: %s. Valid modes: (%s)",
			req.mergeMode, strings.Trim(pyList(loraMergeModes), "[]"))
	}
	if err := req.check(); err != nil {
		return false, err
	}
	reloaded, err := s.load(req)
	if err != nil {
		return false, err
	}
	merge := req.mergeMode != "dynamic"
	for _, g := range req.groups() {
		if g.target == "transformer_2" || g.target == "critic" {
			continue // the pipeline lacks the module: sglang logs a warning and goes on
		}
		if !merge && len(g.nicknames) > 1 {
			return switched, errors.New("Dynamic LoRA currently supports only one adapter per target. Use merge_mode='merge' for multiple adapters.")
		}
		if !reloaded && s.matches(g, merge) {
			continue // "LoRA configuration matches exactly, skipping"
		}
		s.apply(g, merge)
		switched = true
	}
	return switched, nil
}

// check is _normalize_lora_params's checks and set_lora's of the targets.
func (req setLoraRequest) check() error {
	n := len(req.nicknames)
	if len(req.paths) != n {
		return fmt.Errorf("Length mismatch: lora_nickname has %d items, but lora_path has %d items. Provide one path per nickname.", n, len(req.paths))
	}
	for _, l := range []struct {
		field string
		len   int
	}{{"strength", len(req.strengths)}, {"target", len(req.targets)}, {"lora_alpha", len(req.alphas)}} {
		if l.len != n {
			return fmt.Errorf("Length mismatch: lora_nickname has %d items, but %s has %d items", n, l.field, l.len)
		}
	}
	if slices.ContainsFunc(req.alphas, func(a *int) bool { return a != nil && *a <= 0 }) {
		return errors.New("lora_alpha values must be positive integers or null")
	}
	var invalid []string
	for _, t := range req.targets {
		if !slices.Contains(loraTargets, t) {
			invalid = append(invalid, t)
		}
	}
	if invalid != nil {
		return fmt.Errorf("Invalid target(s): %s. Valid targets: %s", pyList(invalid), pyList(loraTargets))
	}
	return nil
}

// load loads each adapter given a path it is not loaded from, and takes a
// new alpha; it reports whether any changed (adapter_updated), which
// forces the configuration to be applied again. Loading the same path
// again is skipped.
func (s *loraState) load(req setLoraRequest) (updated bool, err error) {
	for i, nick := range req.nicknames {
		path, alpha := req.paths[i], req.alphas[i]
		a := s.adapter(nick)
		switch {
		case a == nil && path == "":
			return updated, fmt.Errorf("Adapter %s not found in the pipeline. Please provide lora_path to load it.", nick)
		case a == nil:
			s.loaded = append(s.loaded, loadedAdapter{nick, path, alpha})
		case path != "" && path != a.path:
			a.path, a.alpha = path, alpha
		case alpha != nil && (a.alpha == nil || *a.alpha != *alpha):
			a.alpha = alpha
		default:
			continue
		}
		updated = true
	}
	return updated, nil
}

func (s *loraState) adapter(nickname string) *loadedAdapter {
	i := slices.IndexFunc(s.loaded, func(a loadedAdapter) bool { return a.nickname == nickname })
	if i < 0 {
		return nil
	}
	return &s.loaded[i]
}

// loraGroup is the adapters of a set_lora aimed at one target.
type loraGroup struct {
	target    string
	nicknames []string
	paths     []string
	strengths []float64
}

// groups splits a request by target, in the order targets first appear.
func (req setLoraRequest) groups() []loraGroup {
	var gs []loraGroup
	for i, t := range req.targets {
		j := slices.IndexFunc(gs, func(g loraGroup) bool { return g.target == t })
		if j < 0 {
			gs, j = append(gs, loraGroup{target: t}), len(gs)
		}
		g := &gs[j]
		g.nicknames = append(g.nicknames, req.nicknames[i])
		g.paths = append(g.paths, req.paths[i])
		g.strengths = append(g.strengths, req.strengths[i])
	}
	return gs
}

// matches is _check_lora_config_matches.
func (s *loraState) matches(g loraGroup, merge bool) bool {
	return s.merged == merge && s.config != nil &&
		slices.Equal(s.config.nicknames, g.nicknames) && slices.Equal(s.config.strengths, g.strengths)
}

// apply puts a group's adapters on the transformer: its weights go back to
// the base and take the adapters, merged or dynamic.
func (s *loraState) apply(g loraGroup, merge bool) {
	paths := make([]string, len(g.nicknames))
	for i, nick := range g.nicknames {
		paths[i] = g.paths[i]
		if paths[i] == "" {
			paths[i] = s.adapter(nick).path
		}
	}
	strength := g.strengths[0]
	s.layers, s.merged, s.dynamic = true, merge, !merge
	s.name, s.path = strings.Join(g.nicknames, ","), strings.Join(paths, ",")
	s.strength = &strength
	s.config = &loraConfig{slices.Clone(g.nicknames), slices.Clone(g.strengths)}
}

// targetsModule reports whether a merge or unmerge target covers the
// transformer; for another, sglang logs a warning and does nothing.
func targetsModule(target string) bool {
	return target == "all" || target == loraModule
}

// merge is LoRAPipeline.merge_lora_weights under the default merge mode.
// Merged already at that strength, it does nothing ("LoRA weights are
// already merged"). It reports whether it changed the weights.
func (s *loraState) merge(target string, strength float64) (switched bool) {
	if !targetsModule(target) || s.merged && s.strength != nil && *s.strength == strength {
		return false
	}
	s.merged, s.dynamic, s.strength = true, false, &strength
	return s.layers
}

// unmerge is LoRAPipeline.unmerge_lora_weights: the base weights come
// back and the layers stop computing the adapter. Nothing merged or
// active, it does nothing ("LoRA weights are not merged"). It reports
// whether it changed the weights.
func (s *loraState) unmerge(target string) (switched bool) {
	if !targetsModule(target) || !s.merged && !s.dynamic {
		return false
	}
	switched = s.layers
	s.merged, s.dynamic, s.strength, s.config = false, false, nil, nil
	return switched
}

// loraStatus is an entry of list_loras's "active": the adapter a module
// runs on.
type loraStatus struct {
	Nickname *string  `json:"nickname"`
	Path     *string  `json:"path"`
	Merged   bool     `json:"merged"`
	Mode     string   `json:"mode"` // "merged" or "unmerged"
	Strength *float64 `json:"strength"`
}

// loraList is the answer of /v1/list_loras (get_lora_status).
type loraList struct {
	LoadedAdapters []loadedAdapterStatus   `json:"loaded_adapters"`
	Active         map[string][]loraStatus `json:"active"`
}

type loadedAdapterStatus struct {
	Nickname string `json:"nickname"`
	Path     string `json:"path"`
}

// status is LoRAPipeline.get_lora_status: the adapters loaded, and, for a
// module whose LoRA is in effect (merged, or computed on the fly), what it
// runs on. A merge before any set_lora is in effect with no adapter: null
// nickname and path.
func (s *loraState) status() loraList {
	list := loraList{LoadedAdapters: []loadedAdapterStatus{}, Active: map[string][]loraStatus{}}
	for _, a := range s.loaded {
		list.LoadedAdapters = append(list.LoadedAdapters, loadedAdapterStatus{a.nickname, a.path})
	}
	if !s.merged && !s.dynamic {
		return list
	}
	st := loraStatus{Merged: s.merged, Mode: "unmerged", Strength: s.strength}
	if s.merged {
		st.Mode = "merged"
	}
	if s.layers {
		name, path := s.name, s.path // the answer is encoded once w.mu is released
		st.Nickname, st.Path = &name, &path
	}
	list.Active[loraModule] = []loraStatus{st}
	return list
}
