// Package kubernetes holds the example deployment's manifests; its test
// keeps them from rotting: every manifest parses, the names that tie them
// together match, the routers' Caddyfiles adapt with this build of Caddy
// and the plugin, and the router that reads the Kubernetes API may read
// EndpointSlices and nothing else.
package kubernetes

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// object is one Kubernetes object of a manifest, as parsed YAML.
type object struct {
	file string
	doc  map[string]any
}

func (o object) kind() string { return str(o.doc, "kind") }
func (o object) name() string { return str(o.doc, "metadata", "name") }

// manifests parses every YAML document of every .yaml file here.
func manifests(t *testing.T) []object {
	t.Helper()
	files, err := filepath.Glob("*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests (%v)", err)
	}
	var objs []object
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		dec := yaml.NewDecoder(bytes.NewReader(data))
		for {
			var doc map[string]any
			err := dec.Decode(&doc)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatalf("%s: %v", f, err)
			}
			objs = append(objs, object{f, doc})
		}
	}
	return objs
}

// find returns the object of kind and name.
func find(t *testing.T, objs []object, kind, name string) object {
	t.Helper()
	for _, o := range objs {
		if o.kind() == kind && o.name() == name {
			return o
		}
	}
	t.Fatalf("no %s %q in the manifests", kind, name)
	return object{}
}

// at follows keys (strings into maps, ints into lists) through parsed YAML.
func at(v any, path ...any) any {
	for _, p := range path {
		switch k := p.(type) {
		case string:
			m, _ := v.(map[string]any)
			v = m[k]
		case int:
			l, _ := v.([]any)
			if k >= len(l) {
				return nil
			}
			v = l[k]
		}
	}
	return v
}

func str(v any, path ...any) string {
	s, _ := at(v, path...).(string)
	return s
}

// clusterScoped are the kinds of the manifests that belong to no namespace.
var clusterScoped = map[string]bool{"Namespace": true, "ClusterRole": true, "ClusterRoleBinding": true}

// singleRouters are the Deployments of one router each, router.yaml's
// (workers found through DNS) and router-api.yaml's (through the API).
var singleRouters = []string{"diffusion-router", "diffusion-router-api"}

func TestEveryManifestIsAnObject(t *testing.T) {
	for _, o := range manifests(t) {
		ns := str(o.doc, "metadata", "namespace")
		switch {
		case str(o.doc, "apiVersion") == "", o.kind() == "", o.name() == "":
			t.Errorf("%s: a document without apiVersion, kind or metadata.name: %v", o.file, o.doc)
		case clusterScoped[o.kind()] && ns != "":
			t.Errorf("%s: %s %s names namespace %q, but belongs to none", o.file, o.kind(), o.name(), ns)
		case !clusterScoped[o.kind()] && ns != "rollout":
			t.Errorf("%s: %s %s is not in namespace rollout, which the Caddyfile's names assume", o.file, o.kind(), o.name())
		}
	}
}

func TestRouterCaddyfileAdapts(t *testing.T) {
	objs := manifests(t)
	deploy := find(t, objs, "Deployment", "diffusion-router")
	caddyfile, cfg := adapt(t, objs, deploy)

	// The router looks up the SRV record of the workers' headless Service.
	svc := find(t, objs, "Service", str(find(t, objs, "StatefulSet", "diffusion-workers").doc, "spec", "serviceName"))
	if str(svc.doc, "spec", "clusterIP") != "None" {
		t.Error("the workers' Service is not headless: its DNS name would be one virtual IP, not the pods")
	}
	srv := "_" + str(svc.doc, "spec", "ports", 0, "name") + "._tcp." + svc.name() + ".rollout.svc.cluster.local"
	if got := at(handler(cfg, "diffusion_router"), "discovery", "srv"); !reflect.DeepEqual(got, []any{srv}) {
		t.Errorf("the router looks up SRV records %v; want the workers' SRV record, %s", got, srv)
	}

	// Its certificate comes from the Secret certificate.yaml fills, mounted
	// where the Caddyfile reads it.
	secret := str(find(t, objs, "Certificate", "diffusion-router").doc, "spec", "secretName")
	tls := volume(t, deploy, "tls")
	if str(tls, "secret", "secretName") != secret {
		t.Errorf("the router mounts Secret %q; the certificate is in %q", str(tls, "secret", "secretName"), secret)
	}
	dir := str(mount(t, deploy, "tls"), "mountPath")
	if !strings.Contains(caddyfile, "tls "+dir+"/tls.crt "+dir+"/tls.key") {
		t.Errorf("the Caddyfile does not read the certificate mounted at %s", dir)
	}
}

func TestProbesAndScrapeMatchTheRouter(t *testing.T) {
	objs := manifests(t)
	for _, name := range singleRouters {
		t.Run(name, func(t *testing.T) { routerProbesAndScrape(t, objs, find(t, objs, "Deployment", name)) })
	}

	worker := at(find(t, objs, "StatefulSet", "diffusion-workers").doc, "spec", "template", "spec", "containers", 0)
	for _, probe := range []string{"startupProbe", "readinessProbe", "livenessProbe"} {
		if got := str(worker, probe, "httpGet", "path"); got != "/health" {
			t.Errorf("worker %s probes %q; sglang-diffusion answers /health", probe, got)
		}
	}
}

// routerProbesAndScrape checks that a router's probes ask /healthz and
// /readyz over HTTPS, that the scrape annotations point at its metrics
// port, and that its Service targets a port it has.
func routerProbesAndScrape(t *testing.T, objs []object, deploy object) {
	c := at(deploy.doc, "spec", "template", "spec", "containers", 0)
	for probe, path := range map[string]string{"livenessProbe": "/healthz", "readinessProbe": "/readyz"} {
		if got := str(c, probe, "httpGet", "path"); got != path {
			t.Errorf("router %s probes %q; the router answers %s", probe, got, path)
		}
		if str(c, probe, "httpGet", "scheme") != "HTTPS" {
			t.Errorf("router %s is not HTTPS, which the router's site speaks", probe)
		}
	}
	ports := map[string]int{}
	for _, p := range at(c, "ports").([]any) {
		ports[str(p, "name")] = at(p, "containerPort").(int)
	}
	annotations := at(deploy.doc, "spec", "template", "metadata", "annotations")
	if str(annotations, "prometheus.io/scrape") != "true" || str(annotations, "prometheus.io/port") != "9180" || ports["metrics"] != 9180 {
		t.Errorf("the scrape annotations %v do not point at the metrics port %d", annotations, ports["metrics"])
	}
	if target := str(find(t, objs, "Service", deploy.name()).doc, "spec", "ports", 0, "targetPort"); ports[target] == 0 {
		t.Errorf("the router's Service targets port %q, which the container does not name", target)
	}
}

// TestRouterStorageOutlivesThePod checks that Caddy's storage, where each
// pool keeps its fleet record (diffusion_router/<pool>/fleet.json), is a
// persistent volume: a restarted router reads back the workers registered
// at run time, the ones held back and the weight version. The volume is
// mounted once at a time, and the pod's user may write it; each router
// has a claim of its own.
func TestRouterStorageOutlivesThePod(t *testing.T) {
	objs := manifests(t)
	claimedBy := map[string]string{}
	for _, name := range singleRouters {
		t.Run(name, func(t *testing.T) {
			claim := routerStorageOutlivesThePod(t, objs, find(t, objs, "Deployment", name))
			if other, ok := claimedBy[claim]; ok {
				t.Errorf("%s and %s both keep their storage on claim %s: two routers would write one record", other, name, claim)
			}
			claimedBy[claim] = name
		})
	}
}

// routerStorageOutlivesThePod checks one router's storage, as
// TestRouterStorageOutlivesThePod says, and returns the claim it is on.
func routerStorageOutlivesThePod(t *testing.T, objs []object, deploy object) (claim string) {
	spec := at(deploy.doc, "spec", "template", "spec")

	// Caddy's storage is the file system under $XDG_DATA_HOME/caddy, which
	// the Dockerfile sets (the Deployment may set it again).
	dataHome := dockerfileEnv(t, "XDG_DATA_HOME")
	env, _ := at(spec, "containers", 0, "env").([]any)
	for _, e := range env {
		if str(e, "name") == "XDG_DATA_HOME" {
			dataHome = str(e, "value")
		}
	}
	if dataHome == "" {
		t.Fatal("neither the Dockerfile nor the Deployment sets XDG_DATA_HOME: Caddy's storage would be under a home directory no volume holds")
	}
	mounts, _ := at(spec, "containers", 0, "volumeMounts").([]any)
	var holder any // the mount that holds the storage: the deepest one above it
	for _, m := range mounts {
		dir := strings.TrimSuffix(str(m, "mountPath"), "/")
		if dataHome == dir || strings.HasPrefix(dataHome, dir+"/") {
			if holder == nil || len(dir) > len(str(holder, "mountPath")) {
				holder = m
			}
		}
	}
	if holder == nil {
		t.Fatalf("no volume is mounted at Caddy's storage (%s/caddy): it would be in the container's file system", dataHome)
	}
	if b, _ := at(holder, "readOnly").(bool); b {
		t.Errorf("Caddy's storage (%s) is mounted read-only", dataHome)
	}
	vol := volume(t, deploy, str(holder, "name"))
	claim = str(vol, "persistentVolumeClaim", "claimName")
	if claim == "" {
		t.Fatalf("Caddy's storage (%s) is on volume %v, not a PersistentVolumeClaim: the fleet record would not outlive the pod", dataHome, vol)
	}
	pvc := find(t, objs, "PersistentVolumeClaim", claim)
	if str(pvc.doc, "spec", "resources", "requests", "storage") == "" {
		t.Errorf("PersistentVolumeClaim %s requests no storage size", claim)
	}

	// A ReadWriteOnce volume must never be wanted by two pods at once, and
	// two routers must never share one record: one replica, and the old pod
	// gone before the new one starts.
	if n, _ := at(deploy.doc, "spec", "replicas").(int); n != 1 {
		t.Errorf("the router has %d replicas; one fleet record is for one router", n)
	}
	modes, _ := at(pvc.doc, "spec", "accessModes").([]any)
	if len(modes) == 0 {
		t.Errorf("PersistentVolumeClaim %s names no access mode", claim)
	}
	if got := str(deploy.doc, "spec", "strategy", "type"); got != "Recreate" {
		t.Errorf("the router's Deployment updates with strategy %q; a rolling update would start a second router on the same volume and record (want Recreate)", got)
	}
	if at(spec, "securityContext", "fsGroup") == nil {
		t.Error("the pod sets no fsGroup: Caddy's user may not write the volume")
	}

	// The Caddyfile keeps the default storage and does not turn the record off.
	_, cfg := adapt(t, objs, deploy)
	if at(cfg, "storage") != nil {
		t.Error("the Caddyfile sets a storage of its own: check that it is kept across restarts, and this test")
	}
	if at(handler(cfg, "diffusion_router"), "persist_off") == true {
		t.Error("the Caddyfile turns persist off: nothing would be kept on the volume")
	}
	return claim
}

// dockerfileEnv returns the value the Dockerfile's ENV lines give name.
func dockerfileEnv(t *testing.T, name string) string {
	t.Helper()
	data, err := os.ReadFile("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	value := ""
	for line := range strings.Lines(string(data)) {
		fields := strings.Fields(line)
		if len(fields) < 2 || fields[0] != "ENV" {
			continue
		}
		for _, kv := range fields[1:] {
			if k, v, ok := strings.Cut(kv, "="); ok && k == name {
				value = v
			}
		}
	}
	return value
}

// volume returns the pod volume of the Deployment named name.
func volume(t *testing.T, deploy object, name string) any {
	t.Helper()
	vols, _ := at(deploy.doc, "spec", "template", "spec", "volumes").([]any)
	i := slices.IndexFunc(vols, func(v any) bool { return str(v, "name") == name })
	if i < 0 {
		t.Fatalf("%s has no volume %q", deploy.name(), name)
	}
	return vols[i]
}

// mount returns the first container's mount of the volume named name.
func mount(t *testing.T, deploy object, name string) any {
	t.Helper()
	mounts, _ := at(deploy.doc, "spec", "template", "spec", "containers", 0, "volumeMounts").([]any)
	i := slices.IndexFunc(mounts, func(m any) bool { return str(m, "name") == name })
	if i < 0 {
		t.Fatalf("%s does not mount volume %q", deploy.name(), name)
	}
	return mounts[i]
}

// TestAutoscalerScalesTheWorkersOnTheBacklog checks that the KEDA
// ScaledObject scales the workers' StatefulSet on the router's backlog
// gauge of the pool router.yaml serves, as a Value (the HPA multiplies
// the fleet by backlog / threshold), and never below one worker.
func TestAutoscalerScalesTheWorkersOnTheBacklog(t *testing.T) {
	objs := manifests(t)
	so := find(t, objs, "ScaledObject", "diffusion-workers")
	target := at(so.doc, "spec", "scaleTargetRef")
	workers := find(t, objs, str(target, "kind"), str(target, "name"))
	if workers.kind() != "StatefulSet" || str(target, "apiVersion") != str(workers.doc, "apiVersion") {
		t.Errorf("the autoscaler targets %v; want the workers' StatefulSet", target)
	}
	if least, _ := at(so.doc, "spec", "minReplicaCount").(int); least < 1 {
		t.Errorf("minReplicaCount %v: a fleet scaled to zero has no backlog to scale up on", least)
	}
	trigger := at(so.doc, "spec", "triggers", 0)
	query := str(trigger, "metadata", "query")
	if str(trigger, "type") != "prometheus" || str(trigger, "metricType") != "Value" {
		t.Errorf("trigger %v; want a prometheus trigger with metricType Value", trigger)
	}
	caddyfile := str(find(t, objs, "ConfigMap", "diffusion-router").doc, "data", "Caddyfile")
	if !strings.Contains(caddyfile, "diffusion_router {") {
		t.Error("the router's diffusion_router names a pool; the autoscaler reads the pool default")
	}
	if !strings.Contains(query, `caddy_diffusion_backlog_seconds{pool="default"}`) {
		t.Errorf("the autoscaler's query %q does not read the backlog of the router's pool, default", query)
	}
	if _, err := strconv.ParseFloat(str(trigger, "metadata", "threshold"), 64); err != nil {
		t.Errorf("threshold: %v", err)
	}
}

// TestHARoutersShareOneElection checks router-ha.yaml and etcd.yaml: two
// replicas whose readiness is /readyz (only the active router is ready),
// each advertising its pod's IP, pointed at every member of the etcd
// StatefulSet by the names its headless Service gives them, with a
// rollout that can end although a standby is never ready.
func TestHARoutersShareOneElection(t *testing.T) {
	objs := manifests(t)
	deploy := find(t, objs, "Deployment", "diffusion-router-ha")
	if n, _ := at(deploy.doc, "spec", "replicas").(int); n < 2 {
		t.Errorf("router-ha has %d replicas; a group needs a standby", n)
	}
	c := at(deploy.doc, "spec", "template", "spec", "containers", 0)
	if got := str(c, "readinessProbe", "httpGet", "path"); got != "/readyz" {
		t.Errorf("router-ha's readinessProbe is %q; /readyz keeps the standby out of the Service", got)
	}
	if got := str(c, "livenessProbe", "httpGet", "path"); got != "/healthz" {
		t.Errorf("router-ha's livenessProbe is %q; a standby is alive and must answer it (/healthz)", got)
	}
	podIP := false
	for _, e := range at(c, "env").([]any) {
		podIP = podIP || str(e, "name") == "POD_IP" && str(e, "valueFrom", "fieldRef", "fieldPath") == "status.podIP"
	}
	if !podIP {
		t.Error("router-ha sets no POD_IP from status.podIP, which its advertise names")
	}
	switch strategy := at(deploy.doc, "spec", "strategy"); {
	case str(strategy, "type") == "Recreate":
	case str(strategy, "rollingUpdate", "maxUnavailable") != "100%":
		t.Errorf("router-ha's strategy %v waits for new pods to be ready, which a standby never is: the rollout would never end", strategy)
	}

	_, cfg := adapt(t, objs, deploy)
	router := handler(cfg, "diffusion_router")
	advertise := str(router, "ha", "etcd", "advertise")
	var endpoints []string
	for _, e := range at(router, "ha", "etcd", "endpoints").([]any) {
		endpoints = append(endpoints, e.(string))
	}
	if !strings.Contains(advertise, "{env.POD_IP}") {
		t.Errorf("router-ha advertises %q; want the pod's own address, {env.POD_IP}", advertise)
	}

	etcd := find(t, objs, "StatefulSet", "etcd")
	svc := find(t, objs, "Service", str(etcd.doc, "spec", "serviceName"))
	if str(svc.doc, "spec", "clusterIP") != "None" {
		t.Error("etcd's Service is not headless: its members would have no names of their own")
	}
	var clientPort int
	for _, p := range at(etcd.doc, "spec", "template", "spec", "containers", 0, "ports").([]any) {
		if str(p, "name") == "client" {
			clientPort, _ = at(p, "containerPort").(int)
		}
	}
	var want []string
	members, _ := at(etcd.doc, "spec", "replicas").(int)
	for i := range members {
		want = append(want, "http://"+etcd.name()+"-"+strconv.Itoa(i)+"."+svc.name()+".rollout.svc.cluster.local:"+strconv.Itoa(clientPort))
	}
	if !slices.Equal(endpoints, want) {
		t.Errorf("router-ha's etcd endpoints are %v; want every member of the etcd StatefulSet, %v", endpoints, want)
	}
}

// handler finds the first handler of the given name in an adapted config.
func handler(v any, name string) map[string]any {
	switch v := v.(type) {
	case map[string]any:
		if v["handler"] == name {
			return v
		}
		for _, x := range v {
			if h := handler(x, name); h != nil {
				return h
			}
		}
	case []any:
		for _, x := range v {
			if h := handler(x, name); h != nil {
				return h
			}
		}
	}
	return nil
}

// adapt adapts the Caddyfile that deploy mounts from its ConfigMap with
// this build, and returns its text and the adapted config, which has a
// diffusion_router handler.
func adapt(t *testing.T, objs []object, deploy object) (caddyfile string, cfg any) {
	t.Helper()
	cm := find(t, objs, "ConfigMap", str(volume(t, deploy, "caddyfile"), "configMap", "name"))
	caddyfile = str(cm.doc, "data", "Caddyfile")
	adapted, warnings, err := testrouter.Adapt([]byte(caddyfile), cm.file+":Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range warnings {
		t.Errorf("caddy adapt warns: %s", w)
	}
	if err := json.Unmarshal(adapted, &cfg); err != nil {
		t.Fatal(err)
	}
	if handler(cfg, "diffusion_router") == nil {
		t.Fatalf("%s's Caddyfile has no diffusion_router handler", deploy.name())
	}
	return caddyfile, cfg
}

// TestAPIRouterFollowsTheWorkersService checks router-api.yaml against
// workers-api.yaml: the router follows, through the API and through
// nothing else, the EndpointSlices of an ordinary Service that selects
// the workers' pods, at a port that Service has, in the namespace it is in,
// as a ServiceAccount whose token reaches the pod.
func TestAPIRouterFollowsTheWorkersService(t *testing.T) {
	objs := manifests(t)
	deploy := find(t, objs, "Deployment", "diffusion-router-api")
	_, cfg := adapt(t, objs, deploy)
	discovery := at(handler(cfg, "diffusion_router"), "discovery")
	if at(discovery, "a") != nil || at(discovery, "srv") != nil {
		t.Errorf("router-api also looks workers up in DNS: %v", discovery)
	}
	lookups, _ := at(discovery, "kubernetes").([]any)
	if len(lookups) != 1 {
		t.Fatalf("router-api has %d workers_kubernetes lookups; want one, of the workers' Service: %v", len(lookups), discovery)
	}
	lookup := lookups[0]

	svc := find(t, objs, "Service", str(lookup, "service"))
	if ns := str(lookup, "namespace"); ns != str(svc.doc, "metadata", "namespace") {
		t.Errorf("router-api watches namespace %q; Service %s is in %q", ns, svc.name(), str(svc.doc, "metadata", "namespace"))
	}
	if str(svc.doc, "spec", "clusterIP") == "None" || str(svc.doc, "spec", "type") == "ExternalName" {
		t.Errorf("Service %s is headless or an ExternalName; the API variant follows an ordinary Service", svc.name())
	}
	pods := at(find(t, objs, "StatefulSet", "diffusion-workers").doc, "spec", "template")
	selector, _ := at(svc.doc, "spec", "selector").(map[string]any)
	for k, v := range selector {
		if str(pods, "metadata", "labels", k) != v {
			t.Errorf("Service %s selects %s=%v, which the workers' pods are not labelled", svc.name(), k, v)
		}
	}
	if len(selector) == 0 {
		t.Errorf("Service %s selects no pods: it would have no EndpointSlices of its own", svc.name())
	}
	port := str(lookup, "port")
	var workerPorts []string
	for _, p := range at(pods, "spec", "containers", 0, "ports").([]any) {
		workerPorts = append(workerPorts, str(p, "name"))
	}
	ports, _ := at(svc.doc, "spec", "ports").([]any)
	i := slices.IndexFunc(ports, func(p any) bool { return str(p, "name") == port })
	switch {
	case i < 0:
		t.Errorf("router-api reads the slices' port %q, which Service %s does not name", port, svc.name())
	case !slices.Contains(workerPorts, str(ports[i], "targetPort")):
		t.Errorf("Service %s's port %s targets %v, which the workers' container does not name (%v)", svc.name(), port, at(ports[i], "targetPort"), workerPorts)
	}

	sa := find(t, objs, "ServiceAccount", str(deploy.doc, "spec", "template", "spec", "serviceAccountName"))
	if at(sa.doc, "automountServiceAccountToken") == false || at(deploy.doc, "spec", "template", "spec", "automountServiceAccountToken") == false {
		t.Errorf("router-api's ServiceAccount token is not mounted: the in-cluster client has nothing to read the API with")
	}
}

// endpointSliceReader is all a role bound to the router may grant: what
// an informer of EndpointSlices reads, group/resource:verb.
var endpointSliceReader = []string{
	"discovery.k8s.io/endpointslices:get",
	"discovery.k8s.io/endpointslices:list",
	"discovery.k8s.io/endpointslices:watch",
}

// TestRouterReadsOnlyEndpointSlices checks rbac.yaml and
// rbac-cluster.yaml: router-api's ServiceAccount is bound, in the
// namespace its Caddyfile watches (a Role) and across the cluster (the
// ClusterRole form), to roles that grant get, list and watch on
// EndpointSlices and nothing else; no binding gives it anything more.
func TestRouterReadsOnlyEndpointSlices(t *testing.T) {
	objs := manifests(t)
	deploy := find(t, objs, "Deployment", "diffusion-router-api")
	sa := find(t, objs, "ServiceAccount", str(deploy.doc, "spec", "template", "spec", "serviceAccountName"))
	_, cfg := adapt(t, objs, deploy)
	watched := str(handler(cfg, "diffusion_router"), "discovery", "kubernetes", 0, "namespace")

	boundIn := map[string]bool{} // namespaces where a RoleBinding binds the ServiceAccount
	boundCluster := false
	for _, b := range objs {
		if (b.kind() != "RoleBinding" && b.kind() != "ClusterRoleBinding") || !bindsServiceAccount(b, sa) {
			continue
		}
		ns := str(b.doc, "metadata", "namespace")
		boundIn[ns] = boundIn[ns] || b.kind() == "RoleBinding"
		boundCluster = boundCluster || b.kind() == "ClusterRoleBinding"
		ref := at(b.doc, "roleRef")
		if str(ref, "apiGroup") != "rbac.authorization.k8s.io" {
			t.Errorf("%s %s refers to a role in group %q", b.kind(), b.name(), str(ref, "apiGroup"))
		}
		role := find(t, objs, str(ref, "kind"), str(ref, "name"))
		if role.kind() == "Role" && str(role.doc, "metadata", "namespace") != ns {
			t.Errorf("%s %s in %q binds Role %s of namespace %q, which grants nothing there", b.kind(), b.name(), ns, role.name(), str(role.doc, "metadata", "namespace"))
		}
		if got := grants(role); !slices.Equal(got, endpointSliceReader) {
			t.Errorf("%s %s grants the router %v; want exactly %v", role.kind(), role.name(), got, endpointSliceReader)
		}
	}
	if !boundIn[watched] {
		t.Errorf("no RoleBinding in namespace %q, which router-api watches, binds ServiceAccount %s", watched, sa.name())
	}
	if !boundCluster {
		t.Errorf("no ClusterRoleBinding binds ServiceAccount %s: the form for watching every namespace is missing", sa.name())
	}
}

// bindsServiceAccount reports whether binding b names sa among its subjects.
func bindsServiceAccount(b, sa object) bool {
	subjects, _ := at(b.doc, "subjects").([]any)
	return slices.ContainsFunc(subjects, func(s any) bool {
		return str(s, "kind") == "ServiceAccount" && str(s, "name") == sa.name() &&
			str(s, "namespace") == str(sa.doc, "metadata", "namespace")
	})
}

// grants lists, sorted, what a Role or ClusterRole allows as
// group/resource:verb, and anything that narrows or widens its rules
// (resource names, non-resource URLs, aggregation) as an entry of its own.
func grants(role object) []string {
	var got []string
	if at(role.doc, "aggregationRule") != nil {
		got = append(got, "aggregationRule")
	}
	rules, _ := at(role.doc, "rules").([]any)
	for _, r := range rules {
		for _, extra := range []string{"resourceNames", "nonResourceURLs"} {
			if at(r, extra) != nil {
				got = append(got, extra)
			}
		}
		for _, g := range strs(r, "apiGroups") {
			for _, res := range strs(r, "resources") {
				for _, v := range strs(r, "verbs") {
					got = append(got, g+"/"+res+":"+v)
				}
			}
		}
	}
	slices.Sort(got)
	return got
}

// strs returns the list of strings at key of a parsed YAML map.
func strs(v any, key string) []string {
	var out []string
	l, _ := at(v, key).([]any)
	for _, s := range l {
		out = append(out, fmt.Sprint(s))
	}
	return out
}

// TestCertificateNamesEveryRouter checks that the certificate names each
// router's Service, which is also the name the router's Caddyfile serves
// to clients that send none (default_sni), the kubelet's probes among them.
func TestCertificateNamesEveryRouter(t *testing.T) {
	objs := manifests(t)
	names := strs(at(find(t, objs, "Certificate", "diffusion-router").doc, "spec"), "dnsNames")
	for _, name := range append(singleRouters, "diffusion-router-ha") {
		caddyfile, _ := adapt(t, objs, find(t, objs, "Deployment", name))
		find(t, objs, "Service", name) // the router's Service, named as its Deployment
		host := name + ".rollout.svc.cluster.local"
		if !strings.Contains(caddyfile, "default_sni "+host+"\n") {
			t.Errorf("%s's Caddyfile does not serve %s as its default_sni", name, host)
		}
		if !slices.Contains(names, host) {
			t.Errorf("the certificate does not name %s, %s's Service (it names %v)", host, name, names)
		}
	}
}
