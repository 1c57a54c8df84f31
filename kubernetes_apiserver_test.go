package diffusionrouter_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
	discoveryv1 "k8s.io/api/discovery/v1"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/etcdtest"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/kubeapiserver"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/netns"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// Workers found through the real Kubernetes API server, on Debian's etcd,
// with the router reading it as the example's service account, which
// examples/kubernetes/rbac.yaml's Role alone lets read anything. No
// controller runs: the test writes the EndpointSlices as the EndpointSlice
// controller would. The API server refuses loopback endpoints, so
// everything runs in a network namespace of the test's own (netns), whose
// lo carries the API server's address and the workers': nothing outside
// it ever dials them.

// The addresses of the namespace: the API server advertises the first,
// and each fake worker listens on one of the others, as a pod does.
var (
	apiServerAddress = "10.251.0.1"
	podAddresses     = []string{"10.251.0.2", "10.251.0.3", "10.251.0.4"}
)

// rollout is the namespace of the example's Role, and of the slices.
const rollout = "rollout"

func TestWorkersFollowTheRealAPIServer(t *testing.T) {
	bin := kubeapiserver.Binary(t)
	etcdtest.Require(t)
	t.Setenv("KUBE_APISERVER", bin) // the run inside finds it whatever its HOME
	if !netns.Enter(t, append([]string{apiServerAddress}, podAddresses...)...) {
		return
	}
	start := time.Now()
	etcd := etcdtest.Start(t)
	api := kubeapiserver.Start(t, bin, etcd.Endpoint, apiServerAddress)
	t.Logf("etcd and kube-apiserver %s ready in %s", kubeapiserver.Version, time.Since(start).Round(time.Millisecond))
	user, token := routerAccount(t, api)
	store := &realSlices{t: t, api: api}
	ws := podWorkers(t, "a", "b", "c")
	a, b, c := ws[0], ws[1], ws[2]
	r := testrouter.Start(t, kubeSite(rollout, api.Kubeconfig(t, token)))

	conditionsFollowed(t, r, store, rollout, a, b)
	b2 := podReplaced(t, r, store, b)
	restartFollowed(t, r, store, api, etcd, user, b2, c)
	roleGrantsNoMore(t, api, token)
	t.Logf("done in %s", time.Since(start).Round(time.Millisecond))
}

// podWorkers starts a fake worker named after each name on port 30000 of
// an address of podAddresses, in order, as the pods of Service engines.
func podWorkers(t *testing.T, names ...string) []*fakeworker.Worker {
	t.Helper()
	cfgs := make([]fakeworker.Config, len(names))
	for i, name := range names {
		cfgs[i] = fakeworker.Config{Name: name, Addr: podAddresses[i] + ":30000"}
	}
	return testrouter.StartWorkers(t, cfgs...)
}

// A pod replaced at one address (a new uid) is a new worker: it was not
// on the fleet's weights and is brought to them before its first job,
// as a late joiner is. b is ready again; a has left.
func podReplaced(t *testing.T, r *testrouter.Router, store sliceStore, b *fakeworker.Worker) *fakeworker.Worker {
	t.Helper()
	store.Apply(workerSlice(t, rollout, b, "b", ready))
	testrouter.WaitFor(t, func() bool { return r.Workers()[b.URL()]["state"] == "serving" })
	rp := r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/1","weight_version":"step-1"}`)
	testrouter.ExpectStatus(t, "update", rp, 200)

	cfg := b.Config()
	cfg.Name = "b2"
	b.Close()
	b2 := testrouter.StartWorkers(t, cfg)[0] // the new pod's server, on the old weights
	host, port := hostPort(t, b2.URL())      // its endpoint takes the old pod's place in the slice, as the EndpointSlice controller does
	store.Apply(engineSlice(rollout, "engines-b", port, podEndpoint(rollout, host, "engine-b2", "b2", ready)))
	testrouter.WaitFor(t, func() bool { return r.Workers()[b2.URL()]["pod"] == "engine-b2" })
	for range 4 {
		rp := r.Post("/v1/images/generations", testrouter.SmallImage)
		testrouter.ExpectStatus(t, "job on the new pod", rp, 200)
		if by, v := rp.Header.Get("X-Fake-Worker"), rp.Header.Get(weightVersionHeader); by != "b2" || v != "step-1" {
			t.Fatalf("job served by %s on weights %q; want b2 on step-1", by, v)
		}
	}
	if b2.Weights() != "/ckpt/1" || b2.Stats().JobsOn[cfg.ModelPath] != 0 {
		t.Fatalf("the new pod is on %q, served jobs on %v; want the fleet's /ckpt/1 before any job", b2.Weights(), b2.Stats().JobsOn)
	}
	return b2
}

// The API server stopped keeps the workers (discovery_synced 0); etcd's
// history compacted meanwhile past every revision the router has seen,
// so that the restarted API server refuses its watch (410 Gone); the
// router lists again, never emptying the pool, is in sync again, and
// follows the changes made after.
func restartFollowed(t *testing.T, r *testrouter.Router, store sliceStore, api *kubeapiserver.Server, etcd *etcdtest.Server, user string, b2, c *fakeworker.Worker) {
	t.Helper()
	kept := func() bool {
		if _, ok := r.Workers()[b2.URL()]; !ok {
			t.Fatal("the pool lost its worker while the API server was away")
		}
		return true
	}
	api.Stop()
	testrouter.WaitFor(t, func() bool { return kept() && kubeSynced(t, r) == 0 })
	jobsServedBy(t, r, 3, "b2")
	if err := etcd.Compact(); err != nil {
		t.Fatal(err)
	}
	before := len(api.Requests(t, user))
	api.Restart(t)
	testrouter.WaitFor(t, func() bool { return kept() && kubeSynced(t, r) == 1 })
	jobsServedBy(t, r, 3, "b2")
	after := api.Requests(t, user)[before:]
	if !resumedThenListed(after) {
		t.Fatalf("after the restart the router sent %+v; want a watch from where it was, then a new list", after)
	}

	store.Apply(workerSlice(t, rollout, c, "c", ready))
	waitForWorkers(t, r, b2.URL(), c.URL())
}

// resumedThenListed says whether reqs hold a watch from a resource
// version the router had seen, followed by a list (a plain list, or a
// watch that streams the list first).
func resumedThenListed(reqs []kubeapiserver.Request) bool {
	resumed := false
	for _, req := range reqs {
		listing := req.Verb == "list" || strings.Contains(req.RequestURI, "sendInitialEvents=true")
		if resumed && listing {
			return true
		}
		resumed = resumed || req.Verb == "watch" && !listing && strings.Contains(req.RequestURI, "resourceVersion=")
	}
	return false
}

// The example's Role grants the router what it reads, the EndpointSlices
// of its namespace, and no more: not another namespace's, not every
// namespace's, not the pods or secrets, and no write.
func roleGrantsNoMore(t *testing.T, api *kubeapiserver.Server, token string) {
	t.Helper()
	for _, c := range []struct {
		method, path string
		body         any
		want         int
	}{
		{"GET", slicesPath, nil, 200},
		{"GET", slicesPath + "/engines-c", nil, 200},
		{"GET", "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices", nil, 403},
		{"GET", "/apis/discovery.k8s.io/v1/endpointslices", nil, 403},
		{"GET", "/api/v1/namespaces/" + rollout + "/pods", nil, 403},
		{"GET", "/api/v1/namespaces/" + rollout + "/services", nil, 403},
		{"GET", "/api/v1/namespaces/" + rollout + "/secrets", nil, 403},
		{"POST", slicesPath, sliceNamed("engines-x"), 403},
		{"DELETE", slicesPath + "/engines-c", nil, 403},
	} {
		if status, body := api.Do(t, token, c.method, c.path, c.body); status != c.want {
			t.Errorf("the router's account: %s %s answered %d %.200s; want %d", c.method, c.path, status, body, c.want)
		}
	}
}

// sliceNamed is an empty slice of Service engines.
func sliceNamed(name string) *discoveryv1.EndpointSlice {
	s := &discoveryv1.EndpointSlice{AddressType: discoveryv1.AddressTypeIPv4}
	s.APIVersion, s.Kind = "discovery.k8s.io/v1", "EndpointSlice"
	s.Name, s.Labels = name, map[string]string{discoveryv1.LabelServiceName: "engines"}
	return s
}

// routerAccount makes the namespace rollout, applies the example's Role
// and RoleBinding (examples/kubernetes/rbac.yaml) as they are, makes the
// service account the binding names, and returns its user name and a
// token of it: a user that has the Role and nothing else.
func routerAccount(t *testing.T, api *kubeapiserver.Server) (user, token string) {
	t.Helper()
	api.Must(t, 201, "POST", "/api/v1/namespaces", map[string]any{"metadata": map[string]any{"name": rollout}})
	account := ""
	for _, doc := range manifests(t, "examples/kubernetes/rbac.yaml") {
		meta := doc["metadata"].(map[string]any)
		kind := map[string]string{"Role": "roles", "RoleBinding": "rolebindings"}[doc["kind"].(string)]
		if kind == "" || meta["namespace"] != rollout {
			t.Fatalf("rbac.yaml has a %v in %v; this test applies a Role and its binding in %s", doc["kind"], meta["namespace"], rollout)
		}
		api.Must(t, 201, "POST", "/apis/rbac.authorization.k8s.io/v1/namespaces/"+rollout+"/"+kind, doc)
		if subjects, ok := doc["subjects"].([]any); ok {
			account = subjects[0].(map[string]any)["name"].(string)
		}
	}
	accounts := "/api/v1/namespaces/" + rollout + "/serviceaccounts"
	api.Must(t, 201, "POST", accounts, map[string]any{"metadata": map[string]any{"name": account}})
	raw := api.Must(t, 201, "POST", accounts+"/"+account+"/token", map[string]any{
		"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": map[string]any{"expirationSeconds": 3600}})
	var tr struct {
		Status struct {
			Token string `json:"token"`
		} `json:"status"`
	}
	if err := json.Unmarshal(raw, &tr); err != nil || tr.Status.Token == "" {
		t.Fatalf("token request answered %s (%v)", raw, err)
	}
	return "system:serviceaccount:" + rollout + ":" + account, tr.Status.Token
}

// manifests reads the YAML documents of path.
func manifests(t *testing.T, path string) []map[string]any {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var docs []map[string]any
	dec := yaml.NewDecoder(bytes.NewReader(raw))
	for {
		var doc map[string]any
		err := dec.Decode(&doc)
		if errors.Is(err, io.EOF) {
			return docs
		}
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		docs = append(docs, doc)
	}
}

// realSlices keeps the slices in the real API server, written as the
// EndpointSlice controller writes them, as a user in system:masters.
type realSlices struct {
	t   *testing.T
	api *kubeapiserver.Server
}

// slicesPath is the API's path of the slices of namespace rollout.
const slicesPath = "/apis/discovery.k8s.io/v1/namespaces/" + rollout + "/endpointslices"

// Apply creates the slice, or replaces the one of its name.
func (s *realSlices) Apply(slice *discoveryv1.EndpointSlice) {
	s.t.Helper()
	status, body := s.api.Do(s.t, s.api.AdminToken, "POST", slicesPath, slice)
	if status == http.StatusConflict {
		status, body = s.api.Do(s.t, s.api.AdminToken, "PUT", slicesPath+"/"+slice.Name, slice)
	}
	if status != http.StatusCreated && status != http.StatusOK {
		s.t.Fatalf("writing slice %s: %d %s", slice.Name, status, body)
	}
}

// Delete deletes the slice named name.
func (s *realSlices) Delete(name string) {
	s.t.Helper()
	s.api.Must(s.t, 200, "DELETE", slicesPath+"/"+name, nil)
}
