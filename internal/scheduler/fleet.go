package scheduler

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
)

// Fleet runs the operations that change every worker of a pool at once:
// weight updates, sleep and wake, and bringing workers that missed an
// update to the pool's weights. One operation runs at a time. The handler
// calls these operations; it never takes the pool's lock itself.
type Fleet struct {
	pool *Pool
	ops  chan struct{} // held by the operation that runs

	// Guarded by pool.mu.
	paused  bool     // a drain is on: no job is handed out
	version string   // weight version of the last successful update
	history []Update // the last update and the LoRA calls since: what brings a worker to version
	target  string   // version an update in progress moves to

	behind atomic.Int32 // workers that joined after an update and wait to catch up
}

// Why a fleet operation did not run.
var (
	ErrFleetBusy    = errors.New("another weight update, sleep or wake is in progress")
	ErrDrainTimeout = errors.New("drain timeout")
	ErrNothingToDo  = errors.New("no worker is in the state the operation changes")
)

// Lock waits for the fleet to be free and takes it; without wait it fails
// at once with errFleetBusy when another operation runs.
func (f *Fleet) Lock(ctx context.Context, wait bool) (unlock func(), err error) {
	unlock = func() { <-f.ops }
	if !wait {
		select {
		case f.ops <- struct{}{}:
			return unlock, nil
		default:
			return nil, ErrFleetBusy
		}
	}
	select {
	case f.ops <- struct{}{}:
		return unlock, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// Update loads the weights req names on every serving or stale worker: in
// drain mode all at once after the jobs in flight finish, in rolling mode
// cfg.RollingBatch at a time while the others serve. The caller holds the
// fleet's lock.
func (f *Fleet) Update(ctx context.Context, req Update, cfg *WeightsConfig) ([]Result, error) {
	targets := f.begin(req.Version, req.Mode == ModeDrain)
	if len(targets) == 0 {
		f.end(nil, req)
		return nil, ErrNoWorker
	}
	batch := len(targets)
	if req.Mode == ModeRolling {
		batch = cfg.RollingBatch
	}
	var results []Result
	for group := range slices.Chunk(targets, batch) {
		if req.Mode == ModeRolling {
			f.setState(group, Draining)
		}
		if err := f.waitIdle(ctx, group, cfg.DrainTimeout); err != nil {
			f.setState(group, Serving)
			f.end(nil, req)
			return results, drainError(ctx, err)
		}
		f.setState(group, Updating)
		// Jobs may flow again: only workers that have loaded the new
		// weights serve, each as soon as it has, so one worker slow to
		// answer its call holds up only itself.
		f.resume()
		res := f.broadcastEach(ctx, group, req.Path, req.Body, cfg.Timeout, func(w *worker, r Result) {
			f.finishUpdate([]*worker{w}, []Result{r}, req.Version)
		})
		results = append(results, res...)
	}
	f.end(results, req)
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
func (f *Fleet) Sleep(ctx context.Context, path string, body []byte, cfg *WeightsConfig) ([]Result, error) {
	targets, err := f.inState(Serving)
	if err != nil {
		return nil, err
	}
	f.pause()
	defer f.resume()
	if err := f.waitIdle(ctx, targets, cfg.DrainTimeout); err != nil {
		return nil, drainError(ctx, err)
	}
	results := f.broadcast(ctx, targets, path, body, cfg.Timeout)
	f.moveStates(targets, results, Sleeping)
	return results, nil
}

// Wake sends path with body to the sleeping workers; those that answer
// well serve again. The caller holds the fleet's lock.
func (f *Fleet) Wake(ctx context.Context, path string, body []byte, cfg *WeightsConfig) ([]Result, error) {
	targets, err := f.inState(Sleeping)
	if err != nil {
		return nil, err
	}
	results := f.broadcast(ctx, targets, path, body, cfg.Timeout)
	f.moveStates(targets, results, Serving)
	return results, nil
}

// pause stops handing out jobs; they wait in the queue.
func (f *Fleet) pause() {
	p := f.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	f.paused = true
}

// resume hands out jobs again.
func (f *Fleet) resume() {
	p := f.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	f.paused = false
	p.dispatchLocked()
}

// begin picks the workers an update goes to (those serving and those
// stale from an earlier failed update) and, for a drain, pauses.
func (f *Fleet) begin(version string, pause bool) []*worker {
	p := f.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	var targets []*worker
	for _, w := range p.workers {
		if !w.life.dead && (w.life.state == Serving || w.life.state == Stale) {
			targets = append(targets, w)
		}
	}
	f.target, f.paused = version, pause
	return targets
}

// finishUpdate records which workers now serve version; the others are
// stale.
func (f *Fleet) finishUpdate(group []*worker, results []Result, version string) {
	p := f.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, w := range group {
		if results[i].OK {
			w.life.version, w.life.state, w.life.missed = version, Serving, false
		} else {
			w.life.state, w.life.missed = Stale, !results[i].answered
		}
	}
	p.dispatchLocked()
	p.Store().Changed()
}

// end resumes handing out jobs. After an update that succeeded anywhere it
// remembers the new version and how to reach it from the weights the
// workers started with, to bring workers that missed it there.
func (f *Fleet) end(results []Result, req Update) {
	p := f.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	if slices.ContainsFunc(results, func(r Result) bool { return r.OK }) {
		f.version = req.Version
		if req.Path == DiskUpdatePath {
			f.history = f.history[:0]
		}
		f.history = append(f.history, req)
		p.Store().Changed()
	}
	f.target, f.paused = "", false
	p.dispatchLocked()
}

// setState moves workers to state s.
func (f *Fleet) setState(workers []*worker, s State) {
	p := f.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, w := range workers {
		w.life.state = s
	}
	p.dispatchLocked()
}

// moveStates moves the workers whose call succeeded to state s.
func (f *Fleet) moveStates(workers []*worker, results []Result, s State) {
	p := f.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, w := range workers {
		if results[i].OK {
			w.life.state = s
			f.holdIfBehindLocked(w) // woken with the weights it slept on
		}
	}
	p.dispatchLocked()
}

// inState returns the workers (not held back) in state s: errNoWorker when
// the pool has none at all, errNothingToDo when none is in s.
func (f *Fleet) inState(s State) ([]*worker, error) {
	p := f.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.workers) == 0 {
		return nil, ErrNoWorker
	}
	var out []*worker
	for _, w := range p.workers {
		if !w.life.dead && w.life.state == s {
			out = append(out, w)
		}
	}
	if len(out) == 0 {
		return nil, ErrNothingToDo
	}
	return out, nil
}

// waitIdle waits until none of the workers has a job in flight.
func (f *Fleet) waitIdle(ctx context.Context, workers []*worker, timeout time.Duration) error {
	p := f.pool
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for {
		p.mu.Lock()
		if !slices.ContainsFunc(workers, func(w *worker) bool { return w.load.inflight > 0 }) {
			p.mu.Unlock()
			return nil
		}
		released := make(chan struct{})
		p.onRelease = append(p.onRelease, released)
		p.mu.Unlock()
		select {
		case <-released:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// recoveredLocked brings back a worker that was stale only because it did
// not answer its update (it was down, or restarted on its old weights):
// once a probe finds it again, it catches up as a late joiner does, before
// its first job.
func (f *Fleet) recoveredLocked(w *worker) {
	if w.life.state != Stale || !w.life.missed || f.target != "" { // not while an operation runs: it decides the state
		return
	}
	w.life.state, w.life.missed = Serving, false
	f.holdIfBehindLocked(w)
}

// holdIfBehindLocked holds a worker that missed an update (it joined
// later, slept through it, or was held back by an operator) out of
// serving until it has caught up with the pool's version.
func (f *Fleet) holdIfBehindLocked(w *worker) {
	if len(f.history) == 0 || w.life.version == f.version || w.life.behind || w.life.dead || w.life.state != Serving {
		return
	}
	w.life.state, w.life.behind = Updating, true
	f.behind.Add(1)
}

// leaveLocked forgets a worker that leaves before it caught up.
func (f *Fleet) leaveLocked(w *worker) {
	if w.life.behind {
		w.life.behind = false
		f.behind.Add(-1)
	}
}

// StartCatchUps starts bringing the workers that joined after an update to
// the pool's version, in the pool's background. It runs on requests
// rather than at provisioning, which must not dial out.
func (f *Fleet) StartCatchUps(cfg *WeightsConfig) {
	if f.behind.Load() == 0 {
		return
	}
	for _, w := range f.takeBehind() {
		f.pool.bg.Go("catch-up of "+w.url, func(ctx context.Context) { f.catchUp(ctx, w, cfg) })
	}
}

// takeBehind returns the workers waiting to catch up.
func (f *Fleet) takeBehind() []*worker {
	p := f.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []*worker
	for _, w := range p.workers {
		if w.life.behind {
			w.life.behind = false
			out = append(out, w)
		}
	}
	f.behind.Add(-int32(len(out)))
	return out
}

// catchUp brings a worker that missed updates to the pool's version
// before it gets a job, replaying the last update and the LoRA calls
// since; it is stale if one fails.
func (f *Fleet) catchUp(ctx context.Context, w *worker, cfg *WeightsConfig) {
	unlock, err := f.Lock(ctx, true) // not while another operation runs
	if err != nil {
		f.setState([]*worker{w}, Stale) // the pool is closing; never leave it updating
		return
	}
	defer unlock()
	p := f.pool
	p.mu.Lock()
	history, version := slices.Clone(f.history), f.version
	p.mu.Unlock()
	res := Result{OK: true}
	for _, req := range history {
		if res = f.post(ctx, w.url, req.Path, req.Body, cfg.Timeout); !res.OK {
			break
		}
	}
	f.finishUpdate([]*worker{w}, []Result{res}, version)
	if !res.OK {
		p.logger.Warn("worker that missed an update could not be brought to the current weights; it is stale",
			zap.String("worker", w.url), zap.String("weight_version", version), zap.Int("status", res.StatusCode))
	}
}

// Checksums asks every worker that is neither held back nor asleep for
// the checksum of its weights; not while another operation changes them.
func (f *Fleet) Checksums(ctx context.Context, body []byte, cfg *WeightsConfig) ([]Result, error) {
	unlock, err := f.Lock(ctx, true)
	if err != nil {
		return nil, err
	}
	defer unlock()
	p := f.pool
	p.mu.Lock()
	var targets []*worker
	for _, w := range p.workers {
		if !w.life.dead && w.life.state != Sleeping {
			targets = append(targets, w)
		}
	}
	p.mu.Unlock()
	if len(targets) == 0 {
		return nil, ErrNoWorker
	}
	return f.broadcast(ctx, targets, "/get_weights_checksum", body, cfg.Timeout), nil
}

// Result is one worker's answer to a fleet operation, as the Python router
// reports it.
type Result struct {
	WorkerURL  string `json:"worker_url"`
	StatusCode int    `json:"status_code"`
	Body       any    `json:"body"`
	OK         bool
	answered   bool // the worker answered at all
}

// broadcast POSTs body to path on every worker in parallel.
func (f *Fleet) broadcast(ctx context.Context, workers []*worker, path string, body []byte, timeout time.Duration) []Result {
	return f.broadcastEach(ctx, workers, path, body, timeout, nil)
}

// broadcastEach is broadcast, calling done (when not nil) with each
// worker's result as soon as it has it.
func (f *Fleet) broadcastEach(ctx context.Context, workers []*worker, path string, body []byte, timeout time.Duration, done func(*worker, Result)) []Result {
	results := make([]Result, len(workers))
	var wg sync.WaitGroup
	for i, w := range workers {
		GoSafely(&wg, f.pool.logger, path+" on "+w.url, func() {
			results[i] = f.post(ctx, w.url, path, body, timeout)
			if done != nil {
				done(w, results[i])
			}
		})
	}
	wg.Wait()
	return results
}

// maxOperationAnswer bounds a worker's answer to a fleet operation: a
// JSON object of a few fields.
const maxOperationAnswer = 1 << 20

// post sends one call to a worker and reads its JSON answer. A 2xx answer
// that says "success": false is a failure.
func (f *Fleet) post(ctx context.Context, workerURL, path string, body []byte, timeout time.Duration) Result {
	res := Result{WorkerURL: workerURL, StatusCode: http.StatusBadGateway}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, workerURL+path, bytes.NewReader(body))
	if err != nil {
		res.Body = map[string]string{"error": err.Error()}
		return res
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := f.pool.client.Do(req)
	if err != nil {
		res.Body = map[string]string{"error": err.Error()}
		return res
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(io.LimitReader(resp.Body, maxOperationAnswer))
	res.StatusCode, res.answered = resp.StatusCode, true
	if json.Unmarshal(raw, &res.Body) != nil {
		res.Body = map[string]string{"raw": string(raw)}
	}
	said, _ := res.Body.(map[string]any)
	res.OK = resp.StatusCode/100 == 2 && said["success"] != false
	return res
}

// Update modes.
const (
	ModeDrain   = "drain"
	ModeRolling = "rolling"
)

// WeightsConfig is how one diffusion_router config updates weights.
type WeightsConfig struct {
	Mode         string
	RollingBatch int
	DrainTimeout time.Duration
	Timeout      time.Duration // for one worker's update
	PathPrefixes []string
}

// Update is what the router reads of an update_weights_from_disk
// body; the body itself goes to the workers untouched.
type Update struct {
	Path      string // the workers' endpoint: update_weights_from_disk or a LoRA call
	ModelPath string
	Version   string // the weight version the workers serve once it is done
	Mode      string
	Body      []byte
}

// diskUpdatePath is where workers load new weights from disk.
const DiskUpdatePath = "/update_weights_from_disk"
