package scheduler

import (
	"testing"
)

// A declaration moves the workers it names to its version and drops the
// updates that led to the old one; a worker that did not match its
// checksums is stale, stays so through a restart and a wake, and comes
// back by a later declaration that names it, or an update.
func TestDeclaredVersionsAndWorkersLeftBehind(t *testing.T) {
	p, _ := poolOf(t, 2)
	applyUpdate(p, DiskUpdatePath, "step-1", `{"model_path":"/ckpt/1"}`)
	p.DeclareVersion("step-2", map[string]string{"http://a:1": SourceVerified}, []string{"http://b:1"})

	after := newPool(t.Name())
	after.Declare([]string{"http://a:1", "http://b:1"})
	if _, adopted := after.Restore(throughStorage(t, p.Record())); !adopted {
		t.Fatal("the record's weights were not taken")
	}
	for _, u := range after.URLs() {
		after.RecordProbe(u, nil, testHealth)
	}
	after.Moved([]string{"http://b:1"}, Serving) // a wake does not end it
	if v := after.Stats().Version; v != "step-2" || len(after.fleet.history) != 0 {
		t.Fatalf("read back on %q with %d updates to replay; want step-2 and none", v, len(after.fleet.history))
	}
	check := func(when, u string, state State, version, source string) {
		t.Helper()
		if info := infoOf(t, after, u); info.State != state || info.Version != version || info.VersionFrom != source {
			t.Errorf("%s: %s is %s on %q (%s); want %s on %q (%s)", when, u, info.State, info.Version, info.VersionFrom, state, version, source)
		}
	}
	check("read back", "http://a:1", Serving, "step-2", SourceVerified)
	check("read back", "http://b:1", Stale, "step-1", SourceRouter)

	after.DeclareVersion("step-3", map[string]string{"http://b:1": SourceDeclared}, nil)
	check("declared again", "http://b:1", Serving, "step-3", SourceDeclared)
	check("declared again", "http://a:1", Serving, "step-2", SourceVerified) // not named: keeps its version

	after.DeclareVersion("step-4", nil, []string{"http://b:1"})
	after.FinishUpdate("http://b:1", "step-5", true, true)
	check("updated", "http://b:1", Serving, "step-5", SourceRouter)
}

// A worker that waited to be caught up with the updates before a
// declaration is not caught up after it (the updates do not lead to the
// declared weights): it stays stale until a declaration names it.
func TestWorkerBehindADeclarationWaitsForOne(t *testing.T) {
	p, _ := poolOf(t, 1)
	applyUpdate(p, DiskUpdatePath, "step-1", `{"model_path":"/ckpt/1"}`)
	registerRaw(p, "http://r:1")
	if info := infoOf(t, p, "http://r:1"); info.State != Stale || !p.AnyBehind() {
		t.Fatalf("a worker that joined after an update: %s, waiting for a catch-up %v", info.State, p.AnyBehind())
	}
	p.DeclareVersion("step-2", map[string]string{"http://a:1": SourceDeclared}, nil)
	if info := infoOf(t, p, "http://r:1"); info.State != Stale || p.AnyBehind() || len(p.TakeBehind()) != 0 {
		t.Fatalf("after a declaration not naming it: %s, waiting for a catch-up %v", info.State, p.AnyBehind())
	}
	p.DeclareVersion("step-2", map[string]string{"http://r:1": SourceDeclared}, nil)
	if info := infoOf(t, p, "http://r:1"); info.State == Stale || info.Version != "step-2" {
		t.Fatalf("after a declaration naming it: %s on %q", info.State, info.Version)
	}
}
