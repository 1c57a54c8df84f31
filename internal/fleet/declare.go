package fleet

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// Declaration is a trainer's word that workers hold a weight version it
// moved into them itself, past the router (POST /update_weight_version).
type Declaration struct {
	Version string
	// Workers are those that hold it; nil: the paused workers, or with
	// none paused every worker that serves (see Pool.DeclareTargets).
	Workers []string
	// Checksums, when given, are the SHA-256 each module's weights must
	// have on a worker, as its /get_weights_checksum reports them, in
	// lower-case hex: a worker that does not report them is not taken to
	// hold Version.
	Checksums map[string]string
	// Continue ends the pause of the workers named as well
	// (continue_generation with new_version).
	Continue bool
}

// checksumPath is where a worker reports its weights' checksums.
const checksumPath = "/get_weights_checksum"

// Declare records d: each worker named holds d.Version, or with checksums
// each whose checksums match; the router cannot vouch for the others. The
// fleet's version becomes d.Version. The caller holds the fleet's lock.
func (f *Fleet) Declare(ctx context.Context, d Declaration, cfg *Config) ([]Result, error) {
	targets := d.Workers
	if targets == nil {
		var err error
		if targets, err = f.pool.DeclareTargets(); err != nil {
			return nil, err
		}
	}
	decl := scheduler.Declaration{Version: d.Version, Checksums: d.Checksums, Continue: d.Continue, Holds: make(map[string]string, len(targets))}
	results := make([]Result, len(targets))
	if d.Checksums == nil {
		for i, u := range targets {
			results[i] = holds(u, d.Version, scheduler.SourceDeclared)
			decl.Holds[u] = scheduler.SourceDeclared
		}
	} else {
		for i, res := range f.broadcast(ctx, targets, checksumPath, checksumCall(d.Checksums), cfg.Timeout) {
			results[i] = verify(res, d.Version, d.Checksums)
			if results[i].OK {
				decl.Holds[res.WorkerURL] = scheduler.SourceVerified
			} else {
				decl.Differ = append(decl.Differ, res.WorkerURL)
			}
		}
	}
	f.pool.DeclareVersion(decl)
	return results, nil
}

// checksumCall is the body that asks a worker for the checksums of the
// modules sums names.
func checksumCall(sums map[string]string) []byte {
	body, _ := json.Marshal(map[string][]string{"module_names": slices.Sorted(maps.Keys(sums))}) // strings always marshal
	return body
}

// holds is the result of a worker taken to hold version, learned as
// source says.
func holds(workerURL, version, source string) Result {
	return Result{WorkerURL: workerURL, StatusCode: http.StatusOK, OK: true, answered: true,
		Body: map[string]any{"weight_version": version, "source": source}}
}

// verify is the result of a worker whose answer to the checksum call is
// res: it holds version if it reported each module's checksum as sums has
// it, in either case of hex. A worker that failed the call keeps its
// answer as the result; one that differs gets 409 naming the first module
// (in name order) that did.
func verify(res Result, version string, sums map[string]string) Result {
	if !res.OK {
		res.Body = map[string]any{"error": "the worker's checksums could not be read, so the router cannot vouch for its weights: it serves no job until a declaration names it", "answer": res.Body}
		return res
	}
	got, _ := res.Body.(map[string]any)
	for _, m := range slices.Sorted(maps.Keys(sums)) {
		if sum, _ := got[m].(string); !strings.EqualFold(sum, sums[m]) {
			return Result{WorkerURL: res.WorkerURL, StatusCode: http.StatusConflict, answered: true, Body: map[string]any{
				"error":  fmt.Sprintf("module %s differs: %s, the declaration %q; it serves no job until a declaration it matches, or an update through the router", m, reported(got, m), sums[m]),
				"module": m,
			}}
		}
	}
	return holds(res.WorkerURL, version, scheduler.SourceVerified)
}

// reported says what a worker's checksum answer got says of module m.
func reported(got map[string]any, m string) string {
	switch sum, ok := got[m].(string); {
	case sum == "not_found": // sglang's answer for a module its pipeline lacks
		return "the worker has no module " + m
	case ok:
		return fmt.Sprintf("the worker reports %q", sum)
	case got["error"] != nil:
		return fmt.Sprintf("the worker reports no checksum for it but the error %q", fmt.Sprint(got["error"]))
	}
	return "the worker reports no checksum for it"
}

// ContinueWithVersion records d (see Declare) and ends the pause of the
// workers it names, in one step: pause, direct transfer and this call are
// a trainer's whole refit. A worker that did not match d's checksums
// serves no job all the same. The caller holds the fleet's lock.
func (f *Fleet) ContinueWithVersion(ctx context.Context, d Declaration, cfg *Config) ([]Result, error) {
	d.Continue = true
	return f.Declare(ctx, d, cfg)
}

// checkCatchUp asks a worker the router cannot vouch for whether it holds
// the fleet's declared weights, by their checksums, once before it
// serves again.
func (f *Fleet) checkCatchUp(ctx context.Context, workerURL string, plan scheduler.CatchUp, cfg *Config) {
	res := verify(f.post(ctx, workerURL, checksumPath, checksumCall(plan.Checksums), cfg.Timeout), plan.Version, plan.Checksums)
	// A 5xx says the worker's server failed the call, not what its
	// weights are: it is asked again once a probe passes.
	f.pool.Verified(plan, res.OK, res.answered && res.StatusCode < 500)
	if !res.OK {
		f.logger.Warn("worker changed behind the router's back does not hold the declared weights; it serves no job until a declaration names it",
			zap.String("worker", workerURL), zap.String("weight_version", plan.Version), zap.Int("status", res.StatusCode))
	}
}
