package control

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/answer"
	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// serveAbort is POST /abort_request, with the body of SGLang's: {"rid"}
// ends the jobs of one request id, {"abort_all": true} every job of the
// pool, and {"rid_prefix"} those whose id starts with it (a rollout
// step). The answer counts what it ended, by where the jobs were.
func (a *API) serveAbort(w http.ResponseWriter, r *http.Request) {
	body, err := decodeJSONBody(r)
	if err != nil {
		_ = answer.WriteError(w, http.StatusBadRequest, err.Error())
		return
	}
	ab, err := parseAbort(body)
	if err != nil {
		_ = answer.WriteError(w, http.StatusBadRequest, err.Error())
		return
	}
	ab.Memory = a.AbortMemory
	c := a.Pool.Abort(ab)
	client, _ := a.ClientIP(r)
	a.Logger.Info("jobs aborted", zap.String("by", ab.By), zap.String("client", client),
		zap.Int("waiting", c.Waiting), zap.Int("running", c.Running))
	_ = answer.WriteJSON(w, http.StatusOK, map[string]any{
		"success": true,
		"aborted": map[string]int{"waiting": c.Waiting, "running": c.Running},
	})
}

// abortFields are the fields an abort may name.
var abortFields = []string{"rid", "rid_prefix", "abort_all"}

// parseAbort reads an abort's body: exactly one of a request id, an id
// prefix or abort_all true. SGLang's own clients send "rid" and
// "abort_all" both, one of them empty or false: that is one.
func parseAbort(body map[string]json.RawMessage) (scheduler.Abort, error) {
	var ab scheduler.Abort
	for field, raw := range body {
		if !slices.Contains(abortFields, field) {
			return ab, fmt.Errorf("Unsupported field %q (want rid, rid_prefix or abort_all)", field)
		}
		if field == "abort_all" {
			if string(raw) == "null" || json.Unmarshal(raw, &ab.All) != nil { // null would read as false
				return ab, errors.New("abort_all must be a boolean")
			}
			continue
		}
		var id string
		if json.Unmarshal(raw, &id) != nil {
			return ab, fmt.Errorf("%s must be a string", field)
		}
		if id == "" && (field == "rid_prefix" || !bodyAbortsAll(body)) {
			return ab, fmt.Errorf("%s must not be empty", field)
		}
		if field == "rid" {
			ab.RID = id
		} else {
			ab.Prefix = id
		}
	}
	return ab, checkAbort(&ab)
}

// bodyAbortsAll reports whether an abort's body says abort_all true.
func bodyAbortsAll(body map[string]json.RawMessage) bool {
	return string(body["abort_all"]) == "true"
}

// checkAbort checks that ab names one set of jobs, by ids that could be
// requests' own, and sets how it was asked for, for the jobs' answers.
func checkAbort(ab *scheduler.Abort) error {
	named := 0
	for _, given := range []bool{ab.RID != "", ab.Prefix != "", ab.All} {
		if given {
			named++
		}
	}
	switch {
	case named == 0:
		return errors.New(`Name the jobs to abort: {"rid": "<X-Request-Id>"}, {"rid_prefix": "<prefix>"} or {"abort_all": true}`)
	case named > 1:
		return errors.New("Give only one of rid, rid_prefix and abort_all")
	case ab.RID != "" && !request.ValidID(ab.RID), ab.Prefix != "" && !request.ValidID(ab.Prefix):
		return fmt.Errorf("an id must be at most %d printable ASCII characters, as an X-Request-Id", request.MaxID)
	}
	switch {
	case ab.All:
		ab.By = `POST /abort_request {"abort_all": true}`
	case ab.Prefix != "":
		ab.By = fmt.Sprintf(`POST /abort_request {"rid_prefix": %q}`, ab.Prefix)
	default:
		ab.By = fmt.Sprintf(`POST /abort_request {"rid": %q}`, ab.RID)
	}
	return nil
}
