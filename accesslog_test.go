package diffusionrouter_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// logEntry is the first JSON line of file that has all of substrings, or
// nil while there is none.
func logEntry(t *testing.T, file string, substrings ...string) map[string]any {
	t.Helper()
	data, _ := os.ReadFile(file)
	for line := range strings.Lines(string(data)) {
		if !containsAll(line, substrings) {
			continue
		}
		var entry map[string]any
		if err := json.Unmarshal([]byte(line), &entry); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		return entry
	}
	return nil
}

func containsAll(s string, substrings []string) bool {
	for _, sub := range substrings {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}

func TestAccessLogCarriesTheJob(t *testing.T) {
	accessLog := filepath.Join(t.TempDir(), "access.log")
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a"})
	site := "log {\n output file " + accessLog + "\n format json\n}\ndiffusion_router {\n workers " + testrouter.URLs(ws) + "\n}"
	r := testrouter.Start(t, site)
	unitJob := `{"response_format":"b64_json","prompt":"x","size":"512x512","num_inference_steps":4}` // cost 1
	testrouter.ExpectStatus(t, "image", r.Post("/v1/images/generations", unitJob, requestIDHeader, "req-access"), 200)
	var entry map[string]any
	testrouter.WaitFor(t, func() bool {
		entry = logEntry(t, accessLog, `"handled request"`, "req-access")
		return entry != nil
	})
	for k, want := range map[string]any{"worker": ws[0].URL(), "cost": 1.0, "attempts": 1.0} {
		if entry[k] != want {
			t.Errorf("access log field %s = %v, want %v", k, entry[k], want)
		}
	}
	if _, ok := entry["queue_wait"].(float64); !ok {
		t.Errorf("access log field queue_wait = %v", entry["queue_wait"])
	}
}

func TestNoLinePerJobAtInfo(t *testing.T) {
	dir := t.TempDir()
	infoLog, debugLog := filepath.Join(dir, "info.log"), filepath.Join(dir, "debug.log")
	logAt := func(name, level, file string) string {
		return "log " + name + " {\n output file " + file + "\n format json\n level " + level + "\n include http.handlers.diffusion_router\n}\n"
	}
	ws := testrouter.StartWorkers(t, fakeworker.Config{})
	r := testrouter.StartWith(t, logAt("info", "INFO", infoLog)+logAt("debug", "DEBUG", debugLog), "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")
	testrouter.ExpectStatus(t, "image", r.Post("/v1/images/generations", testrouter.SmallImage, requestIDHeader, "req-quiet"), 200)
	// The job's DEBUG line is written once the job is done with: any INFO
	// line about it would have been written by then.
	testrouter.WaitFor(t, func() bool { return logEntry(t, debugLog, `"job finished"`, "req-quiet") != nil })
	if entry := logEntry(t, infoLog, "req-quiet"); entry != nil {
		t.Fatalf("a job was logged at INFO: %v", entry)
	}
}
