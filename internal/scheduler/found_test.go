package scheduler

import (
	"context"
	"slices"
	"testing"
)

// kubePool is a pool whose workers a Kubernetes lookup found, each ready.
func kubePool(t *testing.T, uids ...string) *Pool {
	t.Helper()
	p, _ := poolOf(t, 0)
	p.DeclareLookups("kubernetes", []string{"k8s"})
	p.SetFound("k8s", endpoints(uids, EndpointReady), 10)
	for _, u := range p.URLs() {
		p.RecordProbe(u, nil, testHealth)
	}
	return p
}

// endpoints are the workers http://<uid>:1, of pods named for their uid,
// each in condition c.
func endpoints(uids []string, c Condition) []Found {
	out := make([]Found, len(uids))
	for i, uid := range uids {
		out[i] = Found{URL: "http://" + uid + ":1", Source: "kubernetes", Namespace: "prod", Pod: uid, Identity: uid, Condition: c}
	}
	return out
}

// A terminating worker takes a job only when no worker that is not
// terminating would, as kube-proxy sends traffic to terminating
// endpoints only when no ready one exists; one not ready takes none and
// stays in the pool.
func TestFoundWorkersFollowTheirEndpointsConditions(t *testing.T) {
	p := kubePool(t, "a", "b")
	cfg := config(LeastWork{}, 0)
	found := append(endpoints([]string{"a"}, EndpointTerminating), endpoints([]string{"b"}, EndpointReady)...)
	p.SetFound("k8s", found, 10)
	isOn(t, p, "terminating", "http://a:1", Terminating, "", "")
	for range 3 {
		if _, host := choose(t, p, cfg, 1); host != "b" {
			t.Fatalf("a job went to %s beside a ready worker; want b", host)
		}
	}
	p.SetFound("k8s", append(endpoints([]string{"a"}, EndpointTerminating), endpoints([]string{"b"}, EndpointNotReady)...), 10)
	isOn(t, p, "not ready", "http://b:1", NotReady, "", "")
	if _, host := choose(t, p, cfg, 1); host != "a" {
		t.Fatalf("with no ready worker a job went to %s; want the terminating a", host)
	}
	if got := workerURLs(p); !slices.Equal(got, []string{"http://a:1", "http://b:1"}) {
		t.Fatalf("workers: %v; want both kept", got)
	}
	if info := infoOf(t, p, "http://a:1"); info.Source != "kubernetes" {
		t.Errorf("a's source: %q; want kubernetes", info.Source)
	}
}

// A pod replaced at the same address (another uid) is a new worker: out
// until a probe passes, its model read again, and brought to the fleet's
// weights before its first job, as a late joiner is.
func TestAPodReplacedAtItsAddressIsANewWorker(t *testing.T) {
	p := kubePool(t, "a")
	p.SetCapabilities("http://a:1", []string{"T2I"}, "/ckpt/base")
	applyUpdate(p, DiskUpdatePath, "step-1", `{"model_path":"/ckpt/1"}`)
	replaced := Found{URL: "http://a:1", Source: "kubernetes", Namespace: "prod", Pod: "a-2", Identity: "a-2"}
	p.SetFound("k8s", []Found{replaced}, 10)
	info := infoOf(t, p, "http://a:1")
	if info.State != Stale && info.State != Unhealthy || info.TaskTypes != nil || info.Version != "" {
		t.Fatalf("the replaced pod's worker: %s on %q, tasks %v; want out, its model and weights unknown", info.State, info.Version, info.TaskTypes)
	}
	p.RecordProbe("http://a:1", nil, testHealth)
	if got := p.TakeBehind(); !slices.Equal(got, []string{"http://a:1"}) {
		t.Fatalf("catch-ups due: %v; want the new pod's", got)
	}
}

// An endpoint gone takes no new job; a job it runs finishes, and then it
// leaves the pool.
func TestAWorkerWhoseEndpointIsGoneFinishesItsJobs(t *testing.T) {
	p := kubePool(t, "a", "b")
	cfg := config(LeastWork{}, 1)
	tk, host := choose(t, p, cfg, 1)
	gone := map[string]string{"a": "b", "b": "a"}[host]
	p.SetFound("k8s", endpoints([]string{gone}, EndpointReady), 10)
	if got := workerURLs(p); !slices.Equal(got, []string{"http://" + gone + ":1"}) {
		t.Fatalf("workers after %s's endpoint went: %v", host, got)
	}
	next := &Ticket{pool: p, cfg: cfg, Request: Request{Job: true, Cost: 1}}
	if err := p.Acquire(context.Background(), next); err != nil || next.worker.dial[:1] != gone {
		t.Fatalf("the next job went to %v (%v); want %s", next.worker, err, gone)
	}
	p.Release(tk, End{Worker: Succeeded}) // the job on the worker that left ends
	p.Release(next, End{Worker: Succeeded})
}

// A worker a config lists and a lookup found is kept when the lookup no
// longer names it, with none of the lookup's conditions.
func TestAListedWorkerForgetsItsEndpoint(t *testing.T) {
	p := kubePool(t, "a")
	p.Declare([]string{"http://a:1"})
	p.SetFound("k8s", endpoints([]string{"a"}, EndpointNotReady), 10)
	p.SetFound("k8s", nil, 10)
	isOn(t, p, "listed, no longer found", "http://a:1", Serving, "", "")
	if info := infoOf(t, p, "http://a:1"); info.Source != "config" {
		t.Errorf("source %q; want config", info.Source)
	}
}

// With room for fewer workers than the slices name, the pool takes the
// ready endpoints first, as kube-proxy sends to them first: not ready
// ones (a crash-looping rollout) do not keep a ready one out.
func TestMaxWorkersPrefersReadyEndpoints(t *testing.T) {
	p, _ := poolOf(t, 0)
	p.DeclareLookups("kubernetes", []string{"k8s"})
	found := append(endpoints([]string{"a", "b"}, EndpointNotReady), endpoints([]string{"c"}, EndpointReady)...)
	c := p.SetFound("k8s", found, 2)
	if c.NoRoom != 1 {
		t.Fatalf("left out %d; want 1", c.NoRoom)
	}
	if _, ok := p.Worker("http://c:1"); !ok {
		t.Fatalf("workers %v: the one ready endpoint was left out for two not ready ones", workerURLs(p))
	}
}

// A pod replaced at its address while the old pod's worker still has a
// job in flight (it left the slice and is departing) is a new worker all
// the same: out until probed, its model and weights read anew.
func TestAPodReplacedWhileItsOldJobRunsIsANewWorker(t *testing.T) {
	p := kubePool(t, "a")
	p.SetCapabilities("http://a:1", []string{"T2I"}, "/ckpt/base")
	applyUpdate(p, DiskUpdatePath, "step-1", `{"model_path":"/ckpt/1"}`)
	tk, _ := choose(t, p, config(LeastWork{}, 0), 1) // a job on the old pod, still running
	p.SetFound("k8s", nil, 10)                       // the old pod's endpoint is gone
	replaced := Found{URL: "http://a:1", Source: "kubernetes", Namespace: "prod", Pod: "a-2", Identity: "a-2"}
	p.SetFound("k8s", []Found{replaced}, 10)
	info := infoOf(t, p, "http://a:1")
	if info.State == Serving || info.TaskTypes != nil || info.Version != "" {
		t.Errorf("the new pod's worker: %s on %q, tasks %v; want out, its model and weights unknown", info.State, info.Version, info.TaskTypes)
	}
	p.Release(tk, End{Worker: Succeeded})
}

// A pool whose workers are all terminating still serves, the last
// resort, and says so: ServingCount, which /readyz and
// caddy_diffusion_serving_workers read, counts them.
func TestTerminatingLastResortCountsAsServing(t *testing.T) {
	p := kubePool(t, "a")
	p.SetFound("k8s", endpoints([]string{"a"}, EndpointTerminating), 10)
	tk, host := choose(t, p, config(LeastWork{}, 0), 1)
	defer p.Release(tk, End{Worker: Succeeded})
	if host != "a" {
		t.Fatalf("job went to %s", host)
	}
	if n := p.ServingCount(); n == 0 {
		t.Errorf("ServingCount 0 while the terminating a takes every job")
	}
}

// A pod replaced at its address is a new worker: a trainer's pause and an
// operator's hold of the process that is gone do not carry over, as they
// do not to a worker that leaves and is registered again.
func TestAReplacedPodIsNotPausedOrDeadAsTheOldOne(t *testing.T) {
	p := kubePool(t, "a", "b")
	if _, _, err := p.PauseWorkers([]string{"http://a:1"}); err != nil {
		t.Fatal(err)
	}
	p.SetDead("http://b:1", true)
	p.SetFound("k8s", endpoints([]string{"a", "b"}, EndpointReady), 10)
	replaced := []Found{
		{URL: "http://a:1", Source: "kubernetes", Namespace: "prod", Pod: "a-2", Identity: "a-2"},
		{URL: "http://b:1", Source: "kubernetes", Namespace: "prod", Pod: "b-2", Identity: "b-2"},
	}
	p.SetFound("k8s", replaced, 10)
	for _, u := range []string{"http://a:1", "http://b:1"} {
		p.RecordProbe(u, nil, testHealth)
		p.SetCapabilities(u, []string{"T2I"}, "/ckpt/base")
	}
	for _, u := range []string{"http://a:1", "http://b:1"} {
		if info := infoOf(t, p, u); info.State != Serving {
			t.Errorf("%s, a new pod probed: %s (paused since %v); want serving", u, info.State, info.PausedSince)
		}
	}
}
