package scheduler

import (
	"encoding/json"
	"slices"
	"testing"
	"time"
)

// applyUpdate records a weight update that succeeded on every worker of
// p, as the fleet does at the end of one.
func applyUpdate(p *Pool, path, version, body string) {
	for _, u := range p.URLs() {
		p.FinishUpdate(u, version, true, true)
	}
	p.EndUpdate(Update{Path: path, Version: version, Mode: ModeDrain, Body: []byte(body)}, true)
}

// throughStorage is rec as a later process reads it back.
func throughStorage(t *testing.T, rec Record) Record {
	t.Helper()
	data, err := json.Marshal(rec)
	if err != nil {
		t.Fatal(err)
	}
	var back Record
	if err := json.Unmarshal(data, &back); err != nil {
		t.Fatal(err)
	}
	return back
}

func infoOf(t *testing.T, p *Pool, u string) WorkerInfo {
	t.Helper()
	info, ok := p.Worker(u)
	if !ok {
		t.Fatalf("worker %s is not in the pool", u)
	}
	return info
}

func TestFleetReadBackAfterRestart(t *testing.T) {
	before, _ := poolOf(t, 2) // a and b from the config
	registerRaw(before, "http://r:1")
	registerRaw(before, "http://s:1")
	applyUpdate(before, DiskUpdatePath, "step-7", `{"model_path":"/ckpt/7"}`)
	applyUpdate(before, "/v1/set_lora", "step-7+lora:x", `{"lora_nickname":"x","lora_path":"/lora/x"}`)
	before.SetDead("http://s:1", true)
	before.SetDead("http://a:1", true)

	// The process starts again, with a config that lists a but no longer b.
	after := newPool(t.Name())
	after.Declare([]string{"http://a:1"})
	joined, adopted := after.Restore(throughStorage(t, before.Record()))

	if joined != 2 || !adopted {
		t.Fatalf("restore: %d joined, weights taken %v; want 2 and true", joined, adopted)
	}
	if got, want := workerURLs(after), []string{"http://a:1", "http://r:1", "http://s:1"}; !slices.Equal(got, want) {
		t.Fatalf("workers read back: %v; want %v (b left the config)", got, want)
	}
	if v := after.Stats().Version; v != "step-7+lora:x" {
		t.Fatalf("weight version read back: %q", v)
	}
	for u, want := range map[string]State{"http://a:1": Dead, "http://r:1": Unhealthy, "http://s:1": Dead} {
		info := infoOf(t, after, u)
		if info.State != want || info.Version != "step-7+lora:x" {
			t.Errorf("%s read back %s on %q; want %s on step-7+lora:x", u, info.State, info.Version, want)
		}
		if (info.Source == "registered") != (u != "http://a:1") {
			t.Errorf("%s read back from source %s", u, info.Source)
		}
	}
	// A worker that joins now is brought to the weights read back by the
	// same calls, in the same order.
	var replayed []string
	for _, req := range after.fleet.history {
		replayed = append(replayed, req.Path+" "+string(req.Body))
	}
	if want := []string{`/update_weights_from_disk {"model_path":"/ckpt/7"}`, `/v1/set_lora {"lora_nickname":"x","lora_path":"/lora/x"}`}; !slices.Equal(replayed, want) {
		t.Fatalf("updates read back: %q; want %q", replayed, want)
	}

	// The worker read back gets jobs once a probe passes, one being enough.
	if got := after.RecordProbe("http://r:1", nil, testHealth); got != BecameHealthy {
		t.Fatalf("first passed probe of a worker read back: %v; want becameHealthy", got)
	}
	if info := infoOf(t, after, "http://r:1"); info.State != Serving {
		t.Fatalf("worker read back is %s after its probe passed", info.State)
	}
}

func TestWorkerReadBackFailingItsProbeIsUnhealthy(t *testing.T) {
	before := newPool(t.Name())
	registerRaw(before, "http://r:1")
	after := newPool(t.Name())
	after.Restore(throughStorage(t, before.Record()))
	if urls := after.Unverified(); !slices.Equal(urls, []string{"http://r:1"}) {
		t.Fatalf("unverified = %v", urls)
	}
	after.RecordProbe("http://r:1", errProbe, testHealth)
	if after.RecordProbe("http://r:1", nil, testHealth) != Unchanged || infoOf(t, after, "http://r:1").State != Unhealthy {
		t.Fatal("a worker read back that failed its first probe serves after one pass; want health_passes (2)")
	}
	if after.RecordProbe("http://r:1", nil, testHealth) != BecameHealthy {
		t.Fatal("the worker read back did not come back after health_passes passes")
	}
	if urls := after.Unverified(); len(urls) != 0 {
		t.Fatalf("unverified = %v after probes", urls)
	}
}

// A router taking over its pool gives no job to a worker before a probe
// since then has passed: one that died meanwhile gets none.
func TestReverifiedWorkerServesOnceAProbePasses(t *testing.T) {
	p := newPool(t.Name())
	p.Declare([]string{"http://a:1", "http://b:1"})
	p.Reverify()
	if urls := p.Unverified(); !slices.Equal(urls, []string{"http://a:1", "http://b:1"}) {
		t.Fatalf("unverified = %v after Reverify", urls)
	}
	if n := p.ServingCount(); n != 0 {
		t.Fatalf("%d workers serve before any probe", n)
	}
	if p.RecordProbe("http://a:1", nil, testHealth) != BecameHealthy || infoOf(t, p, "http://a:1").State != Serving {
		t.Fatal("a reverified worker does not serve after its probe passed")
	}
	p.RecordProbe("http://b:1", errProbe, testHealth)
	if st := infoOf(t, p, "http://b:1").State; st == Serving {
		t.Fatal("a reverified worker that failed its probe serves")
	}
}

// An update that ran before the record was read is newer than it: the
// pool keeps its weights, and a worker read back catches up with them.
func TestRecordOlderThanAnUpdateLeavesTheWeights(t *testing.T) {
	before := newPool(t.Name())
	registerRaw(before, "http://r:1")
	applyUpdate(before, DiskUpdatePath, "step-7", `{"model_path":"/ckpt/7"}`)

	after, _ := poolOf(t, 1)
	applyUpdate(after, DiskUpdatePath, "step-8", `{"model_path":"/ckpt/8"}`)
	if _, adopted := after.Restore(throughStorage(t, before.Record())); adopted {
		t.Fatal("the record's weights replaced those of a later update")
	}
	if v := after.Stats().Version; v != "step-8" {
		t.Fatalf("weight version %q; want step-8", v)
	}
	if info := infoOf(t, after, "http://r:1"); info.Lifecycle != Stale || info.Version == "step-8" {
		t.Fatalf("worker read back is %s on %q; want stale (until it catches up with step-8)", info.Lifecycle, info.Version)
	}
}

// A standby mirrors the active router's record: workers registered and
// removed there join and leave here, held back or not as there, and the
// fleet's weights are the record's, even past the standby's own.
func TestMirrorFollowsTheLeadersRecord(t *testing.T) {
	leader, _ := poolOf(t, 1) // a, from the config
	registerRaw(leader, "http://r:1")
	registerRaw(leader, "http://s:1")
	applyUpdate(leader, DiskUpdatePath, "step-7", `{"model_path":"/ckpt/7"}`)

	standby, _ := poolOf(t, 1)
	registerRaw(standby, "http://gone:1") // registered in an older record, removed since
	applyUpdate(standby, DiskUpdatePath, "step-6", `{"model_path":"/ckpt/6"}`)

	for _, p := range []*Pool{leader, standby} {
		p.DeclareAdapters([]Adapter{{Name: "a", Path: "/l/a"}}, placementConfig(time.Second))
	}
	if _, _, err := leader.Publish("a", "/l/a-step7", 0); err != nil {
		t.Fatal(err)
	}
	leader.SetDead("http://s:1", true)
	joined, left := standby.Mirror(throughStorage(t, leader.Record()))
	if joined != 2 || left != 1 {
		t.Fatalf("mirror: %d joined, %d left; want 2 and 1", joined, left)
	}
	if got, want := workerURLs(standby), []string{"http://a:1", "http://r:1", "http://s:1"}; !slices.Equal(got, want) {
		t.Fatalf("workers after the mirror: %v; want %v", got, want)
	}
	if v := standby.Stats().Version; v != "step-7" {
		t.Fatalf("weight version after the mirror: %q; want the record's, step-7", v)
	}
	if info := infoOf(t, standby, "http://s:1"); info.State != Dead {
		t.Fatalf("s, held back on the leader, is %s after the mirror", info.State)
	}
	if path := standby.AdapterPath("a"); path != "/l/a-step7" {
		t.Fatalf("adapter a after the mirror loads %q; want the leader's publish, /l/a-step7", path)
	}
	if info := infoOf(t, standby, "http://a:1"); info.Lifecycle != Serving || info.Version != "step-7" {
		t.Fatalf("a is %s on %q after the mirror; want serving step-7, as the record says", info.Lifecycle, info.Version)
	}

	// The leader lets s serve again and updates without r, which missed it.
	leader.SetDead("http://s:1", false)
	for _, u := range []string{"http://a:1", "http://s:1"} {
		leader.FinishUpdate(u, "step-8", true, true)
	}
	leader.FinishUpdate("http://r:1", "step-8", false, false)
	leader.EndUpdate(Update{Path: DiskUpdatePath, Version: "step-8", Mode: ModeDrain, Body: []byte(`{"model_path":"/ckpt/8"}`)}, true)
	standby.Mirror(throughStorage(t, leader.Record()))
	if info := infoOf(t, standby, "http://s:1"); info.State == Dead {
		t.Fatal("s is still held back after the leader let it serve")
	}
	if info := infoOf(t, standby, "http://r:1"); info.Lifecycle != Stale || info.Version != "step-7" {
		t.Fatalf("r is %s on %q; want stale on step-7 until it catches up with step-8", info.Lifecycle, info.Version)
	}
	// r catches up on the leader: the next mirror lets it serve again.
	leader.FinishUpdate("http://r:1", "step-8", true, true)
	standby.Mirror(throughStorage(t, leader.Record()))
	if info := infoOf(t, standby, "http://r:1"); info.Lifecycle != Serving || standby.AnyBehind() {
		t.Fatalf("r is %s after the record says it caught up (workers behind: %v)", info.Lifecycle, standby.AnyBehind())
	}
}

// midUpdate is a pool of workers a and b on step-1 in the middle of an
// update to step-2 (returned) that a has loaded, while b's call is under
// way: the state its router leaves when it dies then.
func midUpdate(t *testing.T) (*Pool, Update) {
	t.Helper()
	p, _ := poolOf(t, 2)
	applyUpdate(p, DiskUpdatePath, "step-1", `{"model_path":"/ckpt/1"}`)
	step2 := Update{Path: DiskUpdatePath, ModelPath: "/ckpt/2", Version: "step-2", Mode: ModeDrain, Body: []byte(`{"model_path":"/ckpt/2"}`)}
	p.BeginUpdate(step2)
	p.FinishUpdate("http://a:1", "step-2", true, true)
	return p, step2
}

// A router that takes over from one that left during an update finishes
// that update: the workers the record shows on it serve, the others are
// stale until they catch up, so none serves the weights it replaces; and
// the caller's retry of it calls no worker that is on it already.
func TestInheritFinishesTheUpdateInProgress(t *testing.T) {
	leader, step2 := midUpdate(t)
	rec := throughStorage(t, leader.Record())
	if rec.Updating == nil || rec.Updating.WeightVersion != "step-2" || rec.WeightVersion != "step-1" {
		t.Fatalf("record written during the update: version %q, updating %+v; want step-1, updating to step-2", rec.WeightVersion, rec.Updating)
	}

	standby, _ := poolOf(t, 2)
	standby.Mirror(rec)
	if v := standby.Stats().Version; v != "step-1" {
		t.Fatalf("a standby mirrors version %q during the leader's update; want step-1, the leader's", v)
	}
	standby.Inherit(rec)
	if v := standby.Stats().Version; v != "step-2" {
		t.Fatalf("the new leader's version is %q; want the inherited update's, step-2", v)
	}
	if info := infoOf(t, standby, "http://a:1"); info.Lifecycle != Serving {
		t.Fatalf("a, on step-2 in the record, is %s", info.Lifecycle)
	}
	if info := infoOf(t, standby, "http://b:1"); info.Lifecycle != Stale || !standby.AnyBehind() {
		t.Fatalf("b, on step-1 in the record, is %s (catch-up due: %v); want stale until it catches up", info.Lifecycle, standby.AnyBehind())
	}
	var replayed []string
	for _, u := range standby.fleet.history {
		replayed = append(replayed, u.Path+" "+string(u.Body))
	}
	if want := []string{`/update_weights_from_disk {"model_path":"/ckpt/2"}`}; !slices.Equal(replayed, want) {
		t.Fatalf("a worker catches up by %q; want %q", replayed, want)
	}

	// The retry calls b alone, taking it from its catch-up; a is done.
	targets, done := standby.BeginUpdate(step2)
	if !slices.Equal(targets, []string{"http://b:1"}) || !slices.Equal(done, []string{"http://a:1"}) {
		t.Fatalf("the retry goes to %v with %v done; want b called, a done", targets, done)
	}
	if standby.AnyBehind() {
		t.Fatal("b still waits for a catch-up once the retry calls it")
	}
	standby.FinishUpdate("http://b:1", "step-2", true, true)
	standby.EndUpdate(step2, true)
	if n := len(standby.fleet.history); n != 1 {
		t.Fatalf("the history holds %d calls after the retry; want the update once", n)
	}
	// The same call once more is an update like any other: every worker
	// is called, as checkpoints are often rewritten at one path.
	if targets, done := standby.BeginUpdate(step2); !slices.Equal(targets, []string{"http://a:1", "http://b:1"}) || len(done) != 0 {
		t.Fatalf("a second call goes to %v with %v done; want both called", targets, done)
	}
}

// A worker's version cannot tell whether it loaded the update in
// progress: a checkpoint rewritten at its path keeps the version. A
// router that takes over holds back every worker the record does not
// show as having loaded it.
func TestInheritHoldsBackWorkersThatDidNotLoadTheSameVersionAgain(t *testing.T) {
	leader, _ := poolOf(t, 2)
	again := Update{Path: DiskUpdatePath, ModelPath: "/ckpt/p", Version: "/ckpt/p", Mode: ModeDrain, Body: []byte(`{"model_path":"/ckpt/p"}`)}
	applyUpdate(leader, DiskUpdatePath, "/ckpt/p", `{"model_path":"/ckpt/p"}`)
	leader.BeginUpdate(again) // the checkpoint at /ckpt/p was rewritten; the leader dies before any worker loads it
	standby, _ := poolOf(t, 2)
	standby.Inherit(throughStorage(t, leader.Record()))
	if n := standby.ServingCount(); n != 0 {
		t.Fatalf("%d workers serve the old checkpoint after the takeover; want none before they load it again", n)
	}
	if targets, done := standby.BeginUpdate(again); !slices.Equal(targets, []string{"http://a:1", "http://b:1"}) || len(done) != 0 {
		t.Fatalf("the retry goes to %v with %v done; want both called", targets, done)
	}
}

// A worker that gave no answer to an update that reloaded a checkpoint
// rewritten at its path shows the fleet's version all the same: found
// again, it catches up before its first job, and a record says it is
// stale, so that a router that reads the record does not let it serve.
func TestAWorkerThatMissedASameVersionUpdateCatchesUp(t *testing.T) {
	p, _ := poolOf(t, 2)
	applyUpdate(p, DiskUpdatePath, "/ckpt/p", `{"model_path":"/ckpt/p"}`)
	again := Update{Path: DiskUpdatePath, ModelPath: "/ckpt/p", Version: "/ckpt/p", Mode: ModeDrain, Body: []byte(`{"model_path":"/ckpt/p"}`)}
	p.BeginUpdate(again)
	p.FinishUpdate("http://a:1", "/ckpt/p", true, true)
	p.FinishUpdate("http://b:1", "/ckpt/p", false, false) // down
	p.EndUpdate(again, true)

	standby, _ := poolOf(t, 2)
	standby.Mirror(throughStorage(t, p.Record()))
	if info := infoOf(t, standby, "http://b:1"); info.Lifecycle == Serving {
		t.Fatal("a router that read the record lets b, which missed the update, serve")
	}

	p.RecordProbe("http://b:1", nil, testHealth) // back, on the checkpoint as it was
	if info := infoOf(t, p, "http://b:1"); info.Lifecycle != Stale || !p.AnyBehind() {
		t.Fatalf("b, found again, is %s (catch-up due: %v); want stale until it catches up", info.Lifecycle, p.AnyBehind())
	}
}

// A router killed during an update and started again finishes it, as a
// router taking over from another does: the worker that had loaded it
// serves, the other waits for its catch-up or the retry.
func TestRestartDuringAnUpdateFinishesIt(t *testing.T) {
	before, step2 := midUpdate(t)

	after, _ := poolOf(t, 2)
	if _, adopted := after.Restore(throughStorage(t, before.Record())); !adopted {
		t.Fatal("the weights read back were not taken")
	}
	if v := after.Stats().Version; v != "step-2" {
		t.Fatalf("version after the restart %q; want the update in progress, step-2", v)
	}
	if a, b := infoOf(t, after, "http://a:1"), infoOf(t, after, "http://b:1"); a.Lifecycle != Serving || b.Lifecycle != Stale {
		t.Fatalf("a is %s, b %s; want a serving step-2 and b stale until it loads it", a.Lifecycle, b.Lifecycle)
	}
	if targets, done := after.BeginUpdate(step2); !slices.Equal(targets, []string{"http://b:1"}) || !slices.Equal(done, []string{"http://a:1"}) {
		t.Fatalf("the retry goes to %v with %v done; want b called, a done", targets, done)
	}
}
