package fakeworker

import (
	"encoding/json"
	"maps"
	"slices"
	"testing"
	"time"
)

// setLora calls /v1/set_lora and expects sglang's success answer.
func setLora(t *testing.T, w *Worker, body string) {
	t.Helper()
	if r := call(t, w, "POST", "/v1/set_lora", body).expect(t, 200); r["status"] != "ok" {
		t.Errorf("set_lora %s = %v", body, r)
	}
}

// expectLoras checks /v1/list_loras against get_lora_status's answer,
// given as JSON.
func expectLoras(t *testing.T, w *Worker, want string) {
	t.Helper()
	r := call(t, w, "GET", "/v1/list_loras", "")
	var got, wanted any
	if err := json.Unmarshal(r.body, &got); err != nil || r.status != 200 {
		t.Fatalf("list_loras: %d %.300s", r.status, r.body)
	}
	if err := json.Unmarshal([]byte(want), &wanted); err != nil {
		t.Fatal(err)
	}
	if !jsonEqual(got, wanted) {
		t.Errorf("list_loras = %s\nwant %s", r.body, want)
	}
}

func jsonEqual(a, b any) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return string(x) == string(y)
}

func TestListLorasFollowsTheAdapterInEffect(t *testing.T) {
	w := start(t, Config{})
	expectLoras(t, w, `{"loaded_adapters":[],"active":{}}`)

	setLora(t, w, `{"lora_nickname":"a","lora_path":"/loras/a"}`)
	aMerged := `{"loaded_adapters":[{"nickname":"a","path":"/loras/a"}],
		"active":{"transformer":[{"nickname":"a","path":"/loras/a","merged":true,"mode":"merged","strength":1.0}]}}`
	expectLoras(t, w, aMerged)

	// unmerge restores the base weights; the adapter stays loaded.
	call(t, w, "POST", "/v1/unmerge_lora_weights", "").expect(t, 200)
	expectLoras(t, w, `{"loaded_adapters":[{"nickname":"a","path":"/loras/a"}],"active":{}}`)
	// merge merges the adapter set last again, at the strength it is given.
	call(t, w, "POST", "/v1/merge_lora_weights", `{"strength":0.5}`).expect(t, 200)
	expectLoras(t, w, `{"loaded_adapters":[{"nickname":"a","path":"/loras/a"}],
		"active":{"transformer":[{"nickname":"a","path":"/loras/a","merged":true,"mode":"merged","strength":0.5}]}}`)

	// dynamic LoRA is in effect unmerged; a reload of a keeps its place.
	setLora(t, w, `{"lora_nickname":"b","lora_path":"/loras/b","strength":0.8,"merge_mode":"dynamic"}`)
	setLora(t, w, `{"lora_nickname":["a","b"],"lora_path":["/loras/a2",null],"strength":[1,0.5]}`)
	expectLoras(t, w, `{"loaded_adapters":[{"nickname":"a","path":"/loras/a2"},{"nickname":"b","path":"/loras/b"}],
		"active":{"transformer":[{"nickname":"a,b","path":"/loras/a2,/loras/b","merged":true,"mode":"merged","strength":1.0}]}}`)
	setLora(t, w, `{"lora_nickname":"b","merge_mode":"dynamic","strength":0.8}`)
	expectLoras(t, w, `{"loaded_adapters":[{"nickname":"a","path":"/loras/a2"},{"nickname":"b","path":"/loras/b"}],
		"active":{"transformer":[{"nickname":"b","path":"/loras/b","merged":false,"mode":"unmerged","strength":0.8}]}}`)
}

func TestMergeBeforeAnyAdapterIsInEffectWithNone(t *testing.T) {
	w := start(t, Config{LoraSwitch: time.Hour})
	call(t, w, "POST", "/v1/merge_lora_weights", "").expect(t, 200) // an hour if it switched
	expectLoras(t, w, `{"loaded_adapters":[],
		"active":{"transformer":[{"nickname":null,"path":null,"merged":true,"mode":"merged","strength":1.0}]}}`)
	if r := call(t, w, "POST", "/v1/images/generations", imageBody(1)); r.header.Get(AdapterHeader) != "" {
		t.Errorf("a job on no adapter names %q", r.header.Get(AdapterHeader))
	}
}

func TestSetLoraSwitchesOnlyWhenTheAdapterChanges(t *testing.T) {
	const switchTime = 30 * time.Millisecond
	w := start(t, Config{LoraSwitch: switchTime})
	switches := 0
	for _, c := range []struct {
		body     string
		switches bool
	}{
		{`{"lora_nickname":"a","lora_path":"/loras/a"}`, true},
		{`{"lora_nickname":"a","lora_path":"/loras/a"}`, false}, // the same path is not loaded again, and a is in effect
		{`{"lora_nickname":"a"}`, false},
		{`{"lora_nickname":"a","target":"transformer"}`, false},
		{`{"lora_nickname":"a","strength":0.5}`, true},
		{`{"lora_nickname":"a","lora_path":"/loras/a-v2","strength":0.5}`, true}, // a new path for the nickname: reloaded, applied again
		{`{"lora_nickname":"a","lora_alpha":16,"strength":0.5}`, true},           // a new alpha: applied again
		{`{"lora_nickname":"a","lora_alpha":16,"strength":0.5}`, false},
		{`{"lora_nickname":"b","lora_path":"/loras/b","target":"transformer_2"}`, false}, // no such module: loaded, not applied
		{`{"lora_nickname":"b"}`, true},
		{`{"lora_nickname":"b","merge_mode":"dynamic"}`, true},
		{`{"lora_nickname":"b","merge_mode":"dynamic"}`, false},
		{`{"lora_nickname":"b","merge_mode":"merge"}`, true},
	} {
		began := time.Now()
		setLora(t, w, c.body)
		took := time.Since(began)
		if c.switches {
			switches++
			if took < switchTime {
				t.Errorf("%s took %v, less than the switch", c.body, took)
			}
		}
		if s := w.Stats(); s.LoraSwitches != switches || s.LoraSwitchTime != time.Duration(switches)*switchTime {
			t.Errorf("after %s: %d switches in %v, want %d", c.body, s.LoraSwitches, s.LoraSwitchTime, switches)
		}
	}
}

func TestMergeAndUnmergeSwitchOnlyWhenTheyChangeTheWeights(t *testing.T) {
	w := start(t, Config{LoraSwitch: time.Millisecond})
	for _, c := range []struct {
		path, body string
		switches   int
	}{
		{"/v1/unmerge_lora_weights", "", 0}, // nothing merged
		{"/v1/set_lora", `{"lora_nickname":"a","lora_path":"/loras/a"}`, 1},
		{"/v1/merge_lora_weights", "", 1}, // already merged at that strength
		{"/v1/merge_lora_weights", `{"strength":0.5}`, 2},
		{"/v1/unmerge_lora_weights", `{"target":"transformer_2"}`, 2}, // no such module: a warning, success
		{"/v1/unmerge_lora_weights", `{"target":"nothing"}`, 2},
		{"/v1/unmerge_lora_weights", "", 3},
		{"/v1/unmerge_lora_weights", "", 3},
		{"/v1/set_lora", `{"lora_nickname":"a","strength":0.5}`, 4}, // unmerge dropped the configuration: applied again
	} {
		call(t, w, "POST", c.path, c.body).expect(t, 200)
		if s := w.Stats(); s.LoraSwitches != c.switches {
			t.Errorf("after %s %s: %d switches, want %d", c.path, c.body, s.LoraSwitches, c.switches)
		}
	}
}

func TestSetLoraErrors(t *testing.T) {
	w := start(t, Config{})
	setLora(t, w, `{"lora_nickname":"a","lora_path":"/loras/a"}`)
	for body, want := range map[string]string{
		`{"lora_nickname":"c"}`:       "Adapter c not found in the pipeline. Please provide lora_path to load it.",
		`{"lora_nickname":["a","b"]}`: "Length mismatch: lora_nickname has 2 items, but lora_path has 1 items. Provide one path per nickname.",
		`{"lora_nickname":["a","b"],"lora_path":["/a","/b"],"strength":[1]}`:         "Length mismatch: lora_nickname has 2 items, but strength has 1 items",
		`{"lora_nickname":["a","b"],"lora_path":["/a","/b"],"target":["all"]}`:       "Length mismatch: lora_nickname has 2 items, but target has 1 items",
		`{"lora_nickname":["a","b"],"lora_path":["/a","/b"],"lora_alpha":[1,2,3]}`:   "Length mismatch: lora_nickname has 2 items, but lora_alpha has 3 items",
		`{"lora_nickname":"a","lora_alpha":0}`:                                       "lora_alpha values must be positive integers or null",
		`{"lora_nickname":"a","target":"unet"}`:                                      "Invalid target(s): ['unet']. Valid targets: ['all', 'transformer', 'transformer_2', 'critic']",
		`{"lora_nickname":"a","merge_mode":"fast"}`:                                  "Invalid LoRA merge mode: fast. Valid modes: ('auto', 'merge', 'dynamic')",
		`{"lora_nickname":["a","d"],"lora_path":[null,"/d"],"merge_mode":"dynamic"}`: "Dynamic LoRA currently supports only one adapter per target. Use merge_mode='merge' for multiple adapters.",
	} {
		if r := call(t, w, "POST", "/v1/set_lora", body).expect(t, 500); r["detail"] != "Failed to set LoRA adapter: "+want {
			t.Errorf("%s: %v, want %q", body, r["detail"], want)
		}
	}
	// d loaded before the error stays loaded, as in sglang; a stays in effect.
	expectLoras(t, w, `{"loaded_adapters":[{"nickname":"a","path":"/loras/a"},{"nickname":"d","path":"/d"}],
		"active":{"transformer":[{"nickname":"a","path":"/loras/a","merged":true,"mode":"merged","strength":1.0}]}}`)
	for _, body := range []string{`{"lora_nickname":null}`, `{"lora_nickname":"a","merge_mode":1}`, `{"lora_nickname":"a","lora_alpha":"x"}`} {
		call(t, w, "POST", "/v1/set_lora", body).expect(t, 422)
	}
}

// TestJobsRecordTheirAdapter checks AdapterHeader and Stats.JobsOnAdapter
// on each generation endpoint.
func TestJobsRecordTheirAdapter(t *testing.T) {
	w := start(t, Config{ImageBytes: 32})
	generate := func() []reply {
		return []reply{
			call(t, w, "POST", "/v1/images/generations", imageBody(1)),
			call(t, w, "POST", "/v1/diffusion/generate", `{"prompt":"p","size":"64x64"}`),
			call(t, w, "POST", "/rollout/generate", `{"prompt":"p","width":64,"height":64,"num_inference_steps":1,"seed":1}`),
		}
	}
	expectAdapter := func(want string, replies []reply) {
		t.Helper()
		for i, r := range replies {
			if r.status != 200 || r.header.Get(AdapterHeader) != want || len(r.header.Values(AdapterHeader)) != min(1, len(want)) {
				t.Errorf("answer %d: %d, %s %q, want %q", i, r.status, AdapterHeader, r.header.Values(AdapterHeader), want)
			}
		}
	}
	expectAdapter("", generate())
	setLora(t, w, `{"lora_nickname":"a","lora_path":"/loras/a"}`)
	expectAdapter("a", generate())
	setLora(t, w, `{"lora_nickname":["a","b"],"lora_path":[null,"/loras/b"]}`)
	expectAdapter("a,b", generate())
	call(t, w, "POST", "/v1/unmerge_lora_weights", "").expect(t, 200)
	expectAdapter("", generate())
	if got := w.Stats().JobsOnAdapter; !maps.Equal(got, map[string]int{"": 6, "a": 3, "a,b": 3}) {
		t.Errorf("jobs by adapter %v", got)
	}
}

func TestVideoJobRecordsItsAdapter(t *testing.T) {
	w := start(t, Config{TaskType: "T2V", ImageBytes: 16})
	setLora(t, w, `{"lora_nickname":"style","lora_path":"/loras/style"}`)
	id := call(t, w, "POST", "/v1/videos", `{"prompt":"p","size":"64x64","num_frames":1}`).expect(t, 200)["id"].(string)
	waitFor(t, "the video to start", func() bool {
		return call(t, w, "GET", "/v1/videos/"+id, "").expect(t, 200)["status"] != "queued"
	})
	// Queued behind the video, this set_lora ends once the video has run.
	setLora(t, w, `{"lora_nickname":"other","lora_path":"/loras/other"}`)
	for _, path := range []string{"/v1/videos/" + id, "/v1/videos/" + id + "/content"} {
		if r := call(t, w, "GET", path, ""); r.status != 200 || r.header.Get(AdapterHeader) != "style" {
			t.Errorf("%s: %d, %s %q, want style", path, r.status, AdapterHeader, r.header.Get(AdapterHeader))
		}
	}
}

// TestLoraSwitchHoldsTheWorker checks that set_lora waits for the job
// before it, as sglang's scheduler queue has it, and the job after waits
// for the switch and runs on the new adapter.
func TestLoraSwitchHoldsTheWorker(t *testing.T) {
	w := start(t, Config{UnitMs: 10, LoraSwitch: 50 * time.Millisecond})
	type result struct {
		name string
		r    reply
	}
	results := make(chan result, 3)
	submit := func(name, path, body string, waiting int) {
		go func() { results <- result{name, call(t, w, "POST", path, body)} }()
		waitQueue(t, w, waiting)
	}
	submit("before", "/v1/images/generations", imageBody(5), 0)
	submit("switch", "/v1/set_lora", `{"lora_nickname":"a","lora_path":"/loras/a"}`, 1)
	submit("after", "/v1/images/generations", imageBody(1), 2)
	var order []string
	got := map[string]reply{}
	for range 3 {
		res := <-results
		order, got[res.name] = append(order, res.name), res.r
	}
	if !slices.Equal(order, []string{"before", "switch", "after"}) {
		t.Errorf("completion order %v", order)
	}
	if a, b := got["before"].header.Get(AdapterHeader), got["after"].header.Get(AdapterHeader); a != "" || b != "a" {
		t.Errorf("job before the switch ran on %q, after on %q", a, b)
	}
}
