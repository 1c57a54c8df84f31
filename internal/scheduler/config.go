package scheduler

import "time"

// Config is how one diffusion_router config hands jobs to workers.
type Config struct {
	Strategy      Strategy
	MaxInflight   int           // jobs a worker holds at once; 0: no limit
	Order         QueueOrder    // which waiting job goes first
	Timeout       time.Duration // longest wait in the queue; 0: the client's own
	MaxQueue      int           // jobs that may wait at once
	MaxAttempts   int           // workers a job may be sent to
	MaxPassedOver time.Duration // longest a job waits while higher priorities go first; 0: no limit
	HedgeAfter    float64       // a job overrunning its prediction this much gets a copy; 0: never
	Health        *HealthConfig // how failed requests count against a worker

	// Tenants: see tenants.go.
	TenantWeights  map[string]float64 // each tenant's share by weight; 1 unless set
	TenantMaxQueue int                // jobs one tenant may have waiting; 0: no limit but MaxQueue
	MaxTenants     int                // tenants tracked; 0: DefaultMaxTenants
}

// order is cfg's queue order; arrival order when it sets none.
func (cfg *Config) order() QueueOrder {
	if cfg.Order == nil {
		return FIFO{}
	}
	return cfg.Order
}
