package scheduler

import "context"

// Outcome is how a ticket's claim on a worker ended.
type Outcome int

const (
	Succeeded   Outcome = iota // the worker answered
	Refused                    // the worker refused the request (4xx): the request's fault, not the worker's
	Failed                     // the worker failed: a 5xx, an answer cut short or stalled, none in time, or an error not known to be Unreachable
	Unreachable                // no connection could be made, or it closed before any byte of an answer: the worker was down
	Abandoned                  // the client left; says nothing of the worker
	Asleep                     // the worker said it is asleep: put to sleep behind the router's back
	Overtaken                  // a copy of the job on another worker answered first: it overran, hung
)

// failed reports whether o counts as a failure of the worker.
func (o Outcome) failed() bool {
	return o == Failed || o == Unreachable || o == Overtaken
}

// OutcomeOf tells how the exchange with the worker ended, as evidence of
// the worker's health: a 5xx is the worker's failure, as Envoy counts
// them; a 4xx is the request's fault and says nothing of the worker.
func OutcomeOf(clientCtx context.Context, err error, status int) Outcome {
	switch {
	case clientCtx.Err() != nil:
		return Abandoned
	case err != nil, status >= 500:
		return Failed
	case status >= 400:
		return Refused
	}
	return Succeeded
}
