package fleet

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"slices"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// Declaration is a trainer's word that workers hold a weight version it
// moved into them itself, past the router (POST /update_weight_version).
type Declaration struct {
	Version string
	// Workers are those that hold it; nil: the paused workers, or with
	// none paused every worker an operator has not held back.
	Workers []string
	// Checksums, when given, are the SHA-256 each module's weights must
	// have on a worker, as its /get_weights_checksum reports them: a
	// worker that does not answer them is not taken to hold Version.
	Checksums map[string]string
}

// checksumPath is where a worker reports its weights' checksums.
const checksumPath = "/get_weights_checksum"

// Declare records d: each worker named holds d.Version, or with checksums
// each whose checksums match; the others are stale until a later
// declaration or an update through the router. The fleet's version
// becomes d.Version. The caller holds the fleet's lock.
func (f *Fleet) Declare(ctx context.Context, d Declaration, cfg *Config) ([]Result, error) {
	targets, err := f.declared(d.Workers)
	if err != nil {
		return nil, err
	}
	results := make([]Result, len(targets))
	on := make(map[string]string, len(targets))
	var off []string
	if d.Checksums == nil {
		for i, u := range targets {
			results[i] = holds(u, d.Version, scheduler.SourceDeclared)
			on[u] = scheduler.SourceDeclared
		}
	} else {
		modules := slices.Sorted(maps.Keys(d.Checksums))
		body, _ := json.Marshal(map[string][]string{"module_names": modules}) // strings always marshal
		for i, res := range f.broadcast(ctx, targets, checksumPath, body, cfg.Timeout) {
			results[i] = verify(res, d, modules)
			if results[i].OK {
				on[res.WorkerURL] = scheduler.SourceVerified
			} else {
				off = append(off, res.WorkerURL)
			}
		}
	}
	f.pool.DeclareVersion(d.Version, on, off)
	return results, nil
}

// declared returns the workers a declaration names: urls, or with none
// named the paused workers, or with none paused every worker not held
// back (ErrNoWorker when there is none).
func (f *Fleet) declared(urls []string) ([]string, error) {
	if urls != nil {
		return urls, nil
	}
	if paused := f.pool.PausedWorkers(); len(paused) > 0 {
		return paused, nil
	}
	return f.pool.NotHeldBack()
}

// holds is the result of a worker taken to hold version, learned as
// source says.
func holds(workerURL, version, source string) Result {
	return Result{WorkerURL: workerURL, StatusCode: http.StatusOK, OK: true, answered: true,
		Body: map[string]any{"weight_version": version, "source": source}}
}

// verify is the result of a worker whose answer to the checksum call is
// res: it holds d.Version if it reported each module's checksum as d has
// it. A worker that failed the call keeps its answer as the result; one
// that differs gets 409 naming the first module (of modules, in order)
// that did.
func verify(res Result, d Declaration, modules []string) Result {
	if !res.OK {
		res.Body = map[string]any{"error": "the worker's checksums could not be read, so it is stale until a declaration names it again", "answer": res.Body}
		return res
	}
	got, _ := res.Body.(map[string]any)
	for _, m := range modules {
		if sum, _ := got[m].(string); sum != d.Checksums[m] {
			return Result{WorkerURL: res.WorkerURL, StatusCode: http.StatusConflict, answered: true, Body: map[string]any{
				"error":  fmt.Sprintf("module %s differs: the worker reports %q, the declaration %q; it is stale until a declaration that it matches, or an update through the router", m, got[m], d.Checksums[m]),
				"module": m,
			}}
		}
	}
	return holds(res.WorkerURL, d.Version, scheduler.SourceVerified)
}

// ContinueWithVersion records d (see Declare) and then ends the pause of
// the workers it named that are paused: pause, direct transfer and this
// call are the trainer's whole step. A worker that did not match d's
// checksums serves no job all the same: it is stale. The caller holds
// the fleet's lock.
func (f *Fleet) ContinueWithVersion(ctx context.Context, d Declaration, cfg *Config) ([]Result, error) {
	results, err := f.Declare(ctx, d, cfg)
	if err != nil {
		return nil, err
	}
	urls := make([]string, len(results))
	for i, r := range results {
		urls[i] = r.WorkerURL
	}
	_, err = f.pool.ContinueWorkers(urls)
	return results, err
}
