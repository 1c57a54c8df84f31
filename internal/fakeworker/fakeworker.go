// Package fakeworker is a stand-in for an sglang-diffusion worker (`sglang
// serve` with a diffusion model) for tests, demos and benchmarks on machines
// without a GPU.
//
// It answers the worker's HTTP API as sglang's source does: the same paths,
// field names, defaults, status codes and messages, for the OpenAI-style
// image and video endpoints, the native /v1/diffusion/generate, the RL
// endpoint /rollout/generate (msgpack, or the older JSON list, tensors as
// base64 safetensors), weight updates, checksums, LoRA and sleep/wake;
// docs/fake-worker.md lists every
// endpoint and what differs. Like the real server it reports no weight
// version: what a worker runs is for the router to record. Above all it keeps
// the property a router must cope with: a worker runs one job at a time,
// first come first served, and a job keeps it busy for a time proportional
// to its cost (pixels × steps × frames × outputs, see Cost). Generated media
// are zero-filled stand-ins of a configurable size.
//
// Errors take sglang's shapes: FastAPI's {"detail": ...} for the errors its
// handlers raise, status 422 with {"detail": [{"type", "loc", "msg"}]} when
// a request does not fit the endpoint's schema, 500 "Internal Server Error"
// in plain text where sglang lets an exception through, and
// {"success": false, "message"} from the weight and memory endpoints.
package fakeworker

import (
	"cmp"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"maps"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Config describes a fake worker. Zero values take the defaults noted.
type Config struct {
	Name        string        // reported in the X-Fake-Worker response header; default "fake"
	Addr        string        // host:port Start listens on; default "127.0.0.1:0", a free port
	ModelPath   string        // the model the worker serves, its id in /v1/models; default "fake/diffusion-model"
	TaskType    string        // T2I (default), I2I, TI2I, T2V, I2V or TI2V
	Speed       float64       // default 1; service time = cost * UnitMs / Speed
	UnitMs      float64       // milliseconds per unit of cost, default 100
	ImageBytes  int           // size of the fake image or video per output, default 1024
	FailRate    float64       // fraction of generation jobs answered 500, drawn from a rand seeded with Seed; SetFailRate changes it
	Seed        int64         // seed for FailRate
	HealthFail  bool          // /health answers 503
	HealthDelay time.Duration // /health waits this long before answering
	HangAfter   int           // after N finished jobs, every later job holds the worker until Close (0 = never); Hang starts it at once
	CrashAfter  int           // after N finished jobs, the next job kills the worker: listener and connections close unanswered (0 = never); Crash kills it at once
	UpdateFail  bool          // weight updates fail: 400 {"success": false}, and the old weights stay, as sglang rolls back
	UpdateHang  bool          // weight updates never end: each holds the worker until Close, /health still answering; HangUpdates starts it at once
	// RolloutJSON answers /rollout/generate with the JSON list of the
	// older rollout API (ORJSONResponse) instead of msgpack, for clients
	// and routers of that time.
	RolloutJSON bool
	// Broken answers, for gray-failure tests: the fraction of successful
	// answers of the generation endpoints broken each way (see Break),
	// drawn from the rand of Seed; 1 breaks every one. SetBreakRate
	// changes them.
	CloseRate    float64 // half the body, then the connection closes short of its Content-Length
	ResetRate    float64 // half the body, then the connection is reset (TCP RST)
	TruncateRate float64 // a complete HTTP answer whose body is cut in half, Content-Length matching
	HTMLRate     float64 // a complete 200 whose body is an HTML page labelled text/html, not the endpoint's answer
	StallRate    float64 // half the body, then silence on the open connection until the client leaves
	// OOMPixels makes every job whose width×height reaches it run out of
	// GPU memory in its first step, and fail as sglang fails such a job
	// (0 = never); SetOOMPixels changes it.
	OOMPixels int
	// CloudStorage is the base URL of the storage generated media are
	// uploaded to, as sglang does with SGLANG_CLOUD_STORAGE_TYPE=s3; a
	// medium's URL is CloudStorage/<file name>. Empty (the default): none,
	// as on a worker without storage configured, so response_format "url"
	// (the default of /v1/images/generations) answers 400.
	CloudStorage string
	// LoraSwitch is how long a LoRA call that changes the weights jobs run
	// on holds the worker: a set_lora that applies an adapter (not one
	// already in effect at that strength), a merge or an unmerge (the base
	// weights restored, the adapter merged). Calls that change nothing take
	// no time. Default 0.
	LoraSwitch time.Duration
	// PipelineName and PipelineClass are what the model card reports of
	// the pipeline sglang's registry resolved; defaults depend on the task
	// type.
	PipelineName, PipelineClass string
}

func (c Config) withDefaults() Config {
	c.Name = cmp.Or(c.Name, "fake")
	c.Addr = cmp.Or(c.Addr, "127.0.0.1:0")
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
	c.CloudStorage = strings.TrimRight(c.CloudStorage, "/")
	name, class := "flux", "FluxPipeline"
	if c.videoTask() {
		name, class = "wan", "WanPipeline"
	}
	c.PipelineName = cmp.Or(c.PipelineName, name)
	c.PipelineClass = cmp.Or(c.PipelineClass, class)
	return c
}

// Stats counts the work a worker has done. A job is finished when it
// completed or failed; HangAfter and CrashAfter count finished jobs.
type Stats struct {
	Jobs   int           // generation jobs completed successfully
	Cost   float64       // sum of the costs of those jobs
	Busy   time.Duration // time spent running generation jobs, failed and hung ones included
	Failed int           // generation jobs that ended in an injected failure (FailRate or OOMPixels)
	Broken int           // successful answers broken on purpose (CloseRate, ResetRate, TruncateRate, HTMLRate, StallRate)
	// JobsOn counts the completed jobs by the weights they ran on, as
	// Weights names them: what no answer says, for tests to check.
	JobsOn map[string]int
	// JobsOnAdapter counts the completed jobs by the LoRA adapter they ran
	// on, as AdapterHeader names it; "" counts those on the base weights.
	JobsOnAdapter map[string]int
	// LoraSwitches counts the LoRA calls that changed the weights jobs
	// run on; LoraSwitchTime is the time they held the worker
	// (LoraSwitches × Config.LoraSwitch).
	LoraSwitches   int
	LoraSwitchTime time.Duration
	// ChecksumCalls counts the get_weights_checksum calls answered.
	ChecksumCalls int
}

// Worker is a fake sglang-diffusion server. Its methods are safe for
// concurrent use.
type Worker struct {
	cfg Config
	// media returns the fake output of a file extension (jpg, png, webp,
	// mp4), built on first use.
	media      func(ext string) medium
	mediaToken string // stands for base64 media in answers before it is spliced in
	// outputTensor is the base64 safetensors file of the rollout API's
	// generated_output, built on first use.
	outputTensor func() string
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

	mu     sync.Mutex   // guards the fields below
	srv    *http.Server // set once serving
	ln     net.Listener // what srv serves on
	url    string
	asleep bool
	// failRate and hung are the job faults in force: Config.FailRate and
	// HangAfter at first, then what SetFailRate and Hang make them.
	failRate float64
	hung     bool
	// held is the end of the next job, set by Hold: it runs until the
	// channel closes rather than for its service time.
	held chan struct{}
	// updateHung is Config.UpdateHang, or set by HangUpdates.
	updateHung bool
	// breakRates are CloseRate, ResetRate, TruncateRate, HTMLRate and
	// StallRate in force, in the order of the Break constants;
	// oomPixels is OOMPixels in force.
	breakRates [5]float64
	oomPixels  int
	// weights are what each module holds: the model of the last update
	// from disk, or the tensors loaded since.
	weights map[string]moduleWeights
	lora    loraState // the LoRA adapters loaded and the one in effect
	rng     *mrand.Rand
	stats   Stats
	videos  map[string]*videoJob
	images  imageStore
	clock   func() time.Time // time.Now; tests may stop it
}

// modules are the pipeline's updatable modules, in the order sglang lists
// them for a typical pipeline.
var modules = []string{"transformer", "vae", "text_encoder"}

// outputDir is where the real server would write its outputs (its default
// output_path "outputs/"); answers name files in it.
var outputDir = func() string {
	dir, err := filepath.Abs("outputs")
	if err != nil {
		return "outputs"
	}
	return dir
}()

// medium is a fake output and its base64.
type medium struct {
	data []byte
	b64  string
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
		cfg:        cfg,
		life:       life,
		stop:       stop,
		weights:    make(map[string]moduleWeights),
		rng:        mrand.New(mrand.NewPCG(uint64(cfg.Seed), 0)),
		failRate:   cfg.FailRate,
		updateHung: cfg.UpdateHang,
		breakRates: [5]float64{cfg.CloseRate, cfg.ResetRate, cfg.TruncateRate, cfg.HTMLRate, cfg.StallRate},
		oomPixels:  cfg.OOMPixels,
		videos:     make(map[string]*videoJob),
		images:     imageStore{entries: make(map[string]*imageEntry)},
		clock:      time.Now,
	}
	for _, m := range modules {
		w.weights[m] = diskWeights(cfg.ModelPath, m)
	}
	media := make(map[string]func() medium)
	for ext, magic := range mediaMagic {
		media[ext] = sync.OnceValue(func() medium {
			b := make([]byte, cfg.ImageBytes)
			copy(b, magic)
			return medium{b, base64.StdEncoding.EncodeToString(b)}
		})
	}
	w.media = func(ext string) medium { return media[ext]() }
	w.mediaToken = "media-" + newID()
	w.outputTensor = sync.OnceValue(func() string {
		return base64.StdEncoding.EncodeToString(safetensors([]int{max(1, cfg.ImageBytes/4)}))
	})
	w.handler = w.routes()
	w.healthFail.Store(cfg.HealthFail)
	return w
}

// Start returns a worker for cfg serving on cfg.Addr, by default a free
// port of 127.0.0.1. A worker started on the address of one that closed
// stands for the same server restarted: same URL, none of its state.
func Start(cfg Config) (*Worker, error) {
	ln, err := net.Listen("tcp", cfg.withDefaults().Addr)
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
	w.ln = ln
	w.url = "http://" + ln.Addr().String()
	return w.srv, nil
}

// Handler returns the worker's HTTP API, for serving it some other way.
func (w *Worker) Handler() http.Handler { return w.handler }

// Name is the name the worker reports in its X-Fake-Worker header.
func (w *Worker) Name() string { return w.cfg.Name }

// URL is the worker's base URL, "http://127.0.0.1:PORT" after Start; it is
// empty until the worker serves.
func (w *Worker) URL() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.url
}

// Close stops serving, drops open connections and ends queued, running and
// hung jobs. Its address is free once it returns, for a worker started
// again there. It is idempotent.
func (w *Worker) Close() {
	w.closeOnce.Do(func() {
		w.stop(errClosed)
		w.mu.Lock()
		srv, ln := w.srv, w.ln
		w.mu.Unlock()
		if srv != nil {
			srv.Close()
			// srv.Close misses a listener Serve has not yet taken up.
			ln.Close()
		}
	})
}

// Config is the worker's config, defaults applied. Its Addr is what Start
// was given, not the port it picked.
func (w *Worker) Config() Config { return w.cfg }

// Crash kills the worker as a dying process would: the listener and every
// connection close without an answer, and jobs in flight are lost.
func (w *Worker) Crash() {
	w.crashed.Store(true)
	w.Close()
}

// Stats returns what the worker has done so far.
func (w *Worker) Stats() Stats {
	w.mu.Lock()
	defer w.mu.Unlock()
	s := w.stats
	s.JobsOn = maps.Clone(s.JobsOn)
	s.JobsOnAdapter = maps.Clone(s.JobsOnAdapter)
	return s
}

// Asleep reports whether the worker's memory occupation is released. The
// HTTP API does not report it but in the answer to a sleep or a wake;
// tests use it to see what a worker is.
func (w *Worker) Asleep() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.asleep
}

// Weights names the transformer's weights: ModelPath at first, then the
// model_path of the last successful update from disk, or, once tensors
// were loaded since, "tensor:" and the transformer's checksum (see
// Checksum). The HTTP API does not report it, as sglang does not; tests
// use it to see what a worker runs.
func (w *Worker) Weights() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.weights["transformer"].label
}

func (c Config) videoTask() bool {
	switch c.TaskType {
	case "T2V", "I2V", "TI2V":
		return true
	}
	return false
}

func (w *Worker) isVideoTask() bool { return w.cfg.videoTask() }

// serviceTime is how long work of the given cost keeps the worker busy.
func (w *Worker) serviceTime(cost float64) time.Duration {
	return time.Duration(cost * w.cfg.UnitMs / w.cfg.Speed * float64(time.Millisecond))
}

// mediaMagic starts the zero-filled fake output of each file extension, so
// that sniffers recognise it.
var mediaMagic = map[string]string{
	"jpg":  "\xff\xd8\xff\xe0\x00\x10JFIF\x00",
	"png":  "\x89PNG\r\n\x1a\n",
	"webp": "RIFF\x00\x00\x00\x00WEBPVP8 ",
	"mp4":  "\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isommp42",
}

// SetHealthFail makes /health fail (503) or pass from now on, as a worker
// whose GPU falls over or recovers.
func (w *Worker) SetHealthFail(fail bool) { w.healthFail.Store(fail) }

// SetFailRate makes that fraction of the jobs that get the worker from now
// on fail with the injected scheduler error, as Config.FailRate does from
// the start; 0 ends the failures.
func (w *Worker) SetFailRate(rate float64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.failRate = rate
}

// Hang makes every job that gets the worker from now on hold it until the
// worker closes, as HangAfter does once reached: the GPU is stuck while
// the HTTP server, /health included, still answers. Only a restart (Close,
// then Start on the same address) ends it, as with a real process.
func (w *Worker) Hang() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.hung = true
}

// Hold makes the next job that gets the worker run until release is
// called, instead of for its service time: a job whose end the test
// decides, behind which others queue for as long as the test needs. The
// jobs after it run as before. release may be called more than once.
func (w *Worker) Hold() (release func()) {
	end := make(chan struct{})
	w.mu.Lock()
	defer w.mu.Unlock()
	w.held = end
	return sync.OnceFunc(func() { close(end) })
}

// HangUpdates makes every weight update from now on (from disk or from
// tensors) hold the worker until it closes, as Config.UpdateHang does from
// the start: the load never ends, so its caller gets no answer, and the
// jobs queued behind it wait as they would behind a stuck GPU, while
// /health still answers. Only a restart ends it.
func (w *Worker) HangUpdates() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.updateHung = true
}
