// Package fleet runs the operations that change every worker of a pool at
// once: weight updates, LoRA calls, sleep and wake, bringing workers that
// missed an update to the pool's weights, and the pool's record in
// storage, and learns what each worker can generate from its /v1/models.
// It makes the router's own calls to the workers; the scheduler keeps the
// states the operations move them through, under the pool's lock, which
// this package never holds.
package fleet

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
	"github.com/miles-rollout/miles-diffusion-router/internal/workerurl"
)

// Fleet runs a pool's fleet operations, one at a time, and makes the
// router's own calls to its workers.
type Fleet struct {
	pool   Operated
	logger *zap.Logger
	turn   chan struct{} // held by the operation that runs; taken before the store's locks and the pool's
	client *http.Client  // for the router's own calls to workers
	guard  atomic.Pointer[workerurl.Guard]
	active atomic.Pointer[func() bool] // whether this router may call its workers; unset: always

	mu   sync.Mutex // guards last
	last *Report    // the operation running or run last

	probes probes // capability probes requests wait for
}

// New returns the fleet of pool, which logs to logger.
func New(pool Operated, logger *zap.Logger) *Fleet {
	f := &Fleet{pool: pool, logger: logger, turn: make(chan struct{}, 1), probes: probes{running: make(map[string]chan struct{})}}
	f.client = workerurl.GuardedClient(func() *workerurl.Guard { return f.guard.Load() })
	return f
}

// UseGuard makes the router's own calls to workers check their addresses
// with g: the guard of the config loaded last.
func (f *Fleet) UseGuard(g *workerurl.Guard) {
	f.guard.Store(g)
}

// OnlyWhile makes the catch-ups that are yet to call a worker give up
// once active reports false: a router that no longer leads its group
// calls no worker, lest it replay old updates onto one the active router
// has moved on.
func (f *Fleet) OnlyWhile(active func() bool) {
	f.active.Store(&active)
}

// mayCall reports whether this router may call its workers now.
func (f *Fleet) mayCall() bool {
	active := f.active.Load()
	return active == nil || (*active)()
}

// Client is the HTTP client of the router's own calls to workers.
func (f *Fleet) Client() *http.Client { return f.client }

// Close drops the idle connections to the workers: the pool is done with.
func (f *Fleet) Close() {
	f.probes.wg.Wait() // each ends within probeTimeout
	f.client.CloseIdleConnections()
}

// Config is how one diffusion_router config runs fleet operations.
type Config struct {
	Mode         string // scheduler.ModeDrain or scheduler.ModeRolling
	RollingBatch int
	DrainTimeout time.Duration
	Timeout      time.Duration // for one worker's call
	PathPrefixes []string      // where workers may load weights from; none: anywhere

	// Health says when a job hangs: a drain leaves out the worker of a
	// job it takes for stalled rather than wait for it. nil: never.
	Health *scheduler.HealthConfig
}

// Why a fleet operation did not run.
var (
	ErrFleetBusy    = errors.New("another fleet operation (a weight update, sleep, wake, pause or continue) is in progress")
	ErrDrainTimeout = errors.New("drain timeout")
)

// Lock waits for the fleet to be free and takes it; without wait it fails
// at once with ErrFleetBusy when another operation runs.
func (f *Fleet) Lock(ctx context.Context, wait bool) (unlock func(), err error) {
	unlock = func() { <-f.turn }
	if !wait {
		select {
		case f.turn <- struct{}{}:
			return unlock, nil
		default:
			return nil, ErrFleetBusy
		}
	}
	select {
	case f.turn <- struct{}{}:
		return unlock, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// Update loads the weights req names on every serving or stale worker: in
// drain mode all at once after the jobs in flight finish, in rolling mode
// cfg.RollingBatch at a time while the others serve. The caller holds the
// fleet's lock.
func (f *Fleet) Update(ctx context.Context, req scheduler.Update, cfg *Config) ([]Result, error) {
	p := f.pool
	targets, done := p.BeginUpdate(req)
	results := alreadyOn(done, req.Version)
	if len(targets) == 0 {
		p.EndUpdate(req, len(done) > 0)
		if len(done) == 0 {
			return nil, scheduler.ErrNoWorker
		}
		return results, nil
	}
	batch := len(targets)
	if req.Mode == scheduler.ModeRolling {
		batch = cfg.RollingBatch
	}
	for group := range slices.Chunk(targets, batch) {
		if req.Mode == scheduler.ModeRolling {
			p.SetStates(group, scheduler.Draining)
		}
		hung, err := p.WaitIdle(ctx, group, cfg.DrainTimeout, cfg.Health)
		if err != nil {
			p.SetStates(group, scheduler.Serving)
			p.EndUpdate(req, false)
			return results, drainError(ctx, err)
		}
		p.LeaveOut(hung)
		results = append(results, leftOut(hung)...)
		group = without(group, hung)
		p.SetStates(group, scheduler.Updating)
		// Jobs may flow again: only workers that have loaded the new
		// weights serve, each as soon as it has, so one worker slow to
		// answer its call holds up only itself.
		p.ReleaseJobs()
		res := f.broadcastEach(ctx, group, req.Path, req.Body, cfg.Timeout, func(r Result) {
			p.FinishUpdate(r.WorkerURL, req.Version, r.OK, r.answered)
		})
		results = append(results, res...)
	}
	p.EndUpdate(req, slices.ContainsFunc(results, func(r Result) bool { return r.OK }))
	return results, nil
}

// drainError tells a drain that ran out of time from a caller that left.
func drainError(ctx context.Context, err error) error {
	if errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
		return ErrDrainTimeout
	}
	return err
}

// Sleep drains the serving workers and sends each path with body, which
// releases its GPU memory; those that answer well are sleeping. The caller
// holds the fleet's lock.
func (f *Fleet) Sleep(ctx context.Context, path string, body []byte, cfg *Config) ([]Result, error) {
	p := f.pool
	targets, err := p.InState(scheduler.Serving)
	if err != nil {
		return nil, err
	}
	p.HoldJobs()
	defer p.ReleaseJobs()
	hung, err := p.WaitIdle(ctx, targets, cfg.DrainTimeout, cfg.Health)
	if err != nil {
		return nil, drainError(ctx, err)
	}
	results := f.broadcast(ctx, without(targets, hung), path, body, cfg.Timeout)
	p.Moved(succeededOn(results), scheduler.Sleeping)
	return append(results, leftOut(hung)...), nil
}

// alreadyOn is the result of each of the workers a retried update found
// on its version already.
func alreadyOn(urls []string, version string) []Result {
	out := make([]Result, len(urls))
	for i, u := range urls {
		out[i] = doneWithoutCall(u, "already on weight version "+version+": this router finished the update its predecessor had in progress, and did not call the worker again")
	}
	return out
}

// leftOut is the result of each of the workers an operation left out
// because a job of theirs hung.
func leftOut(hung []string) []Result {
	out := make([]Result, len(hung))
	for i, u := range hung {
		out[i] = Result{WorkerURL: u, StatusCode: http.StatusGatewayTimeout, Body: map[string]string{
			"error": "left out: a job on this worker overran its predicted time many times over (hung); it is brought to the fleet's weights once that job ends",
		}}
	}
	return out
}

// without returns urls but those in leave, in a new slice.
func without(urls, leave []string) []string {
	return slices.DeleteFunc(slices.Clone(urls), func(u string) bool { return slices.Contains(leave, u) })
}

// Wake sends path with body to every worker not held back, not only to
// those the router believes asleep: a worker put to sleep behind its
// back, or registered again while asleep, looks serving, and a wake of a
// worker that is awake changes nothing (sglang-diffusion answers "already
// awake"). Those that answer well serve. The caller holds the fleet's
// lock.
func (f *Fleet) Wake(ctx context.Context, path string, body []byte, cfg *Config) ([]Result, error) {
	targets, err := f.pool.NotHeldBack()
	if err != nil {
		return nil, err
	}
	results := f.broadcast(ctx, targets, path, body, cfg.Timeout)
	f.pool.Moved(succeededOn(results), scheduler.Serving)
	return results, nil
}

// succeededOn names the workers whose call succeeded.
func succeededOn(results []Result) []string {
	var urls []string
	for _, r := range results {
		if r.OK {
			urls = append(urls, r.WorkerURL)
		}
	}
	return urls
}

// StartCatchUps starts bringing the workers that missed an update to the
// pool's version, in the pool's background. It runs on requests and on
// passed health probes, rather than at provisioning, which must not dial
// out: a worker found again catches up whether or not jobs come.
func (f *Fleet) StartCatchUps(cfg *Config) {
	if !f.pool.AnyBehind() {
		return
	}
	for _, u := range f.pool.TakeBehind() {
		f.pool.Go("catch-up of "+u, func(ctx context.Context) { f.catchUp(ctx, u, cfg) })
	}
}

// catchUp brings a worker that missed updates to the pool's version
// before it gets a job, replaying the last update and the LoRA calls
// since; it stays stale if one fails.
func (f *Fleet) catchUp(ctx context.Context, workerURL string, cfg *Config) {
	p := f.pool
	unlock, err := f.Lock(ctx, true) // not while another operation runs
	if err != nil {
		return // the pool is closing; the worker stays stale
	}
	defer unlock()
	if !f.mayCall() {
		f.logger.Info("catch-up not run: this router no longer leads its group, whose active router catches the worker up", zap.String("worker", workerURL))
		return
	}
	plan, ok := p.BeginCatchUp(workerURL)
	switch {
	case !ok:
		return
	case plan.Checksums != nil:
		f.checkCatchUp(ctx, workerURL, plan, cfg)
		return
	}
	version := plan.Version
	res := Result{OK: true}
	for _, req := range plan.Replay {
		if res = f.post(ctx, workerURL, req.Path, req.Body, cfg.Timeout); !res.OK {
			break
		}
	}
	// A 5xx says the worker's server failed the call (it raised, or it
	// was shutting down to restart), not that the weights cannot load
	// there: the worker is caught up again at its next passed probe.
	p.FinishUpdate(workerURL, version, res.OK, res.answered && res.StatusCode < 500)
	if !res.OK {
		f.logger.Warn("worker that missed an update could not be brought to the current weights; it is stale",
			zap.String("worker", workerURL), zap.String("weight_version", version), zap.Int("status", res.StatusCode))
	}
}

// Checksums asks every worker that is neither held back nor asleep for
// the checksum of its weights; not while another operation changes them.
func (f *Fleet) Checksums(ctx context.Context, body []byte, cfg *Config) ([]Result, error) {
	unlock, err := f.Lock(ctx, true)
	if err != nil {
		return nil, err
	}
	defer unlock()
	targets := f.pool.Awake()
	if len(targets) == 0 {
		return nil, scheduler.ErrNoWorker
	}
	return f.broadcast(ctx, targets, "/get_weights_checksum", body, cfg.Timeout), nil
}

// Result is one worker's answer to a fleet operation, as the Python router
// reports it.
type Result struct {
	WorkerURL  string `json:"worker_url"`
	StatusCode int    `json:"status_code"`
	Body       any    `json:"body"`
	OK         bool   `json:"-"` // the worker did what was asked
	answered   bool   // the worker answered at all
}

// broadcast POSTs body to path on every worker in parallel.
func (f *Fleet) broadcast(ctx context.Context, urls []string, path string, body []byte, timeout time.Duration) []Result {
	return f.broadcastEach(ctx, urls, path, body, timeout, nil)
}

// broadcastEach is broadcast, calling done (when not nil) with each
// worker's result as soon as it has it.
func (f *Fleet) broadcastEach(ctx context.Context, urls []string, path string, body []byte, timeout time.Duration, done func(Result)) []Result {
	results := make([]Result, len(urls))
	var wg sync.WaitGroup
	for i, u := range urls {
		scheduler.GoSafely(&wg, f.logger, path+" on "+u, func() {
			results[i] = f.post(ctx, u, path, body, timeout)
			if done != nil {
				done(results[i])
			}
		})
	}
	wg.Wait()
	return results
}

// maxAnswer bounds a worker's answer to a fleet operation: a JSON object
// of a few fields.
const maxAnswer = 1 << 20

// post sends one call to a worker and reads its JSON answer, within
// timeout (0: ctx alone bounds it). A 2xx answer that says "success":
// false is a failure.
func (f *Fleet) post(ctx context.Context, workerURL, path string, body []byte, timeout time.Duration) Result {
	res := Result{WorkerURL: workerURL, StatusCode: http.StatusBadGateway}
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, workerURL+path, bytes.NewReader(body))
	if err != nil {
		res.Body = map[string]any{"error": err.Error()}
		return res
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := f.client.Do(req)
	if err != nil {
		res.Body = map[string]any{"error": err.Error()}
		return res
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(io.LimitReader(resp.Body, maxAnswer))
	res.StatusCode, res.answered = resp.StatusCode, true
	if json.Unmarshal(raw, &res.Body) != nil {
		res.Body = map[string]string{"raw": string(raw)}
	}
	said, _ := res.Body.(map[string]any)
	res.OK = resp.StatusCode/100 == 2 && said["success"] != false
	return res
}
