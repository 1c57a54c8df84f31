package diffusionrouter

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/workerurl"
)

// DNS discovery. A Kubernetes headless Service publishes the ready pods of
// a StatefulSet as A records of its name and SRV records of its named
// ports. The router looks such names up on an interval, with Caddy's own
// `a` and `srv` upstream sources, and keeps the pool's discovered workers
// equal to the answers: a worker that appears joins as a registered one
// does (probed, brought to the pool's weights before its first job), one
// that disappears gets no new jobs and leaves when its jobs end.
//
// The answers live in the pool, counted by the configs that name each
// lookup, as the workers a config lists are: a reload starts the new
// config's lookups before the old config's stop, and the workers both name
// stay, with what the pool learned of them.

// discovery looks one config's names up every refresh. HealthApp runs it,
// so that it starts when Caddy starts the config and stops when the config
// is unloaded; `caddy validate` looks nothing up.
type discovery struct {
	h       *Handler
	lookups []*dnsLookup
	refresh time.Duration
	kube    []*kubeLookup // followed through the Kubernetes API: see kubernetes.go
}

// dnsLookup is one name to look up.
type dnsLookup struct {
	key    string                      // names the lookup in the pool: kind, name and port
	source reverseproxy.UpstreamSource // Caddy's a or srv upstream source

	// Touched only by the discovery's goroutine.
	failing bool     // the last lookup failed: logged once, not every round
	last    []string // the addresses of the last answer, to log what changes
}

// errNoUsableWorker is a lookup whose answer names no worker the router
// may use: taken as a failure, so that it never empties the pool.
var errNoUsableWorker = errors.New("the answer names no usable worker")

// newDiscovery sets up Caddy's upstream sources for the handler's DNS
// names, and its lookups of the Kubernetes API; nil when it has none. It
// dials nobody.
func newDiscovery(ctx caddy.Context, h *Handler) (*discovery, error) {
	o := &h.Discovery
	if len(o.A) == 0 && len(o.SRV) == 0 && len(o.Kubernetes) == 0 {
		return nil, nil
	}
	d := &discovery{h: h, refresh: time.Duration(o.Refresh)}
	d.addKubernetes(o.Kubernetes)
	// Caddy's sources keep an answer for their Refresh; half of ours makes
	// each round ask DNS again rather than get the last round's answer.
	keep := caddy.Duration(d.refresh / 2)
	resolver := func() *reverseproxy.UpstreamResolver {
		if len(o.Resolvers) == 0 {
			return nil // the system's
		}
		return &reverseproxy.UpstreamResolver{Addresses: o.Resolvers}
	}
	for _, a := range o.A {
		port := strconv.Itoa(a.Port)
		src := &reverseproxy.AUpstreams{Name: a.Name, Port: port, Refresh: keep, Resolver: resolver()}
		if err := src.Provision(ctx); err != nil {
			return nil, optionError("workers_dns", "discovery.a", "%s: %v", a.Name, err)
		}
		d.lookups = append(d.lookups, &dnsLookup{key: "a " + a.Name + " " + port, source: src})
	}
	for _, name := range o.SRV {
		src := &reverseproxy.SRVUpstreams{Name: name, Refresh: keep, Resolver: resolver()}
		if err := src.Provision(ctx); err != nil {
			return nil, optionError("workers_srv", "discovery.srv", "%s: %v", name, err)
		}
		d.lookups = append(d.lookups, &dnsLookup{key: "srv " + name, source: src})
	}
	return d, nil
}

// dnsKeys names the discovery's DNS lookups in the pool.
func (d *discovery) dnsKeys() []string {
	keys := make([]string, len(d.lookups))
	for i, l := range d.lookups {
		keys[i] = l.key
	}
	return keys
}

// declare counts the discovery's lookups in the pool.
func (d *discovery) declare() {
	d.h.pool.DeclareLookups("dns", d.dnsKeys())
	d.h.pool.DeclareLookups("kubernetes", d.kubeKeys())
}

// undeclare withdraws the discovery's lookups from the pool.
func (d *discovery) undeclare() {
	d.h.pool.UndeclareLookups(append(d.dnsKeys(), d.kubeKeys()...))
}

// run follows every Kubernetes lookup, and looks every DNS name up at
// once, then again every refresh, until ctx ends.
func (d *discovery) run(ctx context.Context) {
	var watches sync.WaitGroup
	defer watches.Wait()
	for _, l := range d.kube {
		scheduler.GoSafely(&watches, d.h.logger, "Kubernetes lookup "+l.key, func() { d.follow(ctx, l) })
	}
	if len(d.lookups) == 0 {
		return
	}
	for {
		for _, l := range d.lookups {
			d.lookUp(ctx, l)
		}
		if !scheduler.Sleep(ctx, d.refresh) {
			return
		}
	}
}

// lookUp asks DNS once and hands the answer to the pool; a failed lookup
// keeps the workers of the last one that answered.
func (d *discovery) lookUp(ctx context.Context, l *dnsLookup) {
	ups, err := l.source.GetUpstreams(lookupRequest(ctx))
	if ctx.Err() != nil {
		return // stopping: says nothing of the name
	}
	dials := make([]string, len(ups))
	for i, u := range ups {
		dials[i] = u.Dial
	}
	slices.Sort(dials)
	urls := d.workerURLs(l, dials)
	if err == nil {
		l.last = dials
		if len(urls) == 0 {
			err = errNoUsableWorker
		}
	}
	d.h.pool.SetFailing(l.key, err != nil)
	if err != nil {
		d.failed(l, err)
		return
	}
	if l.failing {
		l.failing = false
		d.h.logger.Info("DNS lookup of workers answers again", zap.String("lookup", l.key))
	}
	change := d.h.pool.SetFound(l.key, urls, d.h.MaxWorkers)
	d.report(l.key, "DNS", change)
	d.welcome(ctx, change.Joined)
}

// lookupRequest is what Caddy's upstream sources take to look a name up:
// a request whose context carries ctx's end and a replacer.
func lookupRequest(ctx context.Context) *http.Request {
	ctx = context.WithValue(ctx, caddy.ReplacerCtxKey, caddy.NewReplacer())
	r, _ := http.NewRequestWithContext(ctx, http.MethodGet, "/", nil) // cannot fail: fixed method and URL
	return r
}

// workerURLs turns the addresses of an answer into the workers it finds,
// leaving out those that are never workers (the checks of a
// registration: cloud metadata, link-local, Caddy's admin API); the dial
// guard checks the addresses SRV targets resolve to when they are
// dialled.
func (d *discovery) workerURLs(l *dnsLookup, dials []string) []scheduler.Found {
	changed := !slices.Equal(dials, l.last)
	var urls []string
	for _, dial := range dials {
		u, err := workerurl.Parse("http://" + dial)
		if err == nil && d.h.guard.RefusesURL(u) {
			err = workerurl.ErrAdmin
		}
		if err != nil {
			if changed {
				d.h.logger.Warn("DNS answer names an address that is never a worker; it is left out",
					zap.String("lookup", l.key), zap.String("address", dial), zap.Error(err))
			}
			continue
		}
		urls = append(urls, u)
	}
	slices.Sort(urls)
	urls = slices.Compact(urls) // an answer may name an address twice
	found := make([]scheduler.Found, len(urls))
	for i, u := range urls {
		found[i] = scheduler.Found{URL: u}
	}
	return found
}

// failed logs a failed lookup once, until the name answers again.
func (d *discovery) failed(l *dnsLookup, err error) {
	if l.failing {
		d.h.logger.Debug("DNS lookup of workers failed again", zap.String("lookup", l.key), zap.Error(err))
		return
	}
	l.failing = true
	d.h.logger.Warn("DNS lookup of workers failed; the workers it last named stay",
		zap.String("lookup", l.key), zap.Error(err))
}

// report logs how an answer of lookup key, found through through (DNS,
// the Kubernetes API), changed the pool.
func (d *discovery) report(key, through string, c scheduler.FoundChange) {
	if len(c.Joined) > 0 {
		d.h.logger.Info("workers found through "+through+" joined the pool", zap.String("lookup", key), zap.Strings("workers", c.Joined))
	}
	if len(c.Left) > 0 {
		d.h.logger.Info("workers no longer found through "+through+" left the pool; their jobs in flight finish", zap.String("lookup", key), zap.Strings("workers", c.Left))
	}
	if c.NoRoom > 0 {
		d.h.logger.Warn("workers found through "+through+" left out: the pool has max_workers workers",
			zap.String("lookup", key), zap.Int("left_out", c.NoRoom), zap.Int("max_workers", d.h.MaxWorkers))
	}
}

// welcome learns what the workers that joined can generate, in parallel,
// and starts bringing them to the pool's weights, as a registration does.
func (d *discovery) welcome(ctx context.Context, joined []string) {
	if len(joined) == 0 || !d.h.pool.election.Leading() {
		return // a standby calls no worker; it probes them all once it leads
	}
	var wg sync.WaitGroup
	for _, u := range joined {
		scheduler.GoSafely(&wg, d.h.logger, "first probe of "+u, func() { d.h.pool.fleet.Welcome(ctx, u) })
	}
	wg.Wait()
	d.h.pool.fleet.StartCatchUps(&d.h.weights)
}
