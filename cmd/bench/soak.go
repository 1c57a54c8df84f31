package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// soak is one soak run: the workers as the faults change them, the router
// process and what its config says.
type soak struct {
	o         options
	router    *routerProcess
	images    testrouter.Fleet   // the workers the config lists; the schedule restarts them
	video     *fakeworker.Worker // the video pool's one worker
	joined    *fakeworker.Worker // registered at run time, until removed
	joins     int                // workers registered so far, to name them
	blackhole *fakeworker.Worker // listed from the start, never answering a job, until it leaves
	ports     struct{ images, videos, admin int }
	order     string // queue_order of the image pool
	storage   string // the folder of the router's storage

	round, place int // of the fault being injected: which round of the schedule, and where in it

	began    time.Time
	tally    *tally          // the measured load's
	injected map[string]int  // faults by name
	applied  atomic.Int32    // faults injected, for the watch to see
	updates  []time.Duration // how long each update with a hung call took to answer
}

func (s *soak) imagesURL() string { return fmt.Sprintf("http://127.0.0.1:%d", s.ports.images) }
func (s *soak) videosURL() string { return fmt.Sprintf("http://127.0.0.1:%d", s.ports.videos) }

// sample is the router process's state at one moment.
type sample struct {
	processStats
	reruns, hedges, broken map[string]float64 // counters by cause, by outcome, by delivery
}

// soakResult is what a soak run measured.
type soakResult struct {
	t            *tally
	took         time.Duration // the measured load's
	start, end   sample        // after the warm-up, after the load
	middle, peak processStats  // half way through the load, the highest seen during it
}

// benchSoak runs the soak mode: the router as a process of its own in front
// of fake workers, a mixed load from closed-loop clients, faults on a
// schedule, and what the router holds before and after.
func benchSoak(ctx context.Context, o options, out io.Writer) error {
	s, r, err := runSoak(ctx, o)
	if err != nil {
		return err
	}
	s.report(out, r)
	return nil
}

// runSoak starts the workers and the router, warms them up, sends the
// measured load while the schedule injects its faults, and stops them.
func runSoak(ctx context.Context, o options) (*soak, soakResult, error) {
	var r soakResult
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	dir, err := os.MkdirTemp("", "diffusion-router-soak-")
	if err != nil {
		return nil, r, err
	}
	defer os.RemoveAll(dir)
	bin := o.caddy
	if bin == "" {
		fmt.Fprintln(os.Stderr, "soak: building ./cmd/caddy")
		if bin, err = buildCaddy(ctx, dir); err != nil {
			return nil, r, err
		}
	}
	s := &soak{o: o, order: "fifo", injected: make(map[string]int)}
	defer s.close()
	if err := s.start(ctx, bin, dir); err != nil {
		return nil, r, err
	}

	images := newClient([]string{s.imagesURL()}, o.clients)
	videos := newClient([]string{s.videosURL()}, o.clients)
	if err := s.warmUp(ctx, images, videos); err != nil {
		return nil, r, err
	}
	if r.start, err = s.settle(ctx, images, videos); err != nil {
		return nil, r, err
	}
	r.t = newTally()
	images.onResend, videos.onResend = r.t.resend, r.t.resend
	if err := s.run(ctx, &r, images, videos); err != nil {
		return nil, r, err
	}
	if r.end, err = s.settle(ctx, images, videos); err != nil {
		return nil, r, err
	}
	return s, r, nil
}

// warmUp sends --warmup requests of the soak's load, the blackhole
// already there, and fails unless every one is answered.
func (s *soak) warmUp(ctx context.Context, images, videos *client) error {
	warm := newTally()
	images.onResend, videos.onResend = warm.resend, warm.resend
	soakClients(ctx, nil, s.o.clients, s.o.warmup, mixes[s.o.mix], warmupSeed(s.o.seed), images, videos, warm)
	if n := warm.unanswered(); n > 0 {
		return fmt.Errorf("%d of %d warm-up requests failed: %v", n, s.o.warmup, warm.reasons)
	}
	return nil
}

// start starts the workers, the blackhole among them, and the router,
// Caddy's binary bin with its config and storage in dir.
func (s *soak) start(ctx context.Context, bin, dir string) error {
	var err error
	if s.images, err = testrouter.StartFleet(s.o.speeds, s.o.unitMs); err != nil {
		return err
	}
	if err := s.startBlackhole(); err != nil {
		return err
	}
	s.storage = filepath.Join(dir, "storage")
	if err := os.Mkdir(s.storage, 0o700); err != nil {
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
	for _, w := range []*fakeworker.Worker{s.video, s.blackhole, s.joined} {
		if w != nil {
			w.Close()
		}
	}
}

// run sends the measured load, counted in r.t, while the schedule injects
// its faults, and follows the router meanwhile: it sets how long the load
// took, the router half way and its peak. The load ends after --n
// requests, --duration or --rounds of the schedule, its requests under way
// running to their end and counted (the last fault's re-runs among them),
// or at once when a fault fails.
func (s *soak) run(ctx context.Context, r *soakResult, images, videos *client) error {
	s.began, s.tally = r.t.began, r.t
	issuing, stopLoad := context.WithCancel(ctx)
	defer stopLoad()
	if s.o.durationSet {
		var stop context.CancelFunc
		issuing, stop = context.WithTimeout(issuing, s.o.duration)
		defer stop()
	}
	sending, abandon := context.WithCancel(ctx)
	defer abandon()
	loadDone := make(chan struct{})
	var err error
	var wg sync.WaitGroup
	wg.Go(func() {
		if err = s.runSchedule(ctx, loadDone, stopLoad); err != nil {
			stopLoad()
			abandon()
		}
	})
	wg.Go(func() { r.peak, r.middle = s.watch(ctx, loadDone, r.t) })
	soakClients(sending, issuing.Done(), s.o.clients, s.o.n, mixes[s.o.mix], s.o.seed, images, videos, r.t)
	r.took = time.Since(s.began)
	close(loadDone)
	wg.Wait()
	return err
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
		reruns:       byLabel(m, "caddy_diffusion_job_reruns_total", "cause", rerunCauses...),
		hedges:       byLabel(m, "caddy_diffusion_hedges_total", "outcome", hedgeOutcomes...),
		broken:       byLabel(m, "caddy_diffusion_broken_answers_total", "delivery", brokenDeliveries...),
	}, nil
}

// The labels of the router's counters the report reads.
var (
	rerunCauses      = []string{"connection", "status", "asleep", "cut_short"}
	hedgeOutcomes    = []string{"launched", "won", "cancelled"}
	brokenDeliveries = []string{"held", "streamed"}
)

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
		fmt.Fprintf(os.Stderr, "soak: %6.1fs  %d answered, %d 4xx, %d reset, %d broken, %d lost; router %s resident, %s heap, %.0f goroutines, %.0f files\n",
			time.Since(s.began).Seconds(), t.total(answered), t.total(refused), t.total(reset), t.total(broken), t.total(lost),
			fmtBytes(now.rss), fmtBytes(now.heap), now.goroutines, now.files)
	}
}

// halfway reports whether half the run's requests (or of --duration, or
// of --rounds) are behind it.
func (s *soak) halfway(t *tally) bool {
	switch {
	case s.o.durationSet && time.Since(s.began) >= s.o.duration/2:
		return true
	case s.o.rounds > 0 && 2*int(s.applied.Load()) >= s.o.rounds*len(schedule):
		return true
	}
	return 2*t.requests() >= s.o.n
}

// report prints the soak's tables.
func (s *soak) report(out io.Writer, r soakResult) {
	t := r.t
	requests := t.requests()
	fmt.Fprintf(out, "\n== soak: %d requests from %d clients in closed loops, a fault every %s ==\n", requests, s.o.clients, s.o.faultEvery)
	fmt.Fprintf(out, "load: %d%% images (%s), %d%% rollouts (512x512/8), %d%% videos (256x256, 8 frames, 4 steps: create, polls, content, delete)\n",
		100-rolloutPercent-videoPercent, describeMix(mixes[s.o.mix]), rolloutPercent, videoPercent)
	fmt.Fprintf(out, "router: Caddy built from ./cmd/caddy, a process of its own, max_held_answer %d bytes (images are held, rollouts stream)\n", soakHeldAnswer)
	fmt.Fprintln(out, "every 2xx is read whole and decoded (JSON, msgpack, base64 media); reset = a 2xx over max_held_answer that broke off mid-body,")
	fmt.Fprintln(out, "broken = a 2xx read to its end that is not whole (a broken answer delivered as success), lost = none of these, nor a 4xx")
	fmt.Fprintln(out)
	reportFates(out, t)
	fmt.Fprintf(out, "\ntook %s, %.0f requests/s\n", r.took.Round(100*time.Millisecond), float64(requests)/r.took.Seconds())
	s.reportEvents(out, t, r.start, r.end)
	fmt.Fprintln(out)
	reportProcess(out, r)
	if len(t.reasons) > 0 {
		fmt.Fprintln(out, "\nnot answered:")
		for _, r := range sortedKeys(t.reasons) {
			fmt.Fprintf(out, "  %6d  %s\n", t.reasons[r], r)
		}
	}
}

// reportFates prints the requests by kind and fate.
func reportFates(out io.Writer, t *tally) {
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "kind\trequests\tanswered\t4xx\treset\tbroken\tlost\t")
	row := func(name string, c [fates]int) {
		n := 0
		for _, v := range c {
			n += v
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\t\n", name, n, c[answered], c[refused], c[reset], c[broken], c[lost])
	}
	var all [fates]int
	for k := range kinds {
		row(k.String(), t.counts[k])
		for f := range fates {
			all[f] += t.counts[k][f]
		}
	}
	row("all", all)
	tw.Flush()
}

// reportEvents prints what the router did about the faults, from its
// counters, and the faults injected.
func (s *soak) reportEvents(out io.Writer, t *tally, start, end sample) {
	fmt.Fprintf(out, "resent:  %d (requests written on a kept-alive connection that the router closed before reading them, as a reload closes idle ones; sent again by Go's client, as they carry Idempotency-Key)\n", t.resent)
	causes, reruns := deltas(start.reruns, end.reruns, rerunCauses...)
	fmt.Fprintf(out, "re-runs: %.0f (by cause: %s)\n", reruns, causes)
	outcomes, _ := deltas(start.hedges, end.hedges, hedgeOutcomes...)
	fmt.Fprintf(out, "hedges:  %s\n", outcomes)
	deliveries, _ := deltas(start.broken, end.broken, brokenDeliveries...)
	fmt.Fprintf(out, "broken answers the router caught: %s (held: run again; streamed: the client's connection reset)\n", deliveries)
	if len(s.updates) > 0 {
		fmt.Fprintf(out, "updates with one worker's call hung: %d, answered in %s to %s (weights_timeout %s; the bound checked: %s); the worker caught up after its restart\n",
			len(s.updates), slices.Min(s.updates).Round(time.Millisecond), slices.Max(s.updates).Round(time.Millisecond), soakWeightsTimeout, updateLimit)
	}
	var injected []string
	for _, f := range faults() {
		injected = append(injected, fmt.Sprintf("%s %d", f.name, s.injected[f.name]))
	}
	fmt.Fprintf(out, "faults:  %s\n", strings.Join(injected, ", "))
}

// reportProcess prints what the router process held.
func reportProcess(out io.Writer, r soakResult) {
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "router process\tstart\thalfway\tend\tpeak while running\t")
	count := func(v float64) string { return fmt.Sprintf("%.0f", v) }
	samples := []processStats{r.start.processStats, r.middle, r.end.processStats, r.peak}
	for _, row := range []struct {
		name   string
		value  func(processStats) float64
		format func(float64) string
	}{
		{"resident memory", func(p processStats) float64 { return p.rss }, fmtBytes},
		{"heap in use", func(p processStats) float64 { return p.heap }, fmtBytes},
		{"goroutines", func(p processStats) float64 { return p.goroutines }, count},
		{"open files", func(p processStats) float64 { return p.files }, count},
	} {
		cells := []string{row.name}
		for _, p := range samples {
			cell := "-" // not sampled: a run shorter than the sampling period
			if v := row.value(p); v > 0 {
				cell = row.format(v)
			}
			cells = append(cells, cell)
		}
		fmt.Fprintln(tw, strings.Join(cells, "\t")+"\t")
	}
	tw.Flush()
	fmt.Fprintln(out, "start: after the warm-up, end: after the last fault, both with no client connected; halfway: under load; all three after a garbage collection. peak: sampled every 10s, as held")
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
