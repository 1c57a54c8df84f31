package kubediscovery

import (
	"context"
	"slices"
	"time"

	"github.com/go-logr/logr"
	"go.uber.org/zap"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// coalesce is how long a change waits for the changes that follow it, so
// that a burst of events (a rollout touching a slice many times) makes one
// update.
const coalesce = 10 * time.Millisecond

// Watch follows the slices c names until ctx ends, through Client and
// WatchWith; it returns at once if c is invalid or there is no client.
func Watch(ctx context.Context, c Config, log *zap.Logger, update func([]Endpoint), synced func(bool)) error {
	if err := c.Check(); err != nil {
		return err
	}
	api, err := Client(c)
	if err != nil {
		return err
	}
	return WatchWith(ctx, api, c, log, update, synced)
}

// WatchWith follows the slices c names through api until ctx ends, and
// returns once everything it started has stopped. A shared informer lists
// and then watches discovery.k8s.io/v1 EndpointSlices, filtered by the API
// server by namespace and label selector.
//
// After the informer's first full list, and then after every change, it
// calls update with every endpoint of the matching slices (see Endpoint),
// each once, in a stable order; it calls it only when that set has
// changed, and a burst of changes within a few milliseconds makes one
// call. The set is whole: the caller bounds it. Slices of the other
// address family, FQDN slices, and slices without the configured port give
// no endpoint and are logged once.
//
// synced reports whether the informer is in step with the API server:
// true after the first full list, false while a list or a watch fails or
// the watch has ended on an error (a 410 Gone included) until the
// informer has listed or watched again. The first failure of an outage is
// logged at warn, its end at info. An outage never changes the set: the
// last one stands until the API server says otherwise.
//
// update and synced are called from one goroutine, never at once, and
// never after WatchWith returns.
func WatchWith(ctx context.Context, api API, c Config, log *zap.Logger, update func([]Endpoint), synced func(bool)) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	kicks := make(chan struct{}, 1)
	h := &health{kick: kicks}
	inf := cache.NewSharedIndexInformer(listWatch(api, c, h), &discoveryv1.EndpointSlice{}, 0, cache.Indexers{})
	if err := inf.SetWatchErrorHandlerWithContext(func(ctx context.Context, _ *cache.Reflector, err error) {
		if ctx.Err() == nil {
			h.report(err)
		}
	}); err != nil {
		return err
	}
	onChange := func() { kick(kicks) }
	reg, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { onChange() },
		UpdateFunc: func(any, any) { onChange() },
		DeleteFunc: func(any) { onChange() },
	})
	if err != nil {
		return err
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		inf.RunWithContext(klog.NewContext(ctx, logr.New(zapSink{log: log.Named("client-go")})))
	}()
	l := &loop{c: c, sel: c.selector(), log: log, update: update, synced: synced, health: h, store: inf.GetStore()}
	l.run(ctx, kicks, reg.HasSyncedChecker().Done())
	<-done
	return nil
}

// loop turns the informer's store and health into calls of update and
// synced, from one goroutine.
type loop struct {
	c      Config
	sel    labels.Selector
	log    *zap.Logger
	update func([]Endpoint)
	synced func(bool)
	health *health
	store  cache.Store

	listed    bool               // the informer has made its first full list
	delivered []Endpoint         // the set last given to update
	inSync    bool               // what synced last said
	outage    error              // the failure logged, until it heals
	skipped   map[string]leftOut // the slices logged as left out
}

// run waits for kicks until ctx ends; each kick, after the changes that
// follow it within coalesce, brings update and synced up to date.
func (l *loop) run(ctx context.Context, kicks <-chan struct{}, listed <-chan struct{}) {
	pause := time.NewTimer(0)
	<-pause.C
	for {
		select {
		case <-ctx.Done():
			return
		case <-listed:
			l.listed, listed = true, nil
		case <-kicks:
			pause.Reset(coalesce)
			select {
			case <-ctx.Done():
				pause.Stop()
				return
			case <-pause.C:
			}
		}
		l.step()
	}
}

// step gives update the current set if it changed, and synced the
// informer's state if it changed, logging what an operator needs to know.
func (l *loop) step() {
	if l.listed {
		l.deliver()
	}
	failure := l.health.failure()
	switch {
	case failure != nil && l.outage == nil:
		l.log.Warn("kubernetes API: out of sync with the EndpointSlices; keeping the last endpoints while the informer retries", zap.Error(failure))
	case failure == nil && l.outage != nil:
		l.log.Info("kubernetes API: in sync with the EndpointSlices again")
	}
	l.outage = failure
	if inSync := l.listed && failure == nil; inSync != l.inSync {
		l.inSync = inSync
		l.synced(inSync)
	}
}

// deliver reads the set from the store and gives it to update if it
// changed (or was never given), and logs the slices newly left out.
func (l *loop) deliver() {
	objs := l.store.List()
	all := make([]*discoveryv1.EndpointSlice, 0, len(objs))
	for _, o := range objs {
		if s, ok := o.(*discoveryv1.EndpointSlice); ok {
			all = append(all, s)
		}
	}
	set, skipped := endpointsOf(all, l.sel, l.c)
	for slice, out := range skipped {
		if l.skipped[slice] == out {
			continue
		}
		level := zap.InfoLevel
		if out.misconfigured {
			level = zap.WarnLevel
		}
		l.log.Log(level, "kubernetes: EndpointSlice left out", zap.String("slice", slice), zap.String("why", out.why))
	}
	l.skipped = skipped
	if set == nil {
		set = []Endpoint{}
	}
	if l.delivered != nil && slices.Equal(set, l.delivered) {
		return
	}
	l.delivered = set
	l.update(slices.Clone(set))
}

// kick wakes the loop without blocking: a kick already waiting covers this
// one too.
func kick(kicks chan<- struct{}) {
	select {
	case kicks <- struct{}{}:
	default:
	}
}
