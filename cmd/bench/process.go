package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// buildEnv is the environment the bench started with, before run moved
// HOME and the XDG directories: the go command finds its build cache
// through it.
var buildEnv = os.Environ()

// buildCaddy builds the repository's Caddy (./cmd/caddy) into dir; with the
// build cache warm it takes seconds. It names the package by its import
// path, so that it builds from any folder of the repository.
func buildCaddy(ctx context.Context, dir string) (string, error) {
	bin := filepath.Join(dir, "caddy")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "github.com/miles-rollout/miles-diffusion-router/cmd/caddy")
	cmd.Env = buildEnv
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/caddy: %v\n%s", err, out)
	}
	return bin, nil
}

// caddyGlobals is the global options block of a Caddy the bench runs as a
// process: its admin API on 127.0.0.1:admin, no HTTPS, its config not
// saved, listening on 127.0.0.1 only, its storage in the folder storage,
// and the options in extra.
func caddyGlobals(admin int, storage, extra string) string {
	return fmt.Sprintf("{\n\tadmin 127.0.0.1:%d\n\tauto_https off\n\tpersist_config off\n\tdefault_bind 127.0.0.1\n\tstorage file_system %s\n%s}\n",
		admin, storage, extra)
}

// routerProcess is Caddy run as a process of its own with its admin API on
// 127.0.0.1, so that the memory, goroutines and open files measured are the
// router's alone, not those of the fake workers and clients in the bench.
type routerProcess struct {
	cmd    *exec.Cmd
	admin  string        // the admin API's base URL
	exited chan struct{} // closed when the process has exited
	err    error         // why it exited; read after exited closes
}

// startRouterProcess runs bin on cfg, Caddy's JSON config, whose admin API
// listens at admin, and waits until GET url/health answers 200 for each of
// urls. Caddy's log goes to the bench's standard error.
func startRouterProcess(ctx context.Context, bin, dir string, cfg []byte, admin string, urls ...string) (*routerProcess, error) {
	file := filepath.Join(dir, "router.json")
	if err := os.WriteFile(file, cfg, 0o600); err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, "run", "--config", file)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &routerProcess{cmd: cmd, admin: admin, exited: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.exited)
	}()
	for _, url := range urls {
		if err := testrouter.WaitHealthy(ctx, url, 30*time.Second); err != nil {
			return nil, errors.Join(err, p.stop())
		}
	}
	return p, nil
}

// load replaces the router's config through the admin API. Caddy skips a
// config equal to the one it runs unless asked to revalidate, so the same
// config is reloaded too, as `caddy reload --force` does.
func (p *routerProcess) load(ctx context.Context, cfg []byte) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.admin+"/load", bytes.NewReader(cfg))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Cache-Control", "must-revalidate")
	_, err = adminCall(req)
	return err
}

// processStats is what the router process holds.
type processStats struct {
	rss        float64 // resident memory, bytes
	heap       float64 // heap in use, bytes
	goroutines float64
	files      float64 // open file descriptors, sockets included
}

// stats collects garbage in the router process, then reads its memory,
// goroutines and open files from the Go and process collectors of Caddy's
// metrics.
func (p *routerProcess) stats(ctx context.Context) (processStats, error) {
	// The heap profile endpoint runs a garbage collection first when
	// asked to.
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.admin+"/debug/pprof/heap?gc=1", nil)
	if err != nil {
		return processStats{}, err
	}
	if _, err := adminCall(req); err != nil {
		return processStats{}, err
	}
	m, err := p.metrics(ctx)
	if err != nil {
		return processStats{}, err
	}
	return m.process(), nil
}

// process reads what the process holds from the samples of the Go and
// process collectors.
func (m metrics) process() processStats {
	return processStats{
		rss:        m.sum("process_resident_memory_bytes", ""),
		heap:       m.sum("go_memstats_heap_inuse_bytes", ""),
		goroutines: m.sum("go_goroutines", ""),
		files:      m.sum("process_open_fds", ""),
	}
}

// metrics scrapes the router's metrics from the admin API.
func (p *routerProcess) metrics(ctx context.Context) (metrics, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.admin+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	body, err := adminCall(req)
	if err != nil {
		return nil, err
	}
	return parseMetrics(body), nil
}

// stop asks the router to shut down gracefully and waits for it, killing
// it if it takes longer than ten seconds.
func (p *routerProcess) stop() error {
	p.cmd.Process.Signal(os.Interrupt)
	select {
	case <-p.exited:
	case <-time.After(10 * time.Second):
		p.cmd.Process.Kill()
		<-p.exited
		return errors.New("the router did not stop within 10s of SIGINT; killed")
	}
	return nil
}

// kill ends the router with SIGKILL, as a node's crash or the OOM killer
// does, and waits until it has exited.
func (p *routerProcess) kill() {
	_ = p.cmd.Process.Kill()
	<-p.exited
}

func adminCall(req *http.Request) ([]byte, error) {
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s %s: %s: %.300s", req.Method, req.URL.Path, resp.Status, body)
	}
	return body, nil
}

// metrics are the samples of a Prometheus text exposition, each a metric
// name with its labels as written, such as `x_total{pool="a",cause="b"}`.
type metrics map[string]float64

func parseMetrics(text []byte) metrics {
	m := make(metrics)
	sc := bufio.NewScanner(bytes.NewReader(text))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		if v, err := strconv.ParseFloat(line[i+1:], 64); err == nil {
			m[line[:i]] = v
		}
	}
	return m
}

// sum adds up the samples of the metric name whose labels include label
// (such as `cause="status"`; empty for all).
func (m metrics) sum(name, label string) float64 {
	var total float64
	for series, v := range m {
		base, labels, _ := strings.Cut(series, "{")
		if base == name && strings.Contains(labels, label) {
			total += v
		}
	}
	return total
}
