// Package jobkinds is what the router reads of the answers of the jobs
// whose ids its clients use again: which worker made a video or an image
// job, so that the job's later requests go to it, and when a video job
// ended, so that its worker's slot goes free (videojobs.go,
// imagejobs.go); and, with tenants, a worker's list of video jobs cut to
// the caller's tenant's (videolist.go).
package jobkinds

import (
	"net/http"

	"github.com/miles-rollout/miles-diffusion-router/internal/attempt"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// Pool is what the job kinds keep in the pool: the owners of video and
// image jobs, and the slots video jobs hold while they run.
type Pool interface {
	Videos() *scheduler.JobOwners
	Images() *scheduler.JobOwners
	HoldVideo(t *scheduler.Ticket, id string) bool
	EndVideo(id string, ev scheduler.Evidence)
}

// Kinds is the attempt.Kinds of a pool: what its attempts read of the
// answers of video and image jobs.
type Kinds struct{ pool Pool }

var _ attempt.Kinds = Kinds{}

// New returns the Kinds of pool.
func New(pool Pool) Kinds { return Kinds{pool} }

// Watch is what the kind of t's job reads of the answer to its attempt
// r: a video job object whole, at the end, keeping its worker meanwhile;
// an image answer's start, as it goes out.
func (k Kinds) Watch(r *http.Request, t *scheduler.Ticket) attempt.Watch {
	switch {
	case readsVideoJob(r, t.Route):
		return attempt.Watch{Peek: maxVideoResponsePeek, Holds: true}
	case imageLearningOf(r, t) != learnNothing:
		return attempt.Watch{Peek: maxImageAnswerPeek, Learns: true}
	}
	return attempt.Watch{}
}
