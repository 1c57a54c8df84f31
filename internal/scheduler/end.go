package scheduler

// End is how a job's attempt on a worker ended, as the attempt hands it
// to the pool once: to Release, or to Retry when the job runs again. It
// says what the attempt tells of its worker and, when the job runs again,
// why. One function of package attempt decides it (Runner.ended); the
// pool acts on it in freeLocked.
type End struct {
	Worker Evidence // what the attempt tells of its worker's health
	Rerun  Rerun    // why the job runs again on another worker; NoRerun: it does not
}

// Evidence is what an attempt's end tells of its worker's health.
type Evidence uint8

const (
	Succeeded   Evidence = iota // the worker answered
	Refused                     // the worker refused the request (4xx): the request's fault, not the worker's
	Failed                      // the worker failed: a 5xx, an answer cut short or stalled, none in time, or an error not known to be Unreachable
	Unreachable                 // no connection could be made, or it closed before any byte of an answer: the worker was down
	Abandoned                   // the client left; says nothing of the worker
	Asleep                      // the worker said it is asleep: put to sleep behind the router's back
	Overtaken                   // a copy of the job on another worker answered first: it overran, hung
)

// failed reports whether ev counts as a failure of the worker.
func (ev Evidence) failed() bool {
	return ev == Failed || ev == Unreachable || ev == Overtaken
}

// Rerun is why a job runs again on another worker after an attempt. Its
// names are the cause label of the router's re-run metric.
type Rerun uint8

const (
	NoRerun       Rerun = iota
	RerunReach          // the worker could not be reached, or dropped the connection before answering
	RerunStatus         // it answered a 5xx or a status in retry_on
	RerunAsleep         // it answered that it is asleep: put to sleep behind the router's back
	RerunCutShort       // its 2xx answer broke off, or its JSON or msgpack is not whole
	RerunStalled        // its 2xx answer stopped coming (answer_stall_timeout): never sent back to it
)

var rerunNames = [...]string{"", "connection", "status", "asleep", "cut_short", "stalled"}

func (c Rerun) String() string { return rerunNames[c] }

// leaves reports whether e moves its job off its worker with the job
// still to be answered: the worker is one it tried.
func (e End) leaves() bool { return e.Worker.failed() || e.Rerun != NoRerun }
