package control

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"regexp"
	"slices"
	"strings"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/answer"
	"github.com/miles-rollout/miles-diffusion-router/internal/fleet"
)

// A trainer that moves weights into the engines past the router declares
// what they now hold (POST /update_weight_version, or continue_generation
// with new_version), as miles' LLM side tells SGLang engines with
// update_weight_version. With checksums the router checks the word
// against each worker's get_weights_checksum before it believes it.

// checksumHex is a SHA-256 as get_weights_checksum reports it.
var checksumHex = regexp.MustCompile(`^[0-9a-fA-F]{64}$`)

// declareFn runs a declaration over the fleet: Fleet.Declare, or
// Fleet.ContinueWithVersion.
type declareFn func(context.Context, fleet.Declaration, *fleet.Config) ([]fleet.Result, error)

// serveDeclare is POST /update_weight_version.
func (a *API) serveDeclare(w http.ResponseWriter, r *http.Request) {
	d, declared, status, msg := a.readDeclaration(r, "update_weight_version", map[string]func(json.RawMessage) string{
		"abort_all_requests": checkBoolean("abort_all_requests"), // SGLang's; the router aborts nothing
	})
	if status == 0 && !declared {
		status, msg = http.StatusBadRequest, "new_version is required"
	}
	if status != 0 {
		_ = answer.WriteError(w, status, msg)
		return
	}
	a.runDeclaration(w, r, "update_weight_version", d, a.Fleet.Declare)
}

// runDeclaration runs declaration d over the fleet with run, as operation
// op, and answers as an update does.
func (a *API) runDeclaration(w http.ResponseWriter, r *http.Request, op string, d fleet.Declaration, run declareFn) {
	rep, ok := a.runOperation(w, r, op, d.Version, func(ctx context.Context) ([]fleet.Result, error) {
		results, err := run(ctx, d, a.Weights)
		a.count(op, err, results)
		if err == nil {
			a.Logger.Info("weight version declared", zap.String("operation", op), zap.String("weight_version", d.Version),
				zap.Bool("checksums", d.Checksums != nil), zap.Bool("success", !slices.ContainsFunc(results, failed)))
		}
		return results, err
	})
	if ok {
		a.answerWeights(w, r, d.Version, rep)
	}
}

// readDeclaration reads the body of a declaring call named op: an
// optional "workers", "new_version" and "checksums", and the fields of
// extra. declared is false when it names no new_version; a non-zero
// status refuses it.
func (a *API) readDeclaration(r *http.Request, op string, extra map[string]func(json.RawMessage) string) (d fleet.Declaration, declared bool, status int, msg string) {
	checks := map[string]func(json.RawMessage) string{"new_version": checkNewVersion, "checksums": checkChecksums}
	for f, check := range extra {
		checks[f] = check
	}
	members, urls, status, msg := a.readGenerationCall(r, op, checks)
	if status != 0 {
		return d, false, status, msg
	}
	d.Workers = urls
	_ = json.Unmarshal(members["checksums"], &d.Checksums) // checked above
	for m, sum := range d.Checksums {
		d.Checksums[m] = strings.ToLower(sum) // as sglang's hashlib prints it
	}
	if _, declared = members["new_version"]; !declared {
		if d.Checksums != nil {
			return d, false, http.StatusBadRequest, "checksums need new_version: they check the version declared"
		}
		return d, false, 0, ""
	}
	_ = json.Unmarshal(members["new_version"], &d.Version)
	return d, true, 0, ""
}

// checkNewVersion checks a declared version: a non-empty string that can
// go out as a header value, as every weight version must.
func checkNewVersion(raw json.RawMessage) string {
	var v string
	if json.Unmarshal(raw, &v) != nil || v == "" {
		return "new_version must be a non-empty string"
	}
	if _, msg := checkWeightVersion("new_version", v); msg != "" {
		return msg
	}
	return ""
}

// checkChecksums checks declared checksums: a non-empty object of module
// names, each to a SHA-256 in 64 hex digits.
func checkChecksums(raw json.RawMessage) string {
	var sums map[string]string
	if json.Unmarshal(raw, &sums) != nil || len(sums) == 0 {
		return `checksums must be a non-empty object of module names to SHA-256 checksums, {"<module>": "<64 hex digits>"}`
	}
	for _, m := range slices.Sorted(maps.Keys(sums)) {
		if m == "" {
			return "checksums names a module with an empty name"
		}
		if !checksumHex.MatchString(sums[m]) {
			return fmt.Sprintf("checksums[%q] must be a SHA-256 in 64 hex digits, as get_weights_checksum reports it", m)
		}
	}
	return ""
}

// serveWeightVersion is GET /get_weight_version: the fleet's weight
// version, which /health shows to anyone as well.
func (a *API) serveWeightVersion(w http.ResponseWriter, _ *http.Request) {
	_ = answer.WriteJSON(w, http.StatusOK, map[string]string{"weight_version": a.Pool.Version()})
}
