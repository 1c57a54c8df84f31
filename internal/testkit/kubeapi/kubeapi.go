// Package kubeapi is a stand-in for the Kubernetes API server's
// EndpointSlice endpoints, for tests that follow slices through a
// kubeconfig without a cluster: the real API server's tests run in a
// network namespace of their own (kubernetes_apiserver_test.go at the
// root), these anywhere.
package kubeapi

import (
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"testing"

	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
)

// Server answers the EndpointSlice requests of one namespace as the API
// server does, in JSON: a list, a watch, and a watch that streams the
// list first (sendInitialEvents) and ends it with a bookmark. Apply and
// Delete change its slices and reach every open watch as events; Fail
// makes it answer every request with an error.
type Server struct {
	t         testing.TB
	namespace string
	ts        *httptest.Server

	mu       sync.Mutex
	version  int
	slices   map[string]*discoveryv1.EndpointSlice
	watches  []chan watch.Event
	status   int // answered to every request while not 0
	requests []*http.Request
}

// Start starts a server for namespace, closed when t ends.
func Start(t testing.TB, namespace string) *Server {
	s := &Server{t: t, namespace: namespace, version: 1, slices: map[string]*discoveryv1.EndpointSlice{}}
	s.ts = httptest.NewTLSServer(s)
	t.Cleanup(s.ts.Close)
	return s
}

// Kubeconfig writes a kubeconfig that reaches s with a bearer token, and
// returns its path.
func (s *Server) Kubeconfig() string {
	ca := base64.StdEncoding.EncodeToString(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: s.ts.Certificate().Raw}))
	path := filepath.Join(s.t.TempDir(), "kubeconfig")
	cfg := `apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "` + s.ts.URL + `", certificate-authority-data: "` + ca + `"}}]
users: [{name: u, user: {token: secret}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
`
	if err := os.WriteFile(path, []byte(cfg), 0o600); err != nil {
		s.t.Fatal(err)
	}
	return path
}

// Apply creates or changes a slice, as the EndpointSlice controller does.
func (s *Server) Apply(slice *discoveryv1.EndpointSlice) {
	s.mu.Lock()
	defer s.mu.Unlock()
	typ := watch.Added
	if s.slices[slice.Name] != nil {
		typ = watch.Modified
	}
	slice = slice.DeepCopy()
	s.version++
	slice.ResourceVersion = strconv.Itoa(s.version)
	s.slices[slice.Name] = slice
	s.notifyLocked(typ, slice)
}

// Delete deletes the slice named name.
func (s *Server) Delete(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	slice := s.slices[name]
	if slice == nil {
		return
	}
	delete(s.slices, name)
	s.version++
	s.notifyLocked(watch.Deleted, slice)
}

// Fail answers every request with status from now on, and ends the open
// watches; 0 answers again.
func (s *Server) Fail(status int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.status = status
	if status != 0 {
		for _, w := range s.watches {
			close(w)
		}
		s.watches = nil
	}
}

// Requests returns the requests s was sent so far.
func (s *Server) Requests() []*http.Request {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.requests)
}

func (s *Server) notifyLocked(typ watch.EventType, slice *discoveryv1.EndpointSlice) {
	for _, w := range s.watches {
		select {
		case w <- watch.Event{Type: typ, Object: slice}:
		default: // a watch that does not keep up is ended, as the API server ends it
			close(w)
			s.watches = slices.DeleteFunc(s.watches, func(x chan watch.Event) bool { return x == w })
		}
	}
}

// ServeHTTP answers one request.
func (s *Server) ServeHTTP(rw http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	s.requests = append(s.requests, r)
	status := s.status
	s.mu.Unlock()
	switch {
	case status != 0:
		http.Error(rw, http.StatusText(status), status)
		return
	case r.URL.Path != "/apis/discovery.k8s.io/v1/namespaces/"+s.namespace+"/endpointslices":
		http.NotFound(rw, r)
		return
	}
	rw.Header().Set("Content-Type", "application/json")
	if r.URL.Query().Get("watch") != "true" {
		s.list(rw)
		return
	}
	s.watch(rw, r)
}

// list answers the slices as one list.
func (s *Server) list(rw http.ResponseWriter) {
	s.mu.Lock()
	list := discoveryv1.EndpointSliceList{ListMeta: metav1.ListMeta{ResourceVersion: strconv.Itoa(s.version)}}
	for _, slice := range s.slices {
		list.Items = append(list.Items, *slice)
	}
	s.mu.Unlock()
	s.write(rw, list)
}

// watch streams the slices first when asked, then every change, until
// the client leaves or the server fails.
func (s *Server) watch(rw http.ResponseWriter, r *http.Request) {
	events := make(chan watch.Event, 64)
	s.mu.Lock()
	var initial []*discoveryv1.EndpointSlice
	if r.URL.Query().Get("sendInitialEvents") == "true" {
		for _, slice := range s.slices {
			initial = append(initial, slice)
		}
	}
	version := strconv.Itoa(s.version)
	s.watches = append(s.watches, events)
	s.mu.Unlock()
	defer s.forget(events)
	for _, slice := range initial {
		s.send(rw, watch.Added, slice)
	}
	if r.URL.Query().Get("sendInitialEvents") == "true" {
		end := &discoveryv1.EndpointSlice{ObjectMeta: metav1.ObjectMeta{
			ResourceVersion: version, Annotations: map[string]string{metav1.InitialEventsAnnotationKey: "true"}}}
		s.send(rw, watch.Bookmark, end)
	}
	rw.(http.Flusher).Flush()
	for {
		select {
		case ev, open := <-events:
			if !open {
				return
			}
			s.send(rw, ev.Type, ev.Object.(*discoveryv1.EndpointSlice))
		case <-r.Context().Done():
			return
		}
	}
}

// forget drops a watch that ended.
func (s *Server) forget(events chan watch.Event) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.watches = slices.DeleteFunc(s.watches, func(w chan watch.Event) bool { return w == events })
}

// send writes one watch event and flushes it.
func (s *Server) send(rw http.ResponseWriter, typ watch.EventType, slice *discoveryv1.EndpointSlice) {
	slice = slice.DeepCopy()
	slice.APIVersion, slice.Kind = "discovery.k8s.io/v1", "EndpointSlice"
	s.write(rw, metav1.WatchEvent{Type: string(typ), Object: runtime.RawExtension{Object: slice}})
	rw.(http.Flusher).Flush()
}

func (s *Server) write(rw http.ResponseWriter, v any) {
	if err := json.NewEncoder(rw).Encode(v); err != nil {
		s.t.Log(err)
	}
}
