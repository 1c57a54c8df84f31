package kubediscovery

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"go.uber.org/zap"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
)

// apiServer answers the EndpointSlice requests of one namespace as the
// API server does, in JSON: a list, a watch, and a watch that streams the
// list first (sendInitialEvents) and ends it with a bookmark.
type apiServer struct {
	t      *testing.T
	slices []*discoveryv1.EndpointSlice
	events chan watch.Event

	mu       sync.Mutex
	requests []*http.Request
}

func (a *apiServer) ServeHTTP(rw http.ResponseWriter, r *http.Request) {
	a.mu.Lock()
	a.requests = append(a.requests, r)
	a.mu.Unlock()
	if r.URL.Path != "/apis/discovery.k8s.io/v1/namespaces/prod/endpointslices" {
		http.NotFound(rw, r)
		return
	}
	rw.Header().Set("Content-Type", "application/json")
	q := r.URL.Query()
	if q.Get("watch") != "true" {
		list := discoveryv1.EndpointSliceList{ListMeta: metav1.ListMeta{ResourceVersion: "1"}}
		for _, s := range a.slices {
			list.Items = append(list.Items, *s)
		}
		a.write(rw, list)
		return
	}
	if q.Get("sendInitialEvents") == "true" {
		for _, s := range a.slices {
			a.send(rw, watch.Added, s)
		}
		end := &discoveryv1.EndpointSlice{ObjectMeta: metav1.ObjectMeta{
			ResourceVersion: "1", Annotations: map[string]string{metav1.InitialEventsAnnotationKey: "true"}}}
		a.send(rw, watch.Bookmark, end)
	}
	rw.(http.Flusher).Flush()
	for {
		select {
		case ev := <-a.events:
			a.send(rw, ev.Type, ev.Object.(*discoveryv1.EndpointSlice))
		case <-r.Context().Done():
			return
		}
	}
}

// send writes one watch event and flushes it.
func (a *apiServer) send(rw http.ResponseWriter, typ watch.EventType, s *discoveryv1.EndpointSlice) {
	s = s.DeepCopy()
	s.APIVersion, s.Kind = "discovery.k8s.io/v1", "EndpointSlice"
	a.write(rw, metav1.WatchEvent{Type: string(typ), Object: runtime.RawExtension{Object: s}})
	rw.(http.Flusher).Flush()
}

func (a *apiServer) write(rw http.ResponseWriter, v any) {
	if err := json.NewEncoder(rw).Encode(v); err != nil {
		a.t.Log(err)
	}
}

// Watch with a kubeconfig reaches the API server through this package's
// own REST client: the slices' path in the namespace, the Service's label
// selector, the kubeconfig's token over TLS, the router's user agent; the
// list streamed by the first watch arrives as the set, and a watch event
// changes it.
func TestWatchThroughKubeconfig(t *testing.T) {
	s := sliceOf("prod", "engines-a", "engines", http30000, podAt("10.0.0.1", "prod", "engine-a"))
	s.ResourceVersion = "1"
	server := &apiServer{t: t, slices: []*discoveryv1.EndpointSlice{s}, events: make(chan watch.Event, 1)}
	ts := httptest.NewTLSServer(server)
	defer ts.Close()
	ca := base64.StdEncoding.EncodeToString(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ts.Certificate().Raw}))
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(kubeconfig, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "`+ts.URL+`", certificate-authority-data: "`+ca+`"}}]
users: [{name: u, user: {token: secret}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
`), 0o600); err != nil {
		t.Fatal(err)
	}

	w, stop := follow(t, func(ctx context.Context, log *zap.Logger, w *watcher) error {
		return Watch(ctx, Config{Namespace: "prod", Service: "engines", Kubeconfig: kubeconfig}, log, w.update, w.synced)
	})
	defer stop()
	w.waitKeys("uid-engine-a")
	w.waitSynced(true)

	changed := s.DeepCopy()
	changed.ResourceVersion = "2"
	changed.Endpoints = append(changed.Endpoints, podAt("10.0.0.2", "prod", "engine-b"))
	server.events <- watch.Event{Type: watch.Modified, Object: changed}
	w.waitKeys("uid-engine-a", "uid-engine-b")

	server.mu.Lock()
	defer server.mu.Unlock()
	for _, r := range server.requests {
		if got := r.URL.Query().Get("labelSelector"); got != "kubernetes.io/service-name=engines" {
			t.Errorf("%s: labelSelector %q", r.URL, got)
		}
		if got := r.Header.Get("User-Agent"); got != userAgent {
			t.Errorf("user agent %q", got)
		}
		if got := r.Header.Get("Authorization"); got != "Bearer secret" {
			t.Errorf("authorization %q", got)
		}
	}
}
