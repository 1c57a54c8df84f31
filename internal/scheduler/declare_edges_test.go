package scheduler

import (
	"net"
	"slices"
	"syscall"
	"testing"
	"time"
)

// Declared versions at the edges: a worker that leaves and comes back, a
// check racing a sleep or a new registration, a retried LoRA call, router
// restarts. Each once let a worker serve weights the router could not
// vouch for.

var refusedConnection = &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}

// A worker removed while a job of it still runs, and registered again
// before that job ends, is unknown as any worker that joins after a
// declaration: while it was out of the pool nothing watched it, and the
// trainer may have moved its weights, or it may have restarted.
func TestWorkerRegisteredAgainWhileItsJobRunsIsUnknown(t *testing.T) {
	p, _ := poolOf(t, 2)
	cfg := config(LeastWork{}, 1)
	p.DeclareVersion(Declaration{Version: "step-2", Holds: map[string]string{"http://a:1": SourceDeclared, "http://b:1": SourceDeclared}})
	registerRaw(p, "http://r:1")
	p.DeclareVersion(Declaration{Version: "step-2", Holds: map[string]string{"http://r:1": SourceDeclared}})
	p.Undeclare([]string{"http://a:1", "http://b:1"}) // only r is left to take the job
	tk, _ := choose(t, p, cfg, 1)
	if !p.Remove("http://r:1") {
		t.Fatal("r was not removed")
	}
	// ... the trainer moves r's weights, or r restarts, while it is out of the pool ...
	if _, _, err := registerRaw(p, "http://r:1"); err != nil {
		t.Fatal(err)
	}
	isOn(t, p, "registered again while its job ran", "http://r:1", Stale, "step-2", SourceUnknown)
	p.Release(tk, End{Worker: Succeeded})
}

// The router's own check of an unvouched worker leaves a worker the
// router put to sleep (release_memory_occupation through it) while the
// check waited for the fleet's lock asleep: it is checked once woken,
// not taken for serving and given jobs its engine answers "Server is
// sleeping".
func TestACheckDoesNotWakeAWorkerTheRouterPutToSleep(t *testing.T) {
	p, _ := poolOf(t, 2)
	p.DeclareVersion(Declaration{Version: "step-2", Checksums: declaredSums,
		Holds: map[string]string{"http://a:1": SourceVerified, "http://b:1": SourceVerified}})
	p.RecordProbe("http://a:1", refusedConnection, testHealth) // a restarts: to be checked
	p.RecordProbe("http://a:1", nil, testHealth)
	behind := p.TakeBehind()                                // a request or a probe starts the check; it waits for the fleet's lock...
	p.Moved([]string{"http://a:1", "http://b:1"}, Sleeping) // ...held by a sleep through the router
	for _, u := range behind {
		if plan, ok := p.BeginCatchUp(u); ok {
			p.Verified(plan, true, true) // sglang answers checksums while asleep (modules on the CPU)
		}
	}
	if info := infoOf(t, p, "http://a:1"); info.Lifecycle != Sleeping {
		t.Errorf("a worker the router put to sleep is %s (lifecycle %s) after its check; want sleeping", info.State, info.Lifecycle)
	}
}

// A LoRA call after a declaration does not reach a worker the router
// cannot vouch for, not even when a router that takes over retries the
// call its predecessor left in progress: a worker whose checksums
// differed from the declaration does not serve again on weights nobody
// vouched for.
func TestARetriedLoraCallDoesNotVouchForAWorkerThatFailedItsCheck(t *testing.T) {
	p, _ := poolOf(t, 2)
	p.DeclareVersion(Declaration{Version: "step-2", Checksums: declaredSums,
		Holds: map[string]string{"http://a:1": SourceVerified}, Differ: []string{"http://b:1"}})
	lora := Update{Path: "/v1/set_lora", Version: "step-2+lora:x", Mode: ModeDrain, Body: []byte(`{"lora_nickname":"x"}`)}
	p.BeginUpdate(lora) // the active router dies during the call

	next := newPool(t.Name())
	next.Declare([]string{"http://a:1", "http://b:1"})
	next.Inherit(throughStorage(t, p.Record()))
	targets, _ := next.BeginUpdate(lora) // the trainer retries the call on the router that took over
	if slices.Contains(targets, "http://b:1") {
		next.FinishUpdate("http://b:1", lora.Version, true, true)
	}
	next.EndUpdate(lora, true)
	isOn(t, next, "after the retried LoRA call", "http://b:1", Stale, "", SourceUnknown)
}

// After a declaration, a worker whose LoRA call failed serves no job
// after a sleep and a wake through the router either: no catch-up leads
// to the fleet's weights, so it waits for the trainer's word.
func TestAWakeDoesNotEndTheStalenessOfAFailedLoraCall(t *testing.T) {
	p, _ := poolOf(t, 2)
	p.DeclareVersion(Declaration{Version: "step-2", Holds: map[string]string{"http://a:1": SourceDeclared, "http://b:1": SourceDeclared}})
	lora := Update{Path: "/v1/set_lora", Version: "step-2+lora:x", Mode: ModeDrain, Body: []byte(`{"lora_nickname":"x"}`)}
	p.BeginUpdate(lora)
	p.FinishUpdate("http://a:1", lora.Version, true, true)
	p.FinishUpdate("http://b:1", lora.Version, false, true) // b answered 400
	p.EndUpdate(lora, true)
	if info := infoOf(t, p, "http://b:1"); info.State != Stale {
		t.Fatalf("b after its LoRA call failed: %s; want stale", info.State)
	}
	p.Moved([]string{"http://a:1", "http://b:1"}, Sleeping)
	p.Moved([]string{"http://a:1", "http://b:1"}, Serving)
	if info := infoOf(t, p, "http://b:1"); info.State == Serving {
		t.Errorf("b serves %q (%s) after a sleep and a wake, without the LoRA the fleet is on (%q)", info.Version, info.VersionFrom, p.Version())
	}
}

// A declaration that names no worker is about the workers that are up:
// not one failing its health probes, which the trainer could not have
// reached, and which would otherwise serve the declared version on the
// weights it had once its probes pass.
func TestADefaultDeclarationNamesOnlyServingWorkers(t *testing.T) {
	p, _ := poolOf(t, 2)
	for range testHealth.Fails {
		p.RecordProbe("http://b:1", errProbe, testHealth) // its /health answers 503
	}
	if info := infoOf(t, p, "http://b:1"); info.State != Unhealthy {
		t.Fatalf("b after failing its probes: %s; want unhealthy", info.State)
	}
	targets, err := p.DeclareTargets()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(targets, []string{"http://a:1"}) {
		t.Errorf("a declaration naming no worker is about %v; want the serving worker a only", targets)
	}
}

// With the fleet's version declared with checksums, a router that
// restarts (Restore) or takes over (Reverify) asks each worker the record
// vouches for again before its first job, as it asks a joiner: no probe
// watched them while no router led, and one may have restarted on its
// base weights in that gap.
func TestARouterThatRestartsChecksTheWorkersItDidNotWatch(t *testing.T) {
	p, _ := poolOf(t, 1)
	p.DeclareVersion(Declaration{Version: "step-2", Checksums: declaredSums, Holds: map[string]string{"http://a:1": SourceVerified}})

	after := newPool(t.Name())
	after.Declare([]string{"http://a:1"})
	after.Restore(throughStorage(t, p.Record()))
	after.RecordProbe("http://a:1", nil, testHealth) // a restarted while no router watched; up again now
	if got := after.TakeBehind(); !slices.Equal(got, []string{"http://a:1"}) {
		t.Errorf("checks due after the router restarted: %v; want a's, before its first job (a is %s, %s)", got,
			infoOf(t, after, "http://a:1").State, infoOf(t, after, "http://a:1").VersionFrom)
	}
}

// A declaration naming a worker that answered a job "asleep" (the
// colocated loop: the trainer slept it, then woke it and moved its
// weights, past the router) lets it serve at once, as a wake through the
// router does, rather than after its asleep back-off (up to 30 s).
func TestADeclarationEndsTheAsleepBackOff(t *testing.T) {
	p, clock := poolOf(t, 1)
	cfg := config(LeastWork{}, 1)
	for range 6 { // the trainer's sleep spans several rollout attempts
		serveAll(t, p, cfg, Asleep, 1)
		clock.advance(time.Duration(p.workers[0].health.asleepUntil - p.now().UnixNano()))
	}
	serveAll(t, p, cfg, Asleep, 1)
	p.DeclareVersion(Declaration{Version: "step-2", Holds: map[string]string{"http://a:1": SourceDeclared}})
	if info := infoOf(t, p, "http://a:1"); info.State != Serving {
		t.Errorf("a after a declaration naming it: %s for another %v; want serving", info.State,
			time.Duration(p.workers[0].health.asleepUntil-p.now().UnixNano()))
	}
}

// The router's check of a worker runs as long as the worker takes to
// hash its weights (gigabytes for a diffusion transformer). A worker
// removed and registered again meanwhile (miles restarting an engine:
// remove_worker, restart, add_worker) is a new worker, unknown: the
// answer of the engine that left does not vouch for it.
func TestACheckOfAWorkerThatLeftDoesNotVouchForItsSuccessor(t *testing.T) {
	p, _ := poolOf(t, 1)
	p.DeclareVersion(Declaration{Version: "step-2", Checksums: declaredSums, Holds: map[string]string{"http://a:1": SourceVerified}})
	registerRaw(p, "http://r:1")
	if got := p.TakeBehind(); !slices.Equal(got, []string{"http://r:1"}) {
		t.Fatalf("checks due: %v; want r's", got)
	}
	plan, ok := p.BeginCatchUp("http://r:1")
	if !ok {
		t.Fatal("r's check did not begin")
	}
	p.Remove("http://r:1") // while the old engine hashes its weights
	registerRaw(p, "http://r:1")
	p.Verified(plan, true, true) // the old engine's answer
	isOn(t, p, "registered again during its predecessor's check", "http://r:1", Stale, "", SourceUnknown)
}
