package kubediscovery

import (
	"context"
	"testing"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/kubeapi"
)

// Watch with a kubeconfig reaches the API server through this package's
// own REST client: the slices' path in the namespace, the Service's label
// selector, the kubeconfig's token over TLS, the router's user agent; the
// list streamed by the first watch arrives as the set, and a watch event
// changes it.
func TestWatchThroughKubeconfig(t *testing.T) {
	server := kubeapi.Start(t, "prod")
	s := sliceOf("prod", "engines-a", "engines", http30000, podAt("10.0.0.1", "prod", "engine-a"))
	server.Apply(s)
	w, stop := follow(t, func(ctx context.Context, log *zap.Logger, w *watcher) error {
		return Watch(ctx, Config{Namespace: "prod", Service: "engines", Kubeconfig: server.Kubeconfig()}, log, w.update, w.synced)
	})
	defer stop()
	w.waitKeys("uid-engine-a")
	w.waitSynced(true)

	s.Endpoints = append(s.Endpoints, podAt("10.0.0.2", "prod", "engine-b"))
	server.Apply(s)
	w.waitKeys("uid-engine-a", "uid-engine-b")

	for _, r := range server.Requests() {
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
