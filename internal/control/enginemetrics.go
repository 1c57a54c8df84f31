package control

import (
	"bufio"
	"bytes"
	"context"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/workerurl"
)

// GET /engine_metrics is what miles scrapes for its engines' metrics (its
// wandb forwarding reads {router}/engine_metrics), in the shape the SGLang
// model gateway gives it: every worker's Prometheus /metrics, each sample
// labelled with the worker_addr it came from.

// maxMetricsBody bounds one worker's /metrics answer.
const maxMetricsBody = 4 << 20

// engineMetricsLifetime is how long an answer of /engine_metrics is kept.
// Anyone may ask for it, and each answer calls every worker: however
// often it is asked, the workers are called at most once in this time,
// one round at a time, the callers meanwhile sharing its answer. miles
// scrapes it every few seconds or more.
const engineMetricsLifetime = 5 * time.Second

// serveEngineMetrics is GET /engine_metrics: the workers not held back,
// as they were when the answer was made.
func (a *API) serveEngineMetrics(w http.ResponseWriter, r *http.Request) {
	status, contentType, body := a.EngineMetrics.get(r.Context(), "", engineMetricsLifetime, func() (int, string, []byte) {
		var urls []string
		for _, wk := range a.Pool.Snapshot() {
			if wk.State != scheduler.Dead {
				urls = append(urls, wk.URL)
			}
		}
		return a.engineMetrics(context.WithoutCancel(r.Context()), urls)
	})
	w.Header().Set("Content-Type", contentType)
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// engineMetrics gathers the workers' metrics; a worker that does not
// answer is left out, and if none answers the answer is 503.
func (a *API) engineMetrics(ctx context.Context, urls []string) (int, string, []byte) {
	texts := make([][]byte, len(urls))
	var wg sync.WaitGroup
	for i, u := range urls {
		scheduler.GoSafely(&wg, a.Logger, "metrics of "+u, func() { texts[i], _ = a.Fleet.Get(ctx, u+"/metrics", maxMetricsBody) })
	}
	wg.Wait()
	var out bytes.Buffer
	seen := map[string]bool{} // HELP and TYPE lines, once per metric
	answered := 0
	for i, text := range texts {
		if text != nil {
			answered++
			labelSamples(&out, text, workerurl.DialAddress(urls[i]), seen)
		}
	}
	if answered == 0 && len(urls) > 0 {
		return http.StatusServiceUnavailable, "application/json", []byte(`{"error":"no worker answered /metrics"}` + "\n")
	}
	return http.StatusOK, "text/plain; version=0.0.4; charset=utf-8", out.Bytes()
}

// labelSamples copies Prometheus text to out with worker_addr="addr" added
// to every sample; HELP and TYPE lines already in seen are left out.
func labelSamples(out *bytes.Buffer, text []byte, addr string, seen map[string]bool) {
	label := `worker_addr="` + addr + `"`
	sc := bufio.NewScanner(bytes.NewReader(text))
	sc.Buffer(nil, maxMetricsBody)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "":
			continue
		case strings.HasPrefix(line, "#"):
			if seen[line] {
				continue
			}
			seen[line] = true
		case strings.IndexByte(line, '{') >= 0:
			i := strings.IndexByte(line, '{') + 1
			sep := ","
			if strings.HasPrefix(line[i:], "}") {
				sep = ""
			}
			line = line[:i] + label + sep + line[i:]
		default:
			name, rest, _ := strings.Cut(line, " ")
			line = name + "{" + label + "} " + rest
		}
		out.WriteString(line)
		out.WriteByte('\n')
	}
}
