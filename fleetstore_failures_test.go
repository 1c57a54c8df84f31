package diffusionrouter_test

import (
	"encoding/json"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// A control call whose change cannot be written to storage says so in its
// answer, which stays a success: the change took effect.
func TestChangesStorageCannotKeepAreReported(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a"}, fakeworker.Config{Name: "b"})
	dir := t.TempDir()
	r := testrouter.StartWith(t, "storage file_system "+dir, "diffusion_router {\n workers "+ws[0].URL()+"\n}")
	record := filepath.Join(dir, "diffusion_router", "default", "fleet.json")
	rp := r.Post("/add_worker?url="+ws[1].URL(), "")
	testrouter.ExpectStatus(t, "add_worker with storage working", rp, 200)
	if _, warned := rp.JSON(t)["warning"]; warned {
		t.Fatalf("a change storage kept was reported as not kept: %s", rp.Body)
	}
	if _, err := os.Stat(record); err != nil {
		t.Fatalf("the record is not written when add_worker answers: %v", err)
	}

	// Storage breaks: its folder is a file now, which no write gets past.
	// A write of the record may be under way in it meanwhile.
	testrouter.WaitFor(t, func() bool { return os.RemoveAll(filepath.Join(dir, "diffusion_router")) == nil })
	if err := os.WriteFile(filepath.Join(dir, "diffusion_router"), []byte("full"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, call := range []testrouter.Reply{
		r.Post("/remove_worker?url="+ws[1].URL(), ""),
		r.Post("/add_worker?url="+ws[1].URL(), ""),
		testrouter.Do(t, "PUT", r.Base+"/workers/"+url.QueryEscape(ws[1].URL()), strings.NewReader(`{"is_dead":true}`)),
		r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/9"}`),
	} {
		testrouter.ExpectStatus(t, "a change storage cannot keep", call, 200)
		body := call.JSON(t)
		if body["persisted"] != false || !strings.Contains(body["warning"].(string), "not written to storage") {
			t.Fatalf("a change storage could not keep was not reported: %s", call.Body)
		}
	}
}

// A record that does not decode is kept aside under a name of its own
// before the pool starts without it, and a new one replaces it.
func TestUnreadableRecordIsKeptAside(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a"})
	dir := t.TempDir()
	folder := filepath.Join(dir, "diffusion_router", "default")
	if err := os.MkdirAll(folder, 0o700); err != nil {
		t.Fatal(err)
	}
	broken := []byte(`{"workers": [{"url": "http://10.0.0.1:30000", "registered": tr`)
	if err := os.WriteFile(filepath.Join(folder, "fleet.json"), broken, 0o600); err != nil {
		t.Fatal(err)
	}
	r := testrouter.StartWith(t, "storage file_system "+dir, "diffusion_router {\n workers "+ws[0].URL()+"\n}")
	testrouter.ExpectStatus(t, "add_worker", r.Post("/add_worker?url=http://10.0.0.2:30000", ""), 200)

	aside, _ := filepath.Glob(filepath.Join(folder, "fleet.json.unreadable-*"))
	if len(aside) != 1 {
		t.Fatalf("records kept aside: %v; want one", aside)
	}
	if kept, _ := os.ReadFile(aside[0]); string(kept) != string(broken) {
		t.Fatalf("kept aside: %q; want the record as it was", kept)
	}
	var rec struct{ Workers []testrouter.StoredWorker }
	data, _ := os.ReadFile(filepath.Join(folder, "fleet.json"))
	if err := json.Unmarshal(data, &rec); err != nil || len(rec.Workers) != 2 {
		t.Fatalf("the new record: %s (%v)", data, err)
	}
}

// A record read back passes the checks of the API: what does not is left
// out, entry by entry, the rest kept, and the record as read kept aside.
func TestRecordReadBackIsChecked(t *testing.T) {
	dir := t.TempDir()
	folder := filepath.Join(dir, "diffusion_router", "default")
	if err := os.MkdirAll(folder, 0o700); err != nil {
		t.Fatal(err)
	}
	var workers []string
	for i := range 300 {
		workers = append(workers, `{"url":"http://10.0.`+strconv.Itoa(i/256)+`.`+strconv.Itoa(i%256)+`:30000","registered":true}`)
	}
	record := `{"workers":[{"url":"http://10.9.0.1:30000","registered":"yes"},` + strings.Join(workers, ",") + `],` +
		`"weight_version":"v1","updates":[{"path":"@127.0.0.1:41099/pwned","weight_version":"v1","body":{"model_path":"/ckpt/1"}}]}`
	if err := os.WriteFile(filepath.Join(folder, "fleet.json"), []byte(record), 0o600); err != nil {
		t.Fatal(err)
	}
	r := testrouter.StartWith(t, "storage file_system "+dir, "diffusion_router {\n max_workers 10\n health_interval 1h\n}")
	listed := r.Get("/list_workers").JSON(t)["urls"].([]any)
	if len(listed) != 10 || listed[0] != "http://10.0.0.0:30000" {
		t.Fatalf("workers read back under max_workers 10: %v", listed)
	}
	if v := r.Get("/health").JSON(t)["weight_version"]; v == "v1" {
		t.Fatal("weights read back from a record whose update names a path the router never sends")
	}
	aside, _ := filepath.Glob(filepath.Join(folder, "fleet.json.unreadable-*"))
	if len(aside) != 1 {
		t.Fatalf("records kept aside: %v; want one", aside)
	}
}
