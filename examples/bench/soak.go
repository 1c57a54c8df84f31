package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/examples/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// soak is one soak run: the workers as the faults change them, the router
// process and what its config says.
type soak struct {
	o      options
	router *routerProcess
	images testrouter.Fleet   // the workers the config lists; the schedule restarts them
	video  *fakeworker.Worker // the video pool's one worker
	joined *fakeworker.Worker // registered at run time, until removed
	joins  int                // workers registered so far, to name them
	ports  struct{ images, videos, admin int }
	order  string // queue_order of the image pool
	turn   int    // faults dealt to image workers so far

	began    time.Time
	injected map[string]int // faults by name
}

func (s *soak) imagesURL() string { return fmt.Sprintf("http://127.0.0.1:%d", s.ports.images) }
func (s *soak) videosURL() string { return fmt.Sprintf("http://127.0.0.1:%d", s.ports.videos) }

// sample is the router process's state at one moment.
type sample struct {
	processStats
	reruns, hedges map[string]float64 // counters by cause, by outcome
}

// benchSoak runs the soak mode: the router as a process of its own in front
// of fake workers, a mixed load from closed-loop clients, faults on a
// schedule, and what the router holds before and after.
func benchSoak(ctx context.Context, o options, out io.Writer) error {
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	dir, err := os.MkdirTemp("", "diffusion-router-soak-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	bin := o.caddy
	if bin == "" {
		fmt.Fprintln(os.Stderr, "soak: building ./cmd/caddy")
		if bin, err = buildCaddy(ctx, dir); err != nil {
			return err
		}
	}
	s := &soak{o: o, order: "fifo", injected: make(map[string]int)}
	defer s.close()
	if err := s.start(ctx, bin, dir); err != nil {
		return err
	}

	images := newClient([]string{s.imagesURL()}, o.clients)
	videos := newClient([]string{s.videosURL()}, o.clients)
	warm := newTally()
	images.onResend, videos.onResend = warm.resend, warm.resend
	soakClients(ctx, o.clients, o.warmup, mixes[o.mix], warmupSeed(o.seed), images, videos, warm)
	if n := warm.total(lost) + warm.total(refused); n > 0 {
		return fmt.Errorf("%d of %d warm-up requests failed: %v", n, o.warmup, warm.reasons)
	}
	start, err := s.settle(ctx, images, videos)
	if err != nil {
		return err
	}
	t := newTally()
	images.onResend, videos.onResend = t.resend, t.resend
	took, middle, peak, err := s.run(ctx, t, images, videos)
	if err != nil {
		return err
	}
	end, err := s.settle(ctx, images, videos)
	if err != nil {
		return err
	}
	s.report(out, t, took, start, middle, end, peak)
	return nil
}

// start starts the workers and the router, Caddy's binary bin with its
// config in dir.
func (s *soak) start(ctx context.Context, bin, dir string) error {
	var err error
	if s.images, err = testrouter.StartFleet(s.o.speeds, s.o.unitMs); err != nil {
		return err
	}
	if s.video, err = fakeworker.Start(fakeworker.Config{Name: "v1", TaskType: "T2V", UnitMs: s.o.unitMs}); err != nil {
		return err
	}
	for _, p := range []*int{&s.ports.images, &s.ports.videos, &s.ports.admin} {
		if *p, err = testrouter.FreePort(); err != nil {
			return err
		}
	}
	cfg, err := s.config()
	if err != nil {
		return err
	}
	admin := fmt.Sprintf("http://127.0.0.1:%d", s.ports.admin)
	s.router, err = startRouterProcess(ctx, bin, dir, cfg, admin, s.imagesURL(), s.videosURL())
	return err
}

// close stops the router, then the workers it had.
func (s *soak) close() {
	if s.router != nil {
		if err := s.router.stop(); err != nil {
			fmt.Fprintln(os.Stderr, "soak:", err)
		}
	}
	s.images.Close()
	if s.video != nil {
		s.video.Close()
	}
}

// run sends the measured load, counted in t, while the schedule injects its
// faults, and follows the router meanwhile. It returns how long the load
// took, the router half way and its peak.
func (s *soak) run(ctx context.Context, t *tally, images, videos *client) (took time.Duration, middle, peak processStats, err error) {
	s.began = t.began
	load := ctx
	if s.o.durationSet {
		var stop context.CancelFunc
		load, stop = context.WithTimeout(ctx, s.o.duration)
		defer stop()
	}
	loadDone := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { err = s.runSchedule(ctx, loadDone) })
	wg.Go(func() { peak, middle = s.watch(ctx, loadDone, t) })
	soakClients(load, s.o.clients, s.o.n, mixes[s.o.mix], s.o.seed, images, videos, t)
	took = time.Since(s.began)
	close(loadDone)
	wg.Wait()
	return took, middle, peak, err
}

// settle lets the router go quiet (no client connection open, a moment for
// its goroutines to end) and samples it after a garbage collection.
func (s *soak) settle(ctx context.Context, clients ...*client) (sample, error) {
	for _, c := range clients {
		c.close()
	}
	time.Sleep(time.Second)
	st, err := s.router.stats(ctx)
	if err != nil {
		return sample{}, err
	}
	m, err := s.router.metrics(ctx)
	if err != nil {
		return sample{}, err
	}
	return sample{
		processStats: st,
		reruns:       byLabel(m, "caddy_diffusion_job_reruns_total", "cause", "connection", "status", "asleep"),
		hedges:       byLabel(m, "caddy_diffusion_hedges_total", "outcome", "launched", "won", "cancelled"),
	}, nil
}

func byLabel(m metrics, name, label string, values ...string) map[string]float64 {
	out := make(map[string]float64)
	for _, v := range values {
		out[v] = m.sum(name, fmt.Sprintf("%s=%q", label, v))
	}
	return out
}

// watch follows the router until done closes. It prints progress every
// ten seconds and keeps the highest memory, goroutines and open files seen,
// as the process held them (no garbage collection first); once half the
// run is over it samples them after a garbage collection.
func (s *soak) watch(ctx context.Context, done <-chan struct{}, t *tally) (peak, middle processStats) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for seconds := 1; ; seconds++ {
		select {
		case <-done:
			return peak, middle
		case <-tick.C:
		}
		if middle == (processStats{}) && s.halfway(t) {
			st, err := s.router.stats(ctx)
			if err != nil {
				fmt.Fprintln(os.Stderr, "soak: sampling the router:", err)
			}
			middle = st
		}
		if seconds%10 != 0 {
			continue
		}
		m, err := s.router.metrics(ctx)
		if err != nil {
			fmt.Fprintln(os.Stderr, "soak: reading the router's metrics:", err)
			continue
		}
		now := m.process()
		peak = processStats{max(peak.rss, now.rss), max(peak.heap, now.heap), max(peak.goroutines, now.goroutines), max(peak.files, now.files)}
		fmt.Fprintf(os.Stderr, "soak: %6.1fs  %d answered, %d 4xx, %d lost; router %s resident, %s heap, %.0f goroutines, %.0f files\n",
			time.Since(s.began).Seconds(), t.total(answered), t.total(refused), t.total(lost),
			fmtBytes(now.rss), fmtBytes(now.heap), now.goroutines, now.files)
	}
}

// halfway reports whether half the run's requests (or of --duration) are
// behind it.
func (s *soak) halfway(t *tally) bool {
	if s.o.durationSet && time.Since(s.began) >= s.o.duration/2 {
		return true
	}
	return 2*(t.total(answered)+t.total(refused)+t.total(lost)) >= s.o.n
}

// report prints the soak's tables.
func (s *soak) report(out io.Writer, t *tally, took time.Duration, start sample, middle processStats, end sample, peak processStats) {
	requests := 0
	for k := range kinds {
		for f := range fates {
			requests += t.counts[k][f]
		}
	}
	fmt.Fprintf(out, "\n== soak: %d requests from %d clients in closed loops, a fault every %s ==\n", requests, s.o.clients, s.o.faultEvery)
	fmt.Fprintf(out, "load: %d%% images (%s), %d%% rollouts (512x512/8), %d%% videos (256x256, 8 frames, 4 steps: create, polls, content, delete)\n",
		100-rolloutPercent-videoPercent, describeMix(mixes[s.o.mix]), rolloutPercent, videoPercent)
	fmt.Fprintf(out, "router: Caddy built from ./cmd/caddy, a process of its own; lost = neither 2xx nor 4xx\n\n")

	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "kind\trequests\tanswered\t4xx\tlost\t")
	var all [fates]int
	for k := range kinds {
		c := t.counts[k]
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t\n", k, c[answered]+c[refused]+c[lost], c[answered], c[refused], c[lost])
		for f := range fates {
			all[f] += c[f]
		}
	}
	fmt.Fprintf(tw, "all\t%d\t%d\t%d\t%d\t\n", requests, all[answered], all[refused], all[lost])
	tw.Flush()

	fmt.Fprintf(out, "\ntook %s, %.0f requests/s\n", took.Round(100*time.Millisecond), float64(requests)/took.Seconds())
	fmt.Fprintf(out, "resent:  %d (requests written on a kept-alive connection that the router closed before reading them, as a reload closes idle ones; sent again by Go's client, as they carry Idempotency-Key)\n", t.resent)
	causes, reruns := deltas(start.reruns, end.reruns, "connection", "status", "asleep")
	fmt.Fprintf(out, "re-runs: %.0f (by cause: %s)\n", reruns, causes)
	outcomes, _ := deltas(start.hedges, end.hedges, "launched", "won", "cancelled")
	fmt.Fprintf(out, "hedges:  %s\n", outcomes)
	var faults []string
	for _, f := range schedule {
		faults = append(faults, fmt.Sprintf("%s %d", f.name, s.injected[f.name]))
	}
	fmt.Fprintf(out, "faults:  %s\n\n", strings.Join(faults, ", "))

	tw = tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "router process\tstart\thalfway\tend\tpeak while running\t")
	count := func(v float64) string { return fmt.Sprintf("%.0f", v) }
	for _, r := range []struct {
		name   string
		value  func(processStats) float64
		format func(float64) string
	}{
		{"resident memory", func(p processStats) float64 { return p.rss }, fmtBytes},
		{"heap in use", func(p processStats) float64 { return p.heap }, fmtBytes},
		{"goroutines", func(p processStats) float64 { return p.goroutines }, count},
		{"open files", func(p processStats) float64 { return p.files }, count},
	} {
		cells := []string{r.name}
		for _, p := range []processStats{start.processStats, middle, end.processStats, peak} {
			cell := "-" // not sampled: a run shorter than the sampling period
			if v := r.value(p); v > 0 {
				cell = r.format(v)
			}
			cells = append(cells, cell)
		}
		fmt.Fprintln(tw, strings.Join(cells, "\t")+"\t")
	}
	tw.Flush()
	fmt.Fprintln(out, "start: after the warm-up, end: after the last fault, both with no client connected; halfway: under load; all three after a garbage collection. peak: sampled every 10s, as held")

	if len(t.reasons) > 0 {
		fmt.Fprintln(out, "\nnot answered:")
		for _, r := range sortedKeys(t.reasons) {
			fmt.Fprintf(out, "  %6d  %s\n", t.reasons[r], r)
		}
	}
}

// deltas reads like "connection 3, status 2": how much each counter grew.
func deltas(start, end map[string]float64, keys ...string) (string, float64) {
	parts := make([]string, len(keys))
	var total float64
	for i, k := range keys {
		d := end[k] - start[k]
		parts[i] = fmt.Sprintf("%s %.0f", k, d)
		total += d
	}
	return strings.Join(parts, ", "), total
}

func fmtBytes(b float64) string { return fmt.Sprintf("%.1f MiB", b/(1<<20)) }
