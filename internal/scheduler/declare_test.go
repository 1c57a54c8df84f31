package scheduler

import (
	"context"
	"net"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

var declaredSums = map[string]string{"transformer": strings.Repeat("ab", 32)}

// isOn fails t unless the worker at u is in state on version, learned as
// source says.
func isOn(t *testing.T, p *Pool, when, u string, state State, version, source string) {
	t.Helper()
	if info := infoOf(t, p, u); info.State != state || info.Version != version || info.VersionFrom != source {
		t.Errorf("%s: %s is %s on %q (%s); want %s on %q (%s)", when, u, info.State, info.Version, info.VersionFrom, state, version, source)
	}
}

// A declaration moves the workers it names to its version and drops the
// updates that led to the old one; a worker that did not match its
// checksums serves nothing, stays so through a restart of the router
// (after which the others are checked again) and a wake, and comes back by a later declaration that names it, or an
// update from disk.
func TestDeclaredVersionsAndWorkersLeftBehind(t *testing.T) {
	p, _ := poolOf(t, 2)
	applyUpdate(p, DiskUpdatePath, "step-1", `{"model_path":"/ckpt/1"}`)
	p.DeclareVersion(Declaration{Version: "step-2", Holds: map[string]string{"http://a:1": SourceVerified}, Differ: []string{"http://b:1"}, Checksums: declaredSums})

	after := newPool(t.Name())
	after.Declare([]string{"http://a:1", "http://b:1"})
	if _, adopted := after.Restore(throughStorage(t, p.Record())); !adopted {
		t.Fatal("the record's weights were not taken")
	}
	for _, u := range after.URLs() {
		after.RecordProbe(u, nil, testHealth)
	}
	after.Moved([]string{"http://b:1"}, Serving) // a wake does not end it
	if v := after.Stats().Version; v != "step-2" || len(after.fleet.history) != 0 || !after.fleet.declared {
		t.Fatalf("read back on %q with %d updates to replay, declared %v; want step-2, none, true", v, len(after.fleet.history), after.fleet.declared)
	}
	// Nothing watched a while no router ran: it is checked again before
	// its first job. b, which failed its check, is not.
	isOn(t, after, "read back", "http://a:1", Stale, "step-2", SourceUnknown)
	isOn(t, after, "read back", "http://b:1", Stale, "step-1", SourceUnknown)
	if got := after.TakeBehind(); !slices.Equal(got, []string{"http://a:1"}) {
		t.Fatalf("checks due after the restart: %v; want a's alone", got)
	}
	plan, _ := after.BeginCatchUp("http://a:1")
	after.Verified(plan, true, true)
	isOn(t, after, "checked", "http://a:1", Serving, "step-2", SourceVerified)

	after.DeclareVersion(Declaration{Version: "step-3", Holds: map[string]string{"http://b:1": SourceDeclared}})
	isOn(t, after, "declared again", "http://b:1", Serving, "step-3", SourceDeclared)
	isOn(t, after, "declared again", "http://a:1", Serving, "step-2", SourceVerified) // not named: keeps its version

	after.DeclareVersion(Declaration{Version: "step-4", Differ: []string{"http://b:1"}})
	targets, _ := after.BeginUpdate(Update{Path: DiskUpdatePath, Version: "step-5", Mode: ModeDrain})
	if !slices.Contains(targets, "http://b:1") {
		t.Fatalf("an update from disk leaves out the worker nobody vouches for: %v", targets)
	}
	after.FinishUpdate("http://b:1", "step-5", true, true)
	after.EndUpdate(Update{Path: DiskUpdatePath, Version: "step-5", Mode: ModeDrain}, true)
	isOn(t, after, "updated", "http://b:1", Serving, "step-5", SourceRouter)
	if after.fleet.declared || len(after.fleet.history) != 1 {
		t.Errorf("after an update from disk the fleet is declared %v with %d updates; want false, 1", after.fleet.declared, len(after.fleet.history))
	}
}

// A worker that waited to be caught up with the updates before a
// declaration is not caught up after it (the updates do not lead to the
// declared weights): it serves nothing until a declaration names it.
func TestWorkerBehindADeclarationWaitsForOne(t *testing.T) {
	p, _ := poolOf(t, 1)
	applyUpdate(p, DiskUpdatePath, "step-1", `{"model_path":"/ckpt/1"}`)
	registerRaw(p, "http://r:1")
	if info := infoOf(t, p, "http://r:1"); info.State != Stale || !p.AnyBehind() {
		t.Fatalf("a worker that joined after an update: %s, waiting for a catch-up %v", info.State, p.AnyBehind())
	}
	p.DeclareVersion(Declaration{Version: "step-2", Holds: map[string]string{"http://a:1": SourceDeclared}})
	if p.AnyBehind() || len(p.TakeBehind()) != 0 {
		t.Fatal("a worker is caught up with updates a declaration made moot")
	}
	isOn(t, p, "after a declaration not naming it", "http://r:1", Stale, "", SourceUnknown)
	p.DeclareVersion(Declaration{Version: "step-2", Holds: map[string]string{"http://r:1": SourceDeclared}})
	isOn(t, p, "after a declaration naming it", "http://r:1", Serving, "step-2", SourceDeclared)
}

// After a declaration with checksums, a worker that joins is asked for
// its own, once, before it serves: one that matches serves the declared
// version, verified; one that differs serves nothing and is not asked
// again; one that does not answer is asked again once a probe finds it.
func TestAJoinerProvesItHoldsTheDeclaredWeights(t *testing.T) {
	p, _ := poolOf(t, 1)
	p.DeclareVersion(Declaration{Version: "step-2", Holds: map[string]string{"http://a:1": SourceVerified}, Checksums: declaredSums})
	for _, u := range []string{"http://m:1", "http://d:1", "http://x:1"} {
		registerRaw(p, u)
		isOn(t, p, "joined", u, Stale, "", SourceUnknown)
	}
	behind := p.TakeBehind()
	if !slices.Equal(behind, []string{"http://m:1", "http://d:1", "http://x:1"}) {
		t.Fatalf("checks started for %v; want the three joiners", behind)
	}
	plans := map[string]CatchUp{}
	for _, u := range behind {
		plan, ok := p.BeginCatchUp(u)
		if !ok || plan.Replay != nil || plan.Version != "step-2" || plan.Checksums["transformer"] != declaredSums["transformer"] {
			t.Fatalf("catch-up of %s: %+v, %v; want a check against the declared checksums", u, plan, ok)
		}
		plans[u] = plan
	}
	p.Verified(plans["http://m:1"], true, true)
	p.Verified(plans["http://d:1"], false, true)
	p.Verified(plans["http://x:1"], false, false)
	isOn(t, p, "checked", "http://m:1", Serving, "step-2", SourceVerified)
	isOn(t, p, "checked", "http://d:1", Stale, "", SourceUnknown)
	isOn(t, p, "checked", "http://x:1", Stale, "", SourceUnknown)
	if got := p.TakeBehind(); len(got) != 0 {
		t.Fatalf("asked again before a probe found them: %v", got)
	}
	p.RecordProbe("http://d:1", nil, testHealth)
	p.RecordProbe("http://x:1", nil, testHealth)
	if got := p.TakeBehind(); !slices.Equal(got, []string{"http://x:1"}) {
		t.Fatalf("after a passed probe, asked again: %v; want only the one that did not answer", got)
	}
}

// After a declaration, a worker that changed behind the router's back
// serves nothing until a declaration names it: its probe could not
// connect (a probe that times out does not count), its /v1/models
// changed, or it answered a job as asleep. Before any declaration none
// of these changes what it serves.
func TestAWorkerChangedBehindTheRoutersBackIsUnknown(t *testing.T) {
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	changes := map[string]func(p *Pool){
		"connection refused": func(p *Pool) { p.RecordProbe("http://a:1", refused, testHealth) },
		"models changed": func(p *Pool) {
			p.SetCapabilities("http://a:1", []string{"T2I"}, "/ckpt/base")
			p.SetCapabilities("http://a:1", []string{"T2I"}, "/ckpt/other")
		},
		"asleep": func(p *Pool) { serveAll(t, p, config(LeastWork{}, 1), Asleep, 1) },
	}
	for name, change := range changes {
		t.Run(name, func(t *testing.T) {
			p, clock := poolOf(t, 1)
			change(p)
			clock.advance(time.Minute) // past any asleep back-off
			isOn(t, p, "before any declaration", "http://a:1", Serving, infoOf(t, p, "http://a:1").Version, infoOf(t, p, "http://a:1").VersionFrom)

			p.DeclareVersion(Declaration{Version: "step-2", Holds: map[string]string{"http://a:1": SourceDeclared}})
			change(p)
			clock.advance(time.Minute)
			p.RecordProbe("http://a:1", nil, testHealth)
			isOn(t, p, "after a declaration", "http://a:1", Stale, "step-2", SourceUnknown)
			if p.workers[0].serving(p.now().UnixNano()) {
				t.Fatalf("the worker nobody vouches for takes jobs")
			}
		})
	}
	t.Run("probe timed out", func(t *testing.T) {
		p, _ := poolOf(t, 1)
		p.DeclareVersion(Declaration{Version: "step-2", Holds: map[string]string{"http://a:1": SourceDeclared}})
		p.RecordProbe("http://a:1", context.DeadlineExceeded, testHealth)
		isOn(t, p, "after a timeout", "http://a:1", Serving, "step-2", SourceDeclared)
	})
}

// A worker that answered a job as asleep, after a declaration with
// checksums, is not asked for its own: asked between the trainer's wake
// and its transfer, they would match the weights it is about to lose. It
// serves again once a declaration names it; while it is taken for asleep
// it shows sleeping, so that a job on a fleet all asleep is told so.
func TestAWorkerFoundAsleepWaitsForTheDeclaration(t *testing.T) {
	p, clock := poolOf(t, 1)
	p.DeclareVersion(Declaration{Version: "step-2", Holds: map[string]string{"http://a:1": SourceVerified}, Checksums: declaredSums})
	serveAll(t, p, config(LeastWork{}, 1), Asleep, 1)
	isOn(t, p, "found asleep", "http://a:1", Sleeping, "step-2", SourceUnknown)
	clock.advance(time.Minute)
	p.RecordProbe("http://a:1", nil, testHealth)
	if got := p.TakeBehind(); len(got) != 0 {
		t.Fatalf("checked after it was found asleep: %v", got)
	}
	isOn(t, p, "awake, not declared", "http://a:1", Stale, "step-2", SourceUnknown)
	p.DeclareVersion(Declaration{Version: "step-3", Holds: map[string]string{"http://a:1": SourceVerified}, Checksums: declaredSums})
	isOn(t, p, "declared", "http://a:1", Serving, "step-3", SourceVerified)
}

// A worker found asleep stays out of the router's own checks whatever
// befalls it next: a probe that then cannot connect to it (a loaded
// machine drops connections; a trainer may restart an engine before its
// transfer) is evidence of a change, not of the weights it holds, and
// its checksums, asked before the transfer, would vouch for the weights
// it is about to lose. Only a declaration brings it back.
func TestAWorkerFoundAsleepIsNotCheckedAfterAFailure(t *testing.T) {
	p, clock := poolOf(t, 1)
	p.DeclareVersion(Declaration{Version: "step-2", Holds: map[string]string{"http://a:1": SourceVerified}, Checksums: declaredSums})
	serveAll(t, p, config(LeastWork{}, 1), Asleep, 1)
	clock.advance(time.Minute) // its asleep back-off is over
	p.RecordProbe("http://a:1", refusedConnection, testHealth)
	clock.advance(time.Minute)
	p.RecordProbe("http://a:1", nil, testHealth)
	p.RecordProbe("http://a:1", nil, testHealth)
	if got := p.TakeBehind(); len(got) != 0 {
		t.Fatalf("checked after it was found asleep, then unreachable: %v", got)
	}
	p.DeclareVersion(Declaration{Version: "step-3", Holds: map[string]string{"http://a:1": SourceVerified}, Checksums: declaredSums})
	isOn(t, p, "declared", "http://a:1", Serving, "step-3", SourceVerified)
}

// A LoRA call after a declaration neither reaches a worker nobody vouches
// for nor builds a history that a later joiner would be caught up with.
func TestALoraCallAfterADeclarationReplaysNothing(t *testing.T) {
	p, _ := poolOf(t, 2)
	p.DeclareVersion(Declaration{Version: "step-2", Holds: map[string]string{"http://a:1": SourceDeclared}, Differ: []string{"http://b:1"}, Checksums: declaredSums})
	lora := Update{Path: "/v1/set_lora", Version: "step-2+lora:x", Mode: ModeDrain, Body: []byte(`{"lora_nickname":"x"}`)}
	targets, _ := p.BeginUpdate(lora)
	if !slices.Equal(targets, []string{"http://a:1"}) {
		t.Fatalf("the LoRA call went to %v; want a only", targets)
	}
	p.FinishUpdate("http://a:1", lora.Version, true, true)
	p.EndUpdate(lora, true)
	if len(p.fleet.history) != 0 || p.fleet.checksums != nil {
		t.Fatalf("after the LoRA call: %d updates to replay, checksums %v; want none", len(p.fleet.history), p.fleet.checksums)
	}
	registerRaw(p, "http://r:1")
	isOn(t, p, "joined after the call", "http://r:1", Stale, "", SourceUnknown)
	isOn(t, p, "not reached", "http://b:1", Stale, "", SourceUnknown)
	if p.AnyBehind() {
		t.Fatal("a catch-up is due with nothing that leads to the fleet's weights")
	}
}

// An update from disk after a declaration is the router's own again: the
// workers nobody vouches for that it did not reach catch up with it.
func TestAnUpdateFromDiskEndsADeclaration(t *testing.T) {
	p, _ := poolOf(t, 2)
	p.DeclareVersion(Declaration{Version: "step-2", Holds: map[string]string{"http://a:1": SourceDeclared}, Differ: []string{"http://b:1"}})
	u := Update{Path: DiskUpdatePath, Version: "step-3", Mode: ModeDrain, Body: []byte(`{"model_path":"/ckpt/3"}`)}
	p.BeginUpdate(u)
	p.FinishUpdate("http://a:1", "step-3", true, true)
	p.FinishUpdate("http://b:1", "", false, false)
	p.EndUpdate(u, true)
	p.RecordProbe("http://b:1", nil, testHealth)
	if got := p.TakeBehind(); !slices.Equal(got, []string{"http://b:1"}) {
		t.Fatalf("catch-ups after the update: %v; want b's", got)
	}
	plan, _ := p.BeginCatchUp("http://b:1")
	if len(plan.Replay) != 1 || plan.Checksums != nil || plan.Version != "step-3" {
		t.Fatalf("b's catch-up: %+v; want the update replayed", plan)
	}
	p.FinishUpdate("http://b:1", "step-3", true, true)
	isOn(t, p, "caught up", "http://b:1", Serving, "step-3", SourceRouter)
}

// A trainer that refits workers a few at a time declares each batch: the
// declared version is the fleet's newest, so latest runs only on the
// workers refit and max-staleness:1 on the others as well, which serve on
// their version.
func TestADeclarationIsTheNewestVersion(t *testing.T) {
	p, _ := poolOf(t, 4)
	applyUpdate(p, DiskUpdatePath, "step-1", `{"model_path":"/ckpt/1"}`)
	p.DeclareVersion(Declaration{Version: "step-2", Holds: map[string]string{"http://a:1": SourceDeclared, "http://b:1": SourceDeclared}})
	if got := servedUnder(t, p, maxStale(t, 0)); !slices.Equal(got, []string{"a", "b"}) {
		t.Errorf("latest ran on %v; want a and b, refit", got)
	}
	if got := servedUnder(t, p, maxStale(t, 1)); !slices.Equal(got, []string{"a", "b", "c", "d"}) {
		t.Errorf("max-staleness:1 ran on %v; want every worker", got)
	}
	if got := servedUnder(t, p, VersionPolicy{}); !slices.Equal(got, []string{"a", "b", "c", "d"}) {
		t.Errorf("no policy ran on %v; want every worker: those not named serve on", got)
	}
}
