package diffusionrouter

import (
	"context"
	"slices"
	"strings"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/kubediscovery"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/workerurl"
)

// Discovery through the Kubernetes API (workers_kubernetes). The router
// follows a Service's EndpointSlices, or those a selector names, with a
// watch: a change reaches the pool as the API server sends it, with each
// endpoint's pod and conditions, which the pool follows as kube-proxy
// does (internal/scheduler/found.go). The lookups live in the pool
// beside the DNS ones, counted by the configs that name them; an API
// that fails keeps the workers it last named, and
// caddy_diffusion_discovery_synced says so.

// kubeLookup is one workers_kubernetes block.
type kubeLookup struct {
	key string // names the lookup in the pool
	cfg kubediscovery.Config
	api kubediscovery.API // made when Caddy starts the config

	// Touched only by the lookup's goroutine.
	refused []string // addresses of the last set that are never workers, to log what changes
}

// addKubernetes adds the handler's workers_kubernetes blocks, which
// provisionDiscovery checked, to d. It contacts nothing.
func (d *discovery) addKubernetes(lookups []KubernetesLookup) {
	for _, k := range lookups {
		cfg := kubediscovery.Config(k)
		d.kube = append(d.kube, &kubeLookup{key: kubeKey(cfg), cfg: cfg})
	}
}

// kubeKey names a lookup in the pool: what it follows, where, at which
// port and address family.
func kubeKey(c kubediscovery.Config) string {
	what := "service=" + c.Service
	if c.Service == "" {
		what = "selector=" + c.Selector
	}
	return strings.Join([]string{"kubernetes", c.Namespace, what, c.Port, c.AddressType, c.Kubeconfig}, " ")
}

// kubeKeys names the discovery's Kubernetes lookups in the pool.
func (d *discovery) kubeKeys() []string {
	keys := make([]string, len(d.kube))
	for i, l := range d.kube {
		keys[i] = l.key
	}
	return keys
}

// connect makes each lookup's API client, as Caddy starts the config:
// outside a cluster, a lookup with no kubeconfig fails it.
func (d *discovery) connect() error {
	for _, l := range d.kube {
		api, err := kubediscovery.Client(l.cfg)
		if err != nil {
			return optionError("workers_kubernetes", "discovery.kubernetes", "%v", err)
		}
		l.api = api
	}
	return nil
}

// follow watches one lookup's slices until ctx ends. It is out of sync
// until its first list: after a reload too, whose new watch may never
// list (a kubeconfig whose credentials the API refuses).
func (d *discovery) follow(ctx context.Context, l *kubeLookup) {
	pool := d.h.pool
	pool.SetFailing(l.key, true)
	log := d.h.logger.With(zap.String("lookup", l.key))
	_ = kubediscovery.WatchWith(ctx, l.api, l.cfg, log,
		func(eps []kubediscovery.Endpoint) { d.foundThroughAPI(ctx, l, eps) },
		func(synced bool) { pool.SetFailing(l.key, !synced) })
}

// foundThroughAPI hands the endpoints the slices now name to the pool,
// leaving out addresses that are never workers (the checks of a
// registration: cloud metadata, link-local, Caddy's admin API).
func (d *discovery) foundThroughAPI(ctx context.Context, l *kubeLookup, eps []kubediscovery.Endpoint) {
	found := make([]scheduler.Found, 0, len(eps))
	var refused []string
	for _, e := range eps {
		u, err := workerurl.Parse("http://" + e.HostPort())
		if err == nil && d.h.guard.RefusesURL(u) {
			err = workerurl.ErrAdmin
		}
		if err != nil {
			refused = append(refused, e.HostPort())
			if !slices.Contains(l.refused, e.HostPort()) {
				d.h.logger.Warn("Kubernetes endpoint is an address that is never a worker; it is left out",
					zap.String("lookup", l.key), zap.String("address", e.HostPort()), zap.Error(err))
			}
			continue
		}
		found = append(found, scheduler.Found{URL: u, Source: "kubernetes", Namespace: e.Namespace, Pod: e.Pod, Identity: e.Key, Condition: conditionOf(e)})
	}
	l.refused = refused
	change := d.h.pool.SetFound(l.key, found, d.h.MaxWorkers)
	d.report(l.key, "the Kubernetes API", change)
	d.welcome(ctx, change.Joined)
}

// conditionOf is what e's conditions make of its worker: kube-proxy sends
// traffic to a ready endpoint, to a serving and terminating one when no
// ready one is left, and to none other.
func conditionOf(e kubediscovery.Endpoint) scheduler.Condition {
	switch {
	case e.Ready:
		return scheduler.EndpointReady
	case e.Serving && e.Terminating:
		return scheduler.EndpointTerminating
	}
	return scheduler.EndpointNotReady
}
