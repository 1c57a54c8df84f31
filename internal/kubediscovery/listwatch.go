package kubediscovery

import (
	"context"
	"sync"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"
)

// health is what the informer's last call to the API server said. The
// informer's watch error handler alone cannot say it: the reflector retries
// a refused watch by itself and ends a watch on an error event (a 410 Gone)
// without calling it, so the calls themselves report here.
type health struct {
	kick chan<- struct{}

	mu  sync.Mutex
	err error // since the last success; nil while in sync
}

// report records the outcome of a call, kicking the watch loop when it
// changes whether the informer is in sync.
func (h *health) report(err error) {
	h.mu.Lock()
	changed := (h.err == nil) != (err == nil)
	h.err = err
	h.mu.Unlock()
	if changed {
		kick(h.kick)
	}
}

// failure is the error since the last success, nil while in sync.
func (h *health) failure() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.err
}

// listWatch lists and watches the slices c names, filtered by the API
// server, reporting every call's outcome to h.
func listWatch(api API, c Config, h *health) cache.ListerWatcher {
	selector := c.selector().String()
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
			opts.LabelSelector = selector
			list, err := api.ListSlices(ctx, c.Namespace, opts)
			switch {
			case ctx.Err() != nil:
			case err != nil:
				h.report(err)
			case list.Continue == "":
				h.report(nil)
			}
			return list, err
		},
		WatchFuncWithContext: func(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
			opts.LabelSelector = selector
			w, err := api.WatchSlices(ctx, c.Namespace, opts)
			if err != nil {
				if ctx.Err() == nil {
					h.report(err)
				}
				return nil, err
			}
			// A watch-list stream is in sync at the end of its initial
			// events, a plain watch as it opens.
			streaming := opts.SendInitialEvents != nil && *opts.SendInitialEvents
			if !streaming {
				h.report(nil)
			}
			return reporting(w, h, streaming), nil
		},
	}
	// An API that cannot stream a list (client-go's fake clientset) says
	// so to the reflector this way.
	return cache.ToListWatcherWithWatchListSemantics(lw, api)
}

// reportingWatch passes a watch's events on, reporting its error events
// and the end of a watch-list's initial events.
type reportingWatch struct {
	in   watch.Interface
	out  chan watch.Event
	stop chan struct{}
	once sync.Once
}

// reporting wraps w; its goroutine ends when w ends or at Stop.
func reporting(w watch.Interface, h *health, streaming bool) watch.Interface {
	r := &reportingWatch{in: w, out: make(chan watch.Event), stop: make(chan struct{})}
	go r.pass(h, streaming)
	return r
}

// ResultChan is the channel of the events passed on.
func (r *reportingWatch) ResultChan() <-chan watch.Event { return r.out }

// Stop ends the watch and the goroutine passing its events.
func (r *reportingWatch) Stop() {
	r.once.Do(func() {
		close(r.stop)
		r.in.Stop()
	})
}

func (r *reportingWatch) pass(h *health, streaming bool) {
	defer close(r.out)
	for {
		var ev watch.Event
		var ok bool
		select {
		case ev, ok = <-r.in.ResultChan():
		case <-r.stop:
			return
		}
		if !ok {
			return
		}
		switch {
		case ev.Type == watch.Error:
			h.report(apierrors.FromObject(ev.Object))
		case streaming && ev.Type == watch.Bookmark && endsInitialEvents(ev.Object):
			h.report(nil)
		}
		select {
		case r.out <- ev:
		case <-r.stop:
			return
		}
	}
}

// endsInitialEvents says whether a bookmark ends a watch-list's initial
// events.
func endsInitialEvents(obj runtime.Object) bool {
	m, err := meta.Accessor(obj)
	return err == nil && m.GetAnnotations()[metav1.InitialEventsAnnotationKey] == "true"
}
