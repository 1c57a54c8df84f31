package jobkinds

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"

	"github.com/miles-rollout/miles-diffusion-router/internal/answer"
	"github.com/miles-rollout/miles-diffusion-router/internal/attempt"
	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// A worker lists every video job it has (GET /v1/videos, which
// sglang-diffusion answers with the whole list even when asked by
// ?video_id=), whoever made them. With tenants, the router holds a
// worker's list back until it is whole and passes on only the jobs it
// knows to be the caller's tenant's: the others, and any job it does not
// know, are taken out.

// maxVideoList bounds the list the router holds back: about 25,000 jobs.
const maxVideoList = 16 << 20

// errVideoListTooLong refuses a list the router will not hold back whole.
var errVideoListTooLong = fmt.Errorf("its video list is longer than the %d bytes the router reads to take out other tenants' jobs; ask for fewer with ?limit=", maxVideoList)

// ListsVideos reports whether r, on route, asks a worker for its list of
// video jobs.
func ListsVideos(r *http.Request, route request.Route) bool {
	return route.Kind == request.Video && r.Method == http.MethodGet
}

// TenantList is the writer a worker's answer to a video list goes through
// on its way to the client: it holds a 2xx answer back and lets any other
// pass, then sends on only the tenant's jobs (Finish).
type TenantList struct {
	http.ResponseWriter
	owners *scheduler.JobOwners
	tenant string
	status int
	body   []byte
	broken error // why the list held back cannot be read
}

// FilterVideoList puts a TenantList for t's tenant under rec, when r
// lists video jobs; nil otherwise. owners knows whose each job is.
func FilterVideoList(rec *attempt.Recorder, r *http.Request, t *scheduler.Ticket, owners *scheduler.JobOwners) *TenantList {
	if !ListsVideos(r, t.Route) {
		return nil
	}
	r.Header.Del("Accept-Encoding") // a list the router can read
	l := &TenantList{ResponseWriter: rec.ResponseWriter, owners: owners, tenant: t.Tenant}
	rec.ResponseWriter = l
	return l
}

func (l *TenantList) holds() bool { return l.status >= 200 && l.status <= 299 }

// WriteHeader holds a 2xx status back with its answer.
func (l *TenantList) WriteHeader(status int) {
	switch {
	case status < 200:
		l.ResponseWriter.WriteHeader(status)
	case l.status == 0:
		l.status = status
		if !l.holds() {
			l.ResponseWriter.WriteHeader(status)
		}
	}
}

// Write holds a 2xx answer's bytes back, up to maxVideoList.
func (l *TenantList) Write(b []byte) (int, error) {
	if l.status == 0 {
		l.WriteHeader(http.StatusOK)
	}
	if !l.holds() {
		return l.ResponseWriter.Write(b)
	}
	if len(l.body)+len(b) > maxVideoList {
		l.body, l.broken = nil, errVideoListTooLong
	}
	if l.broken == nil {
		l.body = append(l.body, b...)
	}
	return len(b), nil
}

// FlushError flushes nothing held back, nor a status not yet given.
func (l *TenantList) FlushError() error {
	if l.status == 0 || l.holds() {
		return nil
	}
	return http.NewResponseController(l.ResponseWriter).Flush()
}

// Unwrap lets the recorder reach the connection, to break it.
func (l *TenantList) Unwrap() http.ResponseWriter { return l.ResponseWriter }

// Finish sends the list held back, with only the tenant's jobs, once the
// attempt that answered it ended with err, and returns what to return for
// the request.
func (l *TenantList) Finish(err error) error {
	if !l.holds() {
		return err
	}
	list, listErr := l.filtered(err)
	l.Header().Del("Content-Length")
	if listErr != nil {
		return answer.WriteError(l.ResponseWriter, http.StatusBadGateway, "Worker request failed: "+listErr.Error())
	}
	l.Header().Set("Content-Length", strconv.Itoa(len(list)))
	l.ResponseWriter.WriteHeader(l.status)
	_, err = l.ResponseWriter.Write(list)
	return err
}

// filtered is the list held back with only the tenant's jobs in its data,
// and its first_id and last_id, where the worker gives them, those of the
// jobs left. The rest (object, has_more) stays as the worker wrote it.
func (l *TenantList) filtered(err error) ([]byte, error) {
	if err = errors.Join(l.broken, err); err != nil {
		return nil, err
	}
	var list map[string]json.RawMessage
	var jobs []json.RawMessage
	if json.Unmarshal(l.body, &list) != nil || json.Unmarshal(list["data"], &jobs) != nil || jobs == nil {
		return nil, errors.New(`its video list is no JSON object with a "data" list`)
	}
	kept, ids := jobs[:0], []string(nil)
	for _, job := range jobs {
		var j videoJobStatus
		if json.Unmarshal(job, &j) != nil {
			continue
		}
		if _, ok := l.owners.Worker(j.ID, l.tenant); ok {
			kept, ids = append(kept, job), append(ids, j.ID)
		}
	}
	list["data"], _ = json.Marshal(kept)
	setEnd(list, "first_id", ids, 0)
	setEnd(list, "last_id", ids, len(ids)-1)
	return json.Marshal(list)
}

// setEnd sets list's member key, where list has it, to ids[i], or null
// when there is none.
func setEnd(list map[string]json.RawMessage, key string, ids []string, i int) {
	if _, ok := list[key]; !ok {
		return
	}
	list[key] = json.RawMessage("null")
	if len(ids) > 0 {
		list[key], _ = json.Marshal(ids[i])
	}
}
