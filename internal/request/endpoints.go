package request

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"

	"github.com/miles-rollout/miles-diffusion-router/internal/answer"
)

// Kind is what an endpoint is to the router.
type Kind uint8

// The kinds of endpoint. Control endpoints are the router's own (the
// control API's routes); every path neither the table nor the control API
// names is forwarded to any worker the strategy picks.
const (
	Forwarded   Kind = iota // no row: sent on to a worker, not a job
	Control                 // answered by the router itself
	Image                   // an image generation, answered when done
	ImageStream             // an image generation answered as server-sent events
	Video                   // a video job: created at once, runs on for minutes
	Rollout                 // an RL generation whose answer may carry trajectories
	VideoPoll               // a video job's status, content or deletion
	ImagePoll               // an image job's content or deletion
)

// Rerun says when a job whose worker failed it may run again elsewhere.
type Rerun uint8

const (
	// RerunUntilSent: until any byte of the answer has reached the client.
	RerunUntilSent Rerun = iota
	// RerunUnsent: only while the request never reached its worker (no
	// connection could be made). A video worker that was sent the request
	// may have created the job, answer or not, which would then run twice,
	// its id known to nobody.
	RerunUnsent
)

// An Endpoint is what the router knows of a path a worker serves: one
// row of the table. A new generation endpoint is a new row with its cost
// rule; nothing else in the router names paths.
type Endpoint struct {
	// Path is the path, or with Prefix every path below it.
	Path   string
	Prefix bool
	Kind   Kind
	// Class labels the endpoint's requests in metrics and logs.
	Class string
	// Cost prices its POSTs, which makes them generation jobs: costed,
	// given a worker's slot, and waiting in the queue for one. Nil for
	// endpoints that are not jobs.
	Cost CostRule
	// Serves is what a worker must make to be sent the request.
	Serves Task
	// Pinned requests go only to the worker that made the job they name.
	Pinned bool
	// PollParam, when set, makes a GET carrying that query parameter a
	// poll of the job it names, pinned as a prefix row's paths are.
	PollParam string
	// Rerun is when a failed job may run again on another worker.
	Rerun Rerun
	// Hedged jobs that overrun get a second copy on an idle worker.
	Hedged bool
	// Stream answers last as long as their generation and flush as they go.
	Stream bool
	// LearnsImageID: the answer names an image job, which pins later
	// requests for that image to the worker.
	LearnsImageID bool
	// Answers is what its jobs' 2xx answers are, checked as such whatever
	// Content-Type the worker sends: one that is not is broken. Opaque:
	// as the Content-Type says.
	Answers answer.Format
}

// Endpoints is the table: every path sglang-diffusion serves, those the
// router forwards in a way of its own first. Exact rows come before the
// prefix rows that hold them.
var Endpoints = Table{
	{Path: "/v1/images/generations", Kind: Image, Class: "images", Cost: imageCost, Serves: ImageTask, Hedged: true, LearnsImageID: true, Answers: answer.JSON},
	{Path: "/v1/images/edits", Kind: Image, Class: "image_edits", Cost: imageEditCost, Serves: ImageTask, Hedged: true, LearnsImageID: true, Answers: answer.JSON},
	{Path: "/v1/images/generations/stream", Kind: ImageStream, Class: "image_stream", Cost: imageCost, Serves: ImageTask, Stream: true},
	{Path: "/v1/videos", Kind: Video, Class: "videos", Cost: videoCost, Serves: VideoTask, PollParam: "video_id", Rerun: RerunUnsent, Answers: answer.JSON},
	{Path: "/v1/diffusion/generate", Kind: Rollout, Class: "diffusion", Cost: diffusionCost, Serves: AnyTask, Hedged: true, Answers: answer.JSON},
	{Path: "/rollout/generate", Kind: Rollout, Class: "rollout", Cost: rolloutCost, Serves: AnyTask, Hedged: true, Answers: answer.Msgpack},
	{Path: "/v1/videos/", Prefix: true, Kind: VideoPoll, Class: "video_job", Pinned: true},
	{Path: "/v1/images/", Prefix: true, Kind: ImagePoll, Class: "image_job", Pinned: true},
	// The rest of what sglang-diffusion serves: forwarded as a path
	// without a row is, or answered by the router where its control API
	// names the path. Their rows make the table every path a worker
	// serves (see Paths).
	{Path: "/health", Class: "other"}, {Path: "/health_generate", Class: "other"},
	{Path: "/model_info", Class: "other"}, {Path: "/server_info", Class: "other"},
	{Path: "/models", Class: "other"}, {Path: "/v1/models", Class: "other"},
	{Path: "/update_weights_from_disk", Class: "other"}, {Path: "/update_weights_from_tensor", Class: "other"},
	{Path: "/get_weights_checksum", Class: "other"},
	{Path: "/v1/set_lora", Class: "other"}, {Path: "/v1/merge_lora_weights", Class: "other"},
	{Path: "/v1/unmerge_lora_weights", Class: "other"},
	{Path: "/release_memory_occupation", Class: "other"}, {Path: "/resume_memory_occupation", Class: "other"},
}

// Paths is every path of t, a prefix row's as "<prefix>*": with the
// Endpoints table, every path sglang-diffusion serves (forward_paths
// sglang).
func (t Table) Paths() []string {
	paths := make([]string, len(t))
	for i, e := range t {
		paths[i] = e.Path
		if e.Prefix {
			paths[i] += "*"
		}
	}
	return paths
}

// forwarded is the endpoint of every path without a row.
var forwarded = &Endpoint{Kind: Forwarded, Class: "other"}

// A Table is endpoints in the order they are matched.
type Table []Endpoint

// A Route is a request matched against the table.
type Route struct {
	*Endpoint
	// Poll is a request about a job made earlier, the one JobID names: it
	// goes only to the worker that made that job.
	Poll  bool
	JobID string
	// Err refuses a poll whose job id cannot be right (400).
	Err error
}

// Job reports whether a request with method on this route is a generation
// job.
func (r Route) Job(method string) bool {
	return method == http.MethodPost && r.Cost != nil
}

// Match finds the row of the request method u names. A video job path
// whose id does not parse is no poll: it is forwarded, as a worker
// would answer it.
func (t Table) Match(method string, u *url.URL) Route {
	for i := range t {
		e := &t[i]
		switch {
		case !e.Prefix && u.Path == e.Path:
			if e.PollParam != "" && method == http.MethodGet && u.Query().Has(e.PollParam) {
				return Route{Endpoint: e, Poll: true, JobID: u.Query().Get(e.PollParam)}
			}
			return Route{Endpoint: e}
		case e.Prefix && strings.HasPrefix(u.Path, e.Path):
			return t.matchJob(e, u)
		}
	}
	return Route{Endpoint: forwarded}
}

// matchJob reads the job id of a path below a pinned prefix row.
func (t Table) matchJob(e *Endpoint, u *url.URL) Route {
	switch e.Kind {
	case VideoPoll:
		if id, ok := VideoJobID(u.Path); ok {
			return Route{Endpoint: e, Poll: true, JobID: id}
		}
		return Route{Endpoint: forwarded}
	case ImagePoll:
		id, err := ImageJobID(u.EscapedPath())
		return Route{Endpoint: e, Poll: true, JobID: id, Err: err}
	}
	return Route{Endpoint: e}
}

// VideoJobID returns the job id of /v1/videos/{id} and /v1/videos/{id}/content.
func VideoJobID(path string) (string, bool) {
	rest, ok := strings.CutPrefix(path, "/v1/videos/")
	if !ok {
		return "", false
	}
	id, tail, _ := strings.Cut(rest, "/")
	if id == "" || (tail != "" && tail != "content") {
		return "", false
	}
	return id, true
}

// MaxJobIDLength bounds the ids the router looks up; sglang's are uuids.
const MaxJobIDLength = 128

var (
	errImageJobPath = errors.New("image job paths are /v1/images/{image_id} and /v1/images/{image_id}/content")
	errImageJobID   = fmt.Errorf("image_id must be 1 to %d letters, digits, '-', '_' or '.' (an escaped '/' is none of them)", MaxJobIDLength)
)

// ImageJobID returns the id of an image job path, given as sent (escaped):
// /v1/images/{id} or /v1/images/{id}/content, with an id of the shape
// ValidJobID allows. The path is split at the slashes the client sent, so
// an id with an escaped one (%2F) is an id with a '/', and refused.
func ImageJobID(escapedPath string) (string, error) {
	segment, tail, hasTail := strings.Cut(strings.TrimPrefix(escapedPath, "/v1/images/"), "/")
	if hasTail && tail != "content" {
		return "", errImageJobPath
	}
	id, err := url.PathUnescape(segment)
	if err != nil || !ValidJobID(id) {
		return "", errImageJobID
	}
	return id, nil
}

// ValidJobID reports whether id has the shape of a job id the router
// remembers: a ValidName of at most MaxJobIDLength.
func ValidJobID(id string) bool { return ValidName(id, MaxJobIDLength) }

// ValidName reports whether s is 1 to max letters, digits, '-', '_' or
// '.': the shape of what clients name that the router keeps and sends out
// again, in paths, logs and metric labels (job ids, tenants).
func ValidName(s string, max int) bool {
	if s == "" || len(s) > max {
		return false
	}
	for _, c := range []byte(s) {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '_' || c == '.') {
			return false
		}
	}
	return true
}
