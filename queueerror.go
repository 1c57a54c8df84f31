package diffusionrouter

import (
	"errors"
	"fmt"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// queueError is the answer for a request that got no worker.
func queueError(p observed, t *scheduler.Ticket, err error) (int, string) {
	switch {
	case errors.Is(err, scheduler.ErrQueueFull):
		return 429, fmt.Sprintf("the queue of pool %q is full (%d jobs waiting, max_queue %d)", p.Name(), t.Config().MaxQueue, t.Config().MaxQueue)
	case errors.Is(err, scheduler.ErrTenantQueueFull):
		return 429, fmt.Sprintf("tenant %q has %d jobs waiting in pool %q, as many as tenant_max_queue lets one tenant have", t.TenantOf(), t.Config().TenantMaxQueue, p.Name())
	case errors.Is(err, scheduler.ErrQueueTimeout) && t.HeldByPolicy():
		return 503, fmt.Sprintf("no worker of pool %q on weights the job's version policy admits was free within queue_timeout (%s); the job waited in the pool's queue", p.Name(), t.Config().Timeout)
	case errors.Is(err, scheduler.ErrQueueTimeout):
		return 503, fmt.Sprintf("no worker of pool %q was free within queue_timeout (%s); the job waited in the pool's queue", p.Name(), t.Config().Timeout)
	case errors.Is(err, scheduler.ErrAsleep):
		return 503, fmt.Sprintf("every worker of pool %q that could serve this request is asleep (release_memory_occupation); wake them with resume_memory_occupation", p.Name())
	case errors.Is(err, scheduler.ErrNoVersion):
		return 409, fmt.Sprintf("no worker of pool %q is or will be on weight version %q", p.Name(), t.WantVersion)
	case t.Pin != "":
		return 503, fmt.Sprintf("Mapped worker %s is unavailable", t.Pin)
	}
	return 503, scheduler.ErrNoWorker.Error()
}

// cancelStatus is the status of a job the pool ended for cause: 503 when
// no worker can serve its adapter now (their LoRA calls fail), 409 when
// what it asked for changed under it (an abort, an adapter withdrawn).
func cancelStatus(cause error) int {
	if _, ok := errors.AsType[*scheduler.UnservableAdapterError](cause); ok {
		return 503
	}
	return 409
}
