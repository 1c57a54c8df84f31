package diffusionrouter

import (
	"net/http"

	"github.com/miles-rollout/miles-diffusion-router/internal/attempt"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// jobKinds is what the router learns from the answers of the jobs whose
// ids its clients use again: which worker made a video or image job, and
// when a video job ended (see videojobs.go and imagejobs.go).
type jobKinds struct{ pool jobs }

var _ attempt.Kinds = jobKinds{}

// Watch is what the kind of t's job reads of the answer to its attempt
// r: a video job object whole, at the end, keeping its worker meanwhile;
// an image answer's start, as it goes out.
func (k jobKinds) Watch(r *http.Request, t *scheduler.Ticket) attempt.Watch {
	switch {
	case readsVideoJob(r, t.Route):
		return attempt.Watch{Peek: maxVideoResponsePeek, Holds: true}
	case imageLearningOf(r, t) != learnNothing:
		return attempt.Watch{Peek: maxImageAnswerPeek, Learns: true}
	}
	return attempt.Watch{}
}
