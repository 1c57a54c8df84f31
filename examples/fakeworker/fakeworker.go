// Package fakeworker is a stand-in for an sglang-diffusion worker (`sglang
// serve` with a diffusion model) for tests, demos and benchmarks on machines
// without a GPU.
//
// It answers the worker's HTTP API with sglang's paths, field names, defaults
// and error shapes: the OpenAI-style image and video endpoints, the RL
// endpoints /v1/diffusion/generate and /rollout/generate, weight updates and
// sleep/wake. Above all it keeps the property a router must cope with: a
// worker runs one job at a time, first come first served, and a job keeps it
// busy for a time proportional to its cost (pixels × steps × frames ×
// outputs, see Cost). Generated media are zero-filled stand-ins of a
// configurable size.
//
// Errors take FastAPI's shapes, as sglang's do: {"detail": "..."} for the
// errors sglang's handlers raise, and status 422 with {"detail": [{"type",
// "loc", "msg"}]} when a request does not fit the endpoint's schema. The
// weight and memory endpoints answer {"success": false, "message": "..."}.
package fakeworker

import (
	"cmp"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Config describes a fake worker. Zero values take the defaults noted.
type Config struct {
	Name        string        // reported in the X-Fake-Worker response header and /server_info; default "fake"
	ModelPath   string        // default "fake/diffusion-model"; also the initial weight version
	TaskType    string        // T2I (default), I2I, TI2I, T2V, I2V or TI2V
	Speed       float64       // default 1; service time = cost * UnitMs / Speed
	UnitMs      float64       // milliseconds per unit of cost, default 100
	ImageBytes  int           // size of the fake image or video per output, default 1024
	FailRate    float64       // fraction of generation jobs answered 500, drawn from a rand seeded with Seed
	Seed        int64         // seed for FailRate
	HealthFail  bool          // /health answers 503
	HealthDelay time.Duration // /health waits this long before answering
	HangAfter   int           // after N finished jobs, every later job holds the worker until Close (0 = never)
	CrashAfter  int           // after N finished jobs, the next job kills the worker: listener and connections close unanswered (0 = never)
	UpdateFail  bool          // weight updates fail: 500 {"success": false}, and the old weights stay, as sglang rolls back
}

func (c Config) withDefaults() Config {
	c.Name = cmp.Or(c.Name, "fake")
	c.ModelPath = cmp.Or(c.ModelPath, "fake/diffusion-model")
	c.TaskType = cmp.Or(strings.ToUpper(c.TaskType), "T2I")
	if c.Speed <= 0 {
		c.Speed = 1
	}
	if c.UnitMs <= 0 {
		c.UnitMs = 100
	}
	if c.ImageBytes <= 0 {
		c.ImageBytes = 1024
	}
	return c
}

// Stats counts the work a worker has done. A job is finished when it
// completed or failed; HangAfter and CrashAfter count finished jobs.
type Stats struct {
	Jobs   int           // generation jobs completed successfully
	Cost   float64       // sum of the costs of those jobs
	Busy   time.Duration // time spent running generation jobs, failed and hung ones included
	Failed int           // generation jobs that ended in an injected failure
}

// Worker is a fake sglang-diffusion server. Its methods are safe for
// concurrent use.
type Worker struct {
	cfg        Config
	output     []byte // the fake image or video every output returns
	outputB64  string
	mediaToken string // stands for outputB64 in answers before it is spliced in
	// outputTensor is the rollout API's generated_output, built on first use.
	outputTensor func() mpMap
	handler      http.Handler
	slot         slotQueue

	// life ends, with cause errClosed, when the worker closes; that ends
	// queued, running and hung jobs.
	life      context.Context
	stop      context.CancelCauseFunc
	closeOnce sync.Once
	crashed   atomic.Bool
	// healthFail starts as Config.HealthFail; SetHealthFail changes it.
	healthFail atomic.Bool

	mu       sync.Mutex   // guards the fields below
	srv      *http.Server // set once serving
	url      string
	version  string
	asleep   bool
	rng      *mrand.Rand
	stats    Stats
	videos   map[string]*videoJob
	videoSeq int
}

// Cost is the work a request asks for, in units of one 1024×1024 image
// denoised for one step: (width*height/1024²) * steps * frames * outputs.
func Cost(width, height, steps, frames, outputs int) float64 {
	return float64(width) * float64(height) / (1024 * 1024) *
		float64(steps) * float64(frames) * float64(outputs)
}

// New returns a worker for cfg, with defaults applied, that is not yet
// listening; use Handler or Serve.
func New(cfg Config) *Worker {
	cfg = cfg.withDefaults()
	life, stop := context.WithCancelCause(context.Background())
	w := &Worker{
		cfg:     cfg,
		life:    life,
		stop:    stop,
		version: cfg.ModelPath,
		rng:     mrand.New(mrand.NewPCG(uint64(cfg.Seed), 0)),
		videos:  make(map[string]*videoJob),
	}
	w.output = fakeMedia(w.isVideoTask(), cfg.ImageBytes)
	w.outputB64 = base64.StdEncoding.EncodeToString(w.output)
	w.mediaToken = "media-" + newID()
	w.outputTensor = sync.OnceValue(func() mpMap { return tensorValue(max(1, cfg.ImageBytes/4)) })
	w.handler = w.routes()
	w.healthFail.Store(cfg.HealthFail)
	return w
}

// Start returns a worker for cfg serving on a free port of 127.0.0.1.
func Start(cfg Config) (*Worker, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("fakeworker: %w", err)
	}
	w := New(cfg)
	srv, err := w.attach(ln)
	if err != nil {
		return nil, err
	}
	go srv.Serve(ln) // returns http.ErrServerClosed once the worker closes
	return w, nil
}

// Serve answers requests on ln until the worker closes, by Close or by a
// CrashAfter fault, and then returns http.ErrServerClosed. Call it once.
func (w *Worker) Serve(ln net.Listener) error {
	srv, err := w.attach(ln)
	if err != nil {
		return err
	}
	return srv.Serve(ln)
}

func (w *Worker) attach(ln net.Listener) (*http.Server, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	switch {
	case w.life.Err() != nil:
		ln.Close()
		return nil, http.ErrServerClosed
	case w.srv != nil:
		return nil, errors.New("fakeworker: Serve called twice")
	}
	w.srv = &http.Server{Handler: w.handler, ReadHeaderTimeout: 10 * time.Second}
	w.url = "http://" + ln.Addr().String()
	return w.srv, nil
}

// Handler returns the worker's HTTP API, for serving it some other way.
func (w *Worker) Handler() http.Handler { return w.handler }

// URL is the worker's base URL, "http://127.0.0.1:PORT" after Start; it is
// empty until the worker serves.
func (w *Worker) URL() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.url
}

// Close stops serving, drops open connections and ends queued, running and
// hung jobs. It is idempotent.
func (w *Worker) Close() {
	w.closeOnce.Do(func() {
		w.stop(errClosed)
		w.mu.Lock()
		srv := w.srv
		w.mu.Unlock()
		if srv != nil {
			srv.Close()
		}
	})
}

// crash kills the worker as a dying process would: every connection, the
// current one included, ends without an answer.
func (w *Worker) crash() {
	w.crashed.Store(true)
	w.Close()
}

// Stats returns what the worker has done so far.
func (w *Worker) Stats() Stats {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.stats
}

// WeightVersion is the version of the loaded weights: ModelPath at first,
// then whatever the last weight update set.
func (w *Worker) WeightVersion() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.version
}

func (w *Worker) isVideoTask() bool {
	switch w.cfg.TaskType {
	case "T2V", "I2V", "TI2V":
		return true
	}
	return false
}

// serviceTime is how long work of the given cost keeps the worker busy.
func (w *Worker) serviceTime(cost float64) time.Duration {
	return time.Duration(cost * w.cfg.UnitMs / w.cfg.Speed * float64(time.Millisecond))
}

// fakeMedia is a zero-filled output of n bytes that starts like a PNG, or
// like an MP4 for video models, so that sniffers recognise it.
func fakeMedia(video bool, n int) []byte {
	magic := "\x89PNG\r\n\x1a\n"
	if video {
		magic = "\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isommp42"
	}
	b := make([]byte, n)
	copy(b, magic)
	return b
}

// SetHealthFail makes /health fail (503) or pass from now on, as a worker
// whose GPU falls over or recovers.
func (w *Worker) SetHealthFail(fail bool) { w.healthFail.Store(fail) }
