package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/etcdtest"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// The failover mode: two routers of one pool (`ha etcd`, a real etcd) as
// processes of their own behind a Caddy reverse_proxy that checks
// /readyz, as a Kubernetes Service in front of two replicas would; clients
// that retry as miles does (any error, 1 s apart, 60 times) send a steady
// load through the proxy while the active router is killed with SIGKILL
// --kills times, a new standby started in its place after each kill. It
// reports how long the standby took to answer /readyz 200 after each kill,
// and what the clients saw.

// failoverBody is the job the clients send: a small image, 2 steps.
const failoverBody = `{"prompt":"a cat","size":"256x256","num_inference_steps":2,"response_format":"b64_json"}`

// failover is one run of the mode.
type failover struct {
	o       options
	bin     string
	dir     string
	etcd    *etcdtest.Server
	fleet   testrouter.Fleet
	routers [2]*haRouter
	front   *routerProcess
	port    int // the front's port
}

// haRouter is one router of the group, in a slot the front proxies to.
type haRouter struct {
	port, admin int
	proc        *routerProcess
}

func (r *haRouter) url() string { return fmt.Sprintf("http://127.0.0.1:%d", r.port) }

// failoverResult is what the run measured.
type failoverResult struct {
	takeovers            []time.Duration
	sent, answered, lost int64
	retried              int64
	elapsed              time.Duration
	lastLoss             string // the last lost request's answer
}

// benchFailover runs the failover mode and prints its report.
func benchFailover(ctx context.Context, o options, out io.Writer) error {
	dir, err := os.MkdirTemp("", "diffusion-router-failover-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	f := &failover{o: o, dir: dir, bin: o.caddy}
	defer f.close()
	if err := f.start(ctx); err != nil {
		return err
	}
	r, err := f.run(ctx)
	if err != nil {
		return err
	}
	f.report(out, r)
	return nil
}

// start builds Caddy if need be and starts etcd, the workers, both
// routers (the first leading) and the front.
func (f *failover) start(ctx context.Context) error {
	var err error
	if f.bin == "" {
		fmt.Fprintln(os.Stderr, "failover: building ./cmd/caddy")
		if f.bin, err = buildCaddy(ctx, f.dir); err != nil {
			return err
		}
	}
	if f.etcd, err = etcdtest.Launch(filepath.Join(f.dir, "etcd")); err != nil {
		return err
	}
	if f.fleet, err = testrouter.StartFleet(f.o.speeds, f.o.unitMs); err != nil {
		return err
	}
	for i := range f.routers {
		r := &haRouter{}
		if r.port, err = testrouter.FreePort(); err != nil {
			return err
		}
		if r.admin, err = testrouter.FreePort(); err != nil {
			return err
		}
		f.routers[i] = r
		if err := f.startRouter(ctx, i); err != nil {
			return err
		}
		if i == 0 && !testkit.WaitUntil(30*time.Second, func() bool { return ready(r.url()) }) {
			return errors.New("the first router did not lead within 30 s")
		}
	}
	return f.startFront(ctx)
}

// startRouter starts the router of slot i and waits until Caddy answers.
func (f *failover) startRouter(ctx context.Context, i int) error {
	r := f.routers[i]
	storage := filepath.Join(f.dir, fmt.Sprintf("storage-%d", i))
	text := caddyGlobals(r.admin, storage, "\tlog {\n\t\tlevel ERROR\n\t}\n") + fmt.Sprintf(`:%d {
	diffusion_router bench-ha {
		workers %s
		health_interval 250ms
		ha etcd %s {
			lease_ttl %s
			advertise %s
		}
	}
}
`, r.port, strings.Join(f.fleet.URLs(), " "),
		f.etcd.Endpoint, f.o.leaseTTL, r.url())
	cfg, _, err := testrouter.Adapt([]byte(text), "")
	if err != nil {
		return err
	}
	dir := filepath.Join(f.dir, fmt.Sprintf("router-%d", i))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	if r.proc, err = startRouterProcess(ctx, f.bin, dir, cfg, fmt.Sprintf("http://127.0.0.1:%d", r.admin)); err != nil {
		return err
	}
	if !testkit.WaitUntil(30*time.Second, func() bool { return answers(r.url() + "/healthz") }) {
		return fmt.Errorf("router %d did not answer /healthz within 30 s", i)
	}
	return nil
}

// startFront starts the reverse_proxy in front of both routers.
func (f *failover) startFront(ctx context.Context) error {
	admin, err := testrouter.FreePort()
	if err != nil {
		return err
	}
	if f.port, err = testrouter.FreePort(); err != nil {
		return err
	}
	// Its log would show the 502s and 503s of the kills, which the clients count.
	text := caddyGlobals(admin, filepath.Join(f.dir, "storage-front"), "\tlog {\n\t\toutput discard\n\t}\n") + fmt.Sprintf(`:%d {
	reverse_proxy %s %s {
		lb_policy first
		health_uri /readyz
		health_interval 200ms
		health_timeout 1s
	}
}
`, f.port, f.routers[0].url(), f.routers[1].url())
	cfg, _, err := testrouter.Adapt([]byte(text), "")
	if err != nil {
		return err
	}
	dir := filepath.Join(f.dir, "front")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	f.front, err = startRouterProcess(ctx, f.bin, dir, cfg, fmt.Sprintf("http://127.0.0.1:%d", admin), f.frontURL())
	return err
}

func (f *failover) frontURL() string { return fmt.Sprintf("http://127.0.0.1:%d", f.port) }

// run sends the load and kills the leader --kills times.
func (f *failover) run(ctx context.Context) (failoverResult, error) {
	var r failoverResult
	var miles testkit.Miles
	var sent, answered, lost atomic.Int64
	var mu sync.Mutex
	stop := make(chan struct{})
	var clients sync.WaitGroup
	for range f.o.clients {
		clients.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				sent.Add(1)
				status, _, text := miles.Post(f.frontURL()+"/v1/images/generations", failoverBody)
				if status == http.StatusOK {
					answered.Add(1)
					continue
				}
				lost.Add(1)
				mu.Lock()
				r.lastLoss = fmt.Sprintf("%d %.200s", status, text)
				mu.Unlock()
			}
		})
	}
	start := time.Now()
	err := f.kills(ctx, &r)
	close(stop)
	clients.Wait()
	r.elapsed = time.Since(start)
	r.sent, r.answered, r.lost, r.retried = sent.Load(), answered.Load(), lost.Load(), miles.Retries()
	return r, err
}

// kills kills the leader --kills times, a steady second of load before
// each, and records how long the standby took to be ready.
func (f *failover) kills(ctx context.Context, r *failoverResult) error {
	limit := 3*f.o.leaseTTL + 10*time.Second
	for k := range f.o.kills {
		if err := sleepCtx(ctx, time.Second); err != nil {
			return err
		}
		leader := slices.IndexFunc(f.routers[:], func(h *haRouter) bool { return ready(h.url()) })
		if leader < 0 {
			return fmt.Errorf("kill %d: no router is ready", k+1)
		}
		standby := f.routers[1-leader]
		f.routers[leader].proc.kill()
		killed := time.Now()
		if !testkit.WaitUntil(limit, func() bool { return ready(standby.url()) }) {
			return fmt.Errorf("kill %d: the standby was not ready within %s", k+1, limit)
		}
		r.takeovers = append(r.takeovers, time.Since(killed))
		fmt.Fprintf(os.Stderr, "failover: kill %d: the standby led after %s\n", k+1, r.takeovers[k].Round(time.Millisecond))
		if err := f.startRouter(ctx, leader); err != nil {
			return fmt.Errorf("kill %d: starting a new standby: %w", k+1, err)
		}
	}
	return nil
}

// report prints the takeovers and what the clients saw.
func (f *failover) report(out io.Writer, r failoverResult) {
	sorted := slices.Sorted(slices.Values(r.takeovers))
	fmt.Fprintf(out, "failover: %d kills (SIGKILL) of the active router, lease_ttl %s, %d clients retrying as miles does, %d workers\n",
		len(r.takeovers), f.o.leaseTTL, f.o.clients, len(f.fleet))
	if len(sorted) > 0 {
		fmt.Fprintf(out, "  time to take over (kill → standby's /readyz 200): median %s, max %s\n",
			sorted[len(sorted)/2].Round(time.Millisecond), sorted[len(sorted)-1].Round(time.Millisecond))
	}
	fmt.Fprintf(out, "  requests: %d sent, %d answered 200, %d lost (failed 60 attempts), %d attempts retried, over %s\n",
		r.sent, r.answered, r.lost, r.retried, r.elapsed.Round(time.Second))
	if r.lost > 0 {
		fmt.Fprintf(out, "  last loss: %s\n", r.lastLoss)
	}
}

// close stops the front, the routers, the workers and etcd.
func (f *failover) close() {
	procs := []*routerProcess{f.front}
	for _, r := range f.routers {
		if r != nil {
			procs = append(procs, r.proc)
		}
	}
	for _, p := range procs {
		if p != nil {
			p.kill()
		}
	}
	f.fleet.Close()
	if f.etcd != nil {
		f.etcd.Stop()
	}
}

// ready reports whether url answers /readyz 200: the pool's active router.
func ready(url string) bool { return answers(url + "/readyz") }

// answers reports whether GET url answers 200.
func answers(url string) bool {
	resp, err := http.Get(url)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}
