package diffusionrouter

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// A generation job's version policy bounds how stale the weights it runs
// on may be (internal/scheduler/staleness.go). A client asks for one with
// a header; weights.version_policy gives one to the jobs that ask for
// neither a policy nor an exact version.

// policyHeader bounds how stale the weights of a job's worker may be:
// latest, or max-staleness:<k>.
const policyHeader = "X-Weight-Version-Policy"

// How k is written after max staleness: in the header, and in the option.
const (
	headerStaleness = "max-staleness:"
	optionStaleness = "max_staleness "
)

// versionPolicyOf is the version policy r's job runs under: the one its
// header asks for; none when it asks for an exact weight version; the
// option's otherwise. A header that does not parse, or sent beside an
// exact version, is an error.
func (h *Handler) versionPolicyOf(r *http.Request) (scheduler.VersionPolicy, error) {
	asked := r.Header.Values(policyHeader)
	exact := r.Header.Get(request.VersionHeader) != ""
	switch {
	case len(asked) == 0 && exact:
		return scheduler.VersionPolicy{}, nil
	case len(asked) == 0:
		return h.maxStale, nil
	case exact:
		return scheduler.VersionPolicy{}, fmt.Errorf("%s and %s are both given: ask for one exact weight version, or bound how stale it may be, not both", request.VersionHeader, policyHeader)
	case len(asked) > 1:
		return scheduler.VersionPolicy{}, fmt.Errorf("%s is given %d times; give it once", policyHeader, len(asked))
	}
	pol, err := parseVersionPolicy(asked[0], headerStaleness)
	if err != nil {
		return pol, fmt.Errorf("%s: %w", policyHeader, err)
	}
	return pol, nil
}

// parseVersionPolicy reads latest, or prefix followed by k, the bound on
// staleness: a whole number from 0 to scheduler.MaxStaleness.
func parseVersionPolicy(v, prefix string) (scheduler.VersionPolicy, error) {
	if v == "latest" {
		return scheduler.Staleness(0)
	}
	k, ok := strings.CutPrefix(v, prefix)
	n, err := strconv.Atoi(k)
	if !ok || err != nil || !onlyDigits(strings.TrimPrefix(k, "-")) {
		return scheduler.VersionPolicy{}, fmt.Errorf("%q is neither latest nor %s<k>, k a whole number from 0 to %d", v, prefix, scheduler.MaxStaleness)
	}
	return scheduler.Staleness(n)
}
