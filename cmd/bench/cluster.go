package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// The cluster mode is the schedule mode's batch through the whole
// router: Caddy built from ./cmd/caddy and the fake workers built from
// ./cmd/fakeworker each run as processes of their own, the bench's client
// sending one batch of --per-worker jobs per worker at once, for each
// fleet of --fleets and each strategy of --strategies, in --runs
// alternating rounds. What the router adds to the scheduler's own
// makespan (--mode schedule) is the machine: HTTP, the client's and the
// workers' CPU, and the round trips between a job's end and the next.

// clusterStrategies is what --strategies runs in the cluster mode when
// not given: the router's defaults, and Caddy's least_conn beside them.
const clusterStrategies = "least_work,caddy/least_conn"

// clusterRun is one strategy's batch on one fleet.
type clusterRun struct {
	makespan, ef, bound time.Duration
	failed              int
	routerCPU           time.Duration // the router process's CPU time over the batch
}

// benchCluster runs the cluster mode.
func benchCluster(ctx context.Context, o options, out io.Writer) error {
	dir, err := os.MkdirTemp("", "diffusion-router-cluster-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	caddy, err := clusterBinary(ctx, o.caddy, dir, "caddy")
	if err != nil {
		return err
	}
	fake, err := clusterBinary(ctx, "", dir, "fakeworker")
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "\n== cluster: one batch through the whole router, Caddy and %s fake workers as processes, median of %d alternating rounds ==\n", fmtFleets(o.fleets), o.runs)
	fmt.Fprintf(out, "jobs: %s; %d per worker at once; worker speeds %s repeated; unit %gms; warm-up %d jobs per worker first\n",
		describeMix(mixes[o.mix]), o.perWorker, fmtSpeeds(o.speeds), o.unitMs, 2)
	fmt.Fprintf(out, "÷EF, ÷bound: as in the schedule mode; router CPU: the router process's user+system time over the batch, per job\n\n")
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "workers\tjobs\tstrategy\tmakespan\t÷EF\t(range)\t÷bound\tfailed\trouter CPU/job\t")
	for _, n := range o.fleets {
		if err := clusterFleet(ctx, o, tw, caddy, fake, dir, n); err != nil {
			return err
		}
	}
	return tw.Flush()
}

// clusterBinary builds ./cmd/<name> into dir, unless path names a build.
func clusterBinary(ctx context.Context, path, dir, name string) (string, error) {
	if path != "" {
		return path, nil
	}
	bin := filepath.Join(dir, name)
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "github.com/miles-rollout/miles-diffusion-router/cmd/"+name)
	cmd.Env = buildEnv
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/%s: %v\n%s", name, err, out)
	}
	return bin, nil
}

// clusterFleet starts n fake workers, runs every strategy on them --runs
// times in turn, and writes the medians.
func clusterFleet(ctx context.Context, o options, out io.Writer, caddy, fake, dir string, n int) error {
	speeds := fleetSpeeds(o.speeds, n)
	workers, stop, err := startFakeProcesses(ctx, fake, speeds, o.unitMs)
	if err != nil {
		return err
	}
	defer stop()
	runs := make([][]clusterRun, len(o.strategies))
	for round := range o.runs {
		for i, s := range o.strategies {
			fmt.Fprintf(os.Stderr, "bench: %d workers, %s, round %d\n", n, s.name, round+1)
			r, err := clusterBatch(ctx, o, s, caddy, dir, workers, speeds)
			if err != nil {
				return fmt.Errorf("%s on %d workers: %w", s.name, n, err)
			}
			runs[i] = append(runs[i], r)
		}
	}
	for i, s := range o.strategies {
		writeClusterRow(out, n, n*o.perWorker, s.name, runs[i])
	}
	return nil
}

// startFakeProcesses runs one fake worker process per speed on a free
// port of 127.0.0.1 and waits until each answers /health.
func startFakeProcesses(ctx context.Context, bin string, speeds []float64, unitMs float64) ([]string, func(), error) {
	var cmds []*exec.Cmd
	stop := func() {
		for _, c := range cmds {
			_ = c.Process.Kill()
			_ = c.Wait()
		}
	}
	urls := make([]string, len(speeds))
	for i, s := range speeds {
		port, err := testrouter.FreePort()
		if err != nil {
			stop()
			return nil, nil, err
		}
		c := exec.Command(bin, "--port", strconv.Itoa(port), "--name", fmt.Sprintf("w%d", i+1),
			"--speed", strconv.FormatFloat(s, 'g', -1, 64), "--unit-ms", strconv.FormatFloat(unitMs, 'g', -1, 64))
		c.Stderr = os.Stderr
		if err := c.Start(); err != nil {
			stop()
			return nil, nil, err
		}
		cmds = append(cmds, c)
		urls[i] = fmt.Sprintf("http://127.0.0.1:%d", port)
	}
	for _, u := range urls {
		if err := testrouter.WaitHealthy(ctx, u, 30*time.Second); err != nil {
			stop()
			return nil, nil, err
		}
	}
	return urls, stop, nil
}

// clusterBatch starts a router process of strategy s in front of
// workers, warms it up, sends the batch, and stops it.
func clusterBatch(ctx context.Context, o options, s strategy, caddy, dir string, workers []string, speeds []float64) (clusterRun, error) {
	port, err := testrouter.FreePort()
	if err != nil {
		return clusterRun{}, err
	}
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	poolSeq++
	cfg, _, err := testrouter.Adapt([]byte(s.caddyfile([]int{port}, fmt.Sprintf("cluster%d", poolSeq), workers, o.maxInflight)), "cluster.Caddyfile")
	if err != nil {
		return clusterRun{}, err
	}
	router, err := startRouterProcess(ctx, caddy, dir, cfg, "", url)
	if err != nil {
		return clusterRun{}, err
	}
	defer router.stop()
	jobs := makeJobs(mixes[o.mix], len(workers)*o.perWorker, o.seed)
	c := newClient([]string{url}, len(jobs))
	defer c.close()
	warm := o
	warm.warmup = 2 * len(workers)
	if failed := warmup(ctx, c, warm); failed > 0 {
		return clusterRun{}, fmt.Errorf("%d warm-up jobs failed", failed)
	}
	cpu := processCPU(router.cmd.Process.Pid)
	outcomes, span := measureBatch(jobs)(ctx, c)
	r := clusterRun{makespan: span, routerCPU: processCPU(router.cmd.Process.Pid) - cpu}
	unit := time.Duration(o.unitMs * float64(time.Millisecond))
	costs := make([]float64, len(jobs))
	for i, j := range jobs {
		costs[i] = j.cost()
	}
	r.ef = earliestFinish(costs, speeds, unit)
	r.bound = time.Duration(batchBound(jobs, speeds) * float64(unit))
	for _, oc := range outcomes {
		if oc.err != nil {
			r.failed++
		}
	}
	return r, nil
}

// processCPU is the user and system time process pid has used, read from
// /proc; 0 where there is none.
func processCPU(pid int) time.Duration {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// The fields after the command's name, which is in parentheses and
	// may hold spaces: utime and stime are the 12th and 13th of them.
	_, after, ok := strings.Cut(string(stat), ") ")
	fields := strings.Fields(after)
	if !ok || len(fields) < 13 {
		return 0
	}
	utime, err1 := strconv.ParseInt(fields[11], 10, 64)
	stime, err2 := strconv.ParseInt(fields[12], 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		return 0
	}
	const ticks = 100 // USER_HZ, 100 on Linux
	return time.Duration(utime+stime) * time.Second / ticks
}

// writeClusterRow writes the medians of one strategy's runs on a fleet.
func writeClusterRow(out io.Writer, workers, jobs int, name string, runs []clusterRun) {
	var spans, ofEF, ofBound, cpu []float64
	failed := 0
	for _, r := range runs {
		spans = append(spans, r.makespan.Seconds())
		ofEF = append(ofEF, r.makespan.Seconds()/r.ef.Seconds())
		ofBound = append(ofBound, r.makespan.Seconds()/r.bound.Seconds())
		cpu = append(cpu, r.routerCPU.Seconds()/float64(jobs))
		failed += r.failed
	}
	fmt.Fprintf(out, "%d\t%d\t%s\t%s\t%.3f\t%.3f-%.3f\t%.3f\t%d\t%s\t\n", workers, jobs, name, fmtSeconds(median(spans)),
		median(ofEF), slices.Min(ofEF), slices.Max(ofEF), median(ofBound), failed, fmtSeconds(median(cpu)))
}
