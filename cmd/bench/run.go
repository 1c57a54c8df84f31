package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// outcome is one measured request.
type outcome struct {
	job     job
	latency time.Duration // request sent (or batch fired) → response body read
	worker  string        // the answer's X-Fake-Worker header
	adapter string        // the answer's X-Fake-Adapter header: the LoRA adapter the job ran on
	version string        // the answer's X-Weight-Version header: the weights the router says it ran on
	err     error         // nil for a 200 answer read to the end
}

// runResult is one strategy's run of one mode.
type runResult struct {
	name     string
	outcomes []outcome
	wall     time.Duration // batch: makespan; open: first arrival → last answer; overhead: the measuring window
	took     time.Duration // the whole run: start-up, warm-up, measuring, shut-down
	workers  []string      // worker names, for the per-worker columns
	busy     time.Duration // the fake workers' busy time while measuring (0 for an external router)
	warmFail int           // warm-up requests that failed
	err      error         // why the strategy could not run
}

// measureFunc sends a mode's requests through c and returns what came back
// and the wall time.
type measureFunc func(ctx context.Context, c *client) ([]outcome, time.Duration)

// poolSeq numbers the router pools, so every run starts with a fresh one.
var poolSeq int

// runStrategies runs measure once per strategy, each against a fresh fleet
// and a freshly loaded router, or once against --router. conns is the
// number of client connections to keep open.
func runStrategies(ctx context.Context, o options, measure measureFunc, conns int) []runResult {
	if o.router != "" {
		return []runResult{timed(func() runResult { return runExternal(ctx, o, measure, conns) })}
	}
	var out []runResult
	for _, s := range o.strategies {
		fmt.Fprintf(os.Stderr, "bench: %-26s", s.name)
		r := timed(func() runResult { return runStrategy(ctx, o, s, measure, conns) })
		if r.err != nil {
			fmt.Fprintf(os.Stderr, " not run (%.70s...)\n", r.err)
		} else {
			fmt.Fprintf(os.Stderr, " done in %s\n", r.took.Round(100*time.Millisecond))
		}
		out = append(out, r)
	}
	return out
}

func timed(run func() runResult) runResult {
	start := time.Now()
	r := run()
	r.took = time.Since(start)
	return r
}

// runStrategy starts fresh fake workers and the router config of s on a
// new port with a new pool name, warms it up, measures, and stops both.
func runStrategy(ctx context.Context, o options, s strategy, measure measureFunc, conns int) runResult {
	res := runResult{name: s.name}
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	f, err := testrouter.StartFleet(o.speeds, o.unitMs)
	if err != nil {
		res.err = err
		return res
	}
	defer f.Close()
	urls, err := startRouters(ctx, s, f.URLs(), o.maxInflight)
	if err != nil {
		res.err = err
		return res
	}
	defer stopCaddy() // before the fleet closes

	c := newClient(urls, conns)
	defer c.close()
	res.warmFail = warmup(ctx, c, o)
	before := f.Stats()
	res.outcomes, res.wall = measure(ctx, c)
	for i, st := range f.Stats() {
		res.busy += st.Busy - before[i].Busy
		res.workers = append(res.workers, f[i].Name)
	}
	return res
}

// startRouters loads the config of s in front of workers, each router on
// a new port with a new pool name, and returns the routers' URLs. Stop
// them with stopCaddy.
func startRouters(ctx context.Context, s strategy, workers []string, maxInflight int) ([]string, error) {
	ports := make([]int, s.routers)
	urls := make([]string, s.routers)
	for i := range ports {
		var err error
		if ports[i], err = testrouter.FreePort(); err != nil {
			return nil, err
		}
		urls[i] = fmt.Sprintf("http://127.0.0.1:%d", ports[i])
	}
	poolSeq++
	return urls, startCaddy(ctx, s.caddyfile(ports, fmt.Sprintf("bench%d", poolSeq), workers, maxInflight), urls)
}

// runExternal measures the router at --router as it is: its workers and
// strategy are whatever it runs, and it keeps what it learned between runs.
func runExternal(ctx context.Context, o options, measure measureFunc, conns int) runResult {
	res := runResult{name: "router " + o.router}
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	c := newClient([]string{o.router}, conns)
	defer c.close()
	res.warmFail = warmup(ctx, c, o)
	res.outcomes, res.wall = measure(ctx, c)
	for _, oc := range res.outcomes {
		if oc.worker != "" && !slices.Contains(res.workers, oc.worker) {
			res.workers = append(res.workers, oc.worker)
		}
	}
	slices.Sort(res.workers)
	return res
}

// warmup sends --warmup jobs of the mix at once and waits for them, so that
// a router that learns worker speeds has seen every worker work. It
// returns the number that failed.
func warmup(ctx context.Context, c *client, o options) int {
	if o.warmup <= 0 {
		return 0
	}
	outs, _ := measureBatch(makeJobs(mixes[o.mix], o.warmup, warmupSeed(o.seed)))(ctx, c)
	failed := 0
	for _, oc := range outs {
		if oc.err != nil {
			failed++
		}
	}
	return failed
}

// measureBatch sends all jobs at once, as a rollout step does; latencies
// run from the moment they were all released, and the wall time is the
// makespan.
func measureBatch(jobs []job) measureFunc {
	return func(ctx context.Context, c *client) ([]outcome, time.Duration) {
		out := make([]outcome, len(jobs))
		fire := make(chan struct{})
		var start time.Time
		var wg sync.WaitGroup
		for i, j := range jobs {
			wg.Go(func() {
				<-fire
				out[i] = c.generate(ctx, i, j, start)
			})
		}
		start = time.Now()
		close(fire) // start is written before any reader wakes
		wg.Wait()
		return out, time.Since(start)
	}
}

// measureOpen sends job i at arrivals[i] after the start, each on its own,
// whatever is still in flight.
func measureOpen(jobs []job, arrivals []time.Duration) measureFunc {
	return func(ctx context.Context, c *client) ([]outcome, time.Duration) {
		out := make([]outcome, len(jobs))
		var wg sync.WaitGroup
		start := time.Now()
		for i, j := range jobs {
			sleepUntil(ctx, start.Add(arrivals[i]))
			wg.Go(func() { out[i] = c.generate(ctx, i, j, time.Time{}) })
		}
		wg.Wait()
		return out, time.Since(start)
	}
}

// measureOverhead runs clients closed loops of the lightest job for d: each
// client sends its next request as soon as the last one is answered.
func measureOverhead(clients int, d time.Duration) measureFunc {
	return func(ctx context.Context, c *client) ([]outcome, time.Duration) {
		per := make([][]outcome, clients)
		var wg sync.WaitGroup
		start := time.Now()
		deadline := start.Add(d)
		for k := range per {
			wg.Go(func() {
				for i := 0; time.Now().Before(deadline) && ctx.Err() == nil; i++ {
					per[k] = append(per[k], c.generate(ctx, i, lightJob, time.Time{}))
				}
			})
		}
		wg.Wait()
		return slices.Concat(per...), time.Since(start)
	}
}

func sleepUntil(ctx context.Context, t time.Time) {
	d := time.Until(t)
	if d <= 0 {
		return
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
	case <-ctx.Done():
	}
}

// client sends generation requests to one router, or to each of several
// in turn, as a Service in front of router replicas spreads them.
type client struct {
	urls []string
	sent atomic.Uint64
	http *http.Client
	// onResend, when set, marks every request idempotent (Idempotency-Key),
	// so that Go's transport sends it again when the router closed the
	// reused connection it was written on before answering; it learns the
	// request's number each time. Otherwise such a request fails.
	onResend func(i int)
	// ids, when set, names request i's X-Request-Id; otherwise it is
	// bench-<i>.
	ids func(i int) string
	// models, when set, names request i's model field: the LoRA adapter
	// it asks for. Otherwise it has none.
	models func(i int) string
	// header, when set, is sent with every request.
	header http.Header
}

// newClient keeps up to conns idle connections per router, so that a batch
// does not open and close connections while being measured. It ignores
// proxy environment variables.
func newClient(urls []string, conns int) *client {
	tr := &http.Transport{
		MaxIdleConns:        conns * len(urls),
		MaxIdleConnsPerHost: conns,
		IdleConnTimeout:     time.Minute,
		DisableCompression:  true,
	}
	return &client{urls: urls, http: &http.Client{Transport: tr}}
}

// url is the router the next request goes to.
func (c *client) url() string {
	return c.urls[(c.sent.Add(1)-1)%uint64(len(c.urls))]
}

func (c *client) close() { c.http.CloseIdleConnections() }

// generate sends job j as POST /v1/images/generations and reads the whole
// answer. The latency runs from `from`, or from now if from is zero.
func (c *client) generate(ctx context.Context, i int, j job, from time.Time) outcome {
	if from.IsZero() {
		from = time.Now()
	}
	oc := outcome{job: j}
	body := j.request(i)
	if c.models != nil {
		body["model"] = c.models(i)
	}
	_, header, err := c.call(ctx, "", http.MethodPost, "/v1/images/generations", i, body)
	oc.latency, oc.err = time.Since(from), err
	oc.worker, oc.adapter = header.Get("X-Fake-Worker"), header.Get(fakeworker.AdapterHeader)
	oc.version = header.Get("X-Weight-Version")
	return oc
}

// statusError is an answer other than 2xx.
type statusError struct {
	call   string // which call of the request, for one of several
	status int
	body   string // its start
}

func (e *statusError) Error() string {
	return fmt.Sprintf("%s%d %s: %s", e.call, e.status, http.StatusText(e.status), e.body)
}

// call sends method path with body as JSON (none if nil) to the next router
// and returns the whole answer of a 2xx, or a *statusError, and the answer's
// header. The request carries X-Request-Id bench-<i> (or what c.ids names),
// which the router's job log repeats. what names the call in errors.
func (c *client) call(ctx context.Context, what, method, path string, i int, body any) ([]byte, http.Header, error) {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return nil, nil, err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.url()+path, rd)
	if err != nil {
		return nil, nil, err
	}
	id := fmt.Sprintf("bench-%d", i)
	if c.ids != nil {
		id = c.ids(i)
	}
	maps.Copy(req.Header, c.header)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", id)
	if c.onResend != nil {
		req.Header.Set("Idempotency-Key", id)
		var conns atomic.Int32 // one per attempt
		req = req.WithContext(httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
			GotConn: func(httptrace.GotConnInfo) {
				if conns.Add(1) > 1 {
					c.onResend(i)
				}
			},
		}))
	}
	resp, err := c.http.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // the URL may hold a job id; keep reasons countable
		}
		return nil, nil, fmt.Errorf("%s%s: %w", what, method, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return nil, resp.Header, &statusError{what, resp.StatusCode, string(bytes.TrimSpace(b[:min(len(b), 200)]))}
	}
	if err != nil {
		return nil, resp.Header, &cutError{what, resp.ContentLength, err}
	}
	return b, resp.Header, nil
}

// cutError is a 2xx answer whose body broke off before its end: the
// connection closed or was reset after the status.
type cutError struct {
	call   string
	length int64 // the answer's Content-Length; -1 if it declared none
	err    error
}

func (e *cutError) Error() string {
	err := e.err
	var op *net.OpError
	if errors.As(err, &op) {
		err = op.Err // without the addresses, so that reasons stay countable
	}
	return fmt.Sprintf("%s2xx answer broke off mid-body: %v", e.call, err)
}

func (e *cutError) Unwrap() error { return e.err }
