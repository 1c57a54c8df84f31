// Package control is the router's control API: the endpoints it answers
// itself, in the shapes of the Python sglang-diffusion router and of
// miles' router API (workers, health, models, engine metrics, weight
// updates, LoRA, sleep and wake, aborts, the status page), as plain
// http.Handlers over a scheduler pool.
package control

import (
	"net/http"
	"net/netip"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/fleet"
	"github.com/miles-rollout/miles-diffusion-router/internal/workerurl"
)

// API answers the control endpoints of one router config.
type API struct {
	// Pool is the pool the endpoints show and change.
	Pool Pool

	// Fleet runs the pool's weight updates, LoRA calls, sleep and wake,
	// as Weights says, and makes every call to a worker (model lists,
	// capability probes, metrics); Store keeps the pool's record.
	Fleet   *fleet.Fleet
	Weights *fleet.Config
	Store   *fleet.Store

	// Logger logs the fleet's changes.
	Logger *zap.Logger

	// Allow and Token admit the clients that may change the fleet: a
	// client address in one of Allow's prefixes, or the bearer token.
	Allow []netip.Prefix
	Token string

	// AllowIsDefault says Allow is the default, the machine the router
	// runs on, and Proxied reports whether a request came through one of
	// the server's trusted_proxies. Behind a proxy or sidecar on the same
	// machine every client arrives from loopback, so the default Allow
	// admits no call that came through a proxy.
	AllowIsDefault bool
	Proxied        func(*http.Request) bool

	// ClientIP is a request's client address, as the server determined it
	// (behind trusted proxies, the one they name), with an error when a
	// trusted proxy forwarded an address that does not parse: the address
	// is then not known to be the client's, and admits no control call.
	ClientIP func(*http.Request) (string, error)

	// Guard refuses the worker URLs that may never be registered.
	Guard *workerurl.Guard

	// MaxWorkers bounds the workers a registration may bring the pool to.
	MaxWorkers int

	// MinReady is how many serving workers /readyz wants.
	MinReady int

	// Policy names the strategy, for the status page.
	Policy string

	// Dashboard serves the status page at /dashboard.
	Dashboard bool

	// Models and EngineMetrics keep the answers made from a call to every
	// worker; configs that share a pool share them.
	Models, EngineMetrics *SharedAnswer

	// Operations counts fleet operations by pool, operation and outcome.
	Operations *prometheus.CounterVec

	// AbortMemory is how long the request ids and prefixes an abort names
	// are refused after it, resends included.
	AbortMemory time.Duration

	// HA is this router's standing in the pool's high-availability group,
	// shown by /health, /readyz, /workers and the status page; nil: the
	// router is the pool's only one, and they show none.
	HA Standing
}

// Standing is a router's place in its pool's high-availability group.
type Standing interface {
	// Leading reports whether this router is the pool's active one.
	Leading() bool
	// Leader is the active router's advertised URL, "" while none is
	// known.
	Leader() string
}

// haJSON is the standing as the answers show it; nil without a group.
func (a *API) haJSON() map[string]any {
	if a.HA == nil {
		return nil
	}
	var leader any // null while no router leads
	if l := a.HA.Leader(); l != "" {
		leader = l
	}
	return map[string]any{"leading": a.HA.Leading(), "leader": leader}
}

// withHA adds the standing to an answer, when the router is in a group.
func (a *API) withHA(answer map[string]any) map[string]any {
	if ha := a.haJSON(); ha != nil {
		answer["ha"] = ha
	}
	return answer
}

// Mux routes the control endpoints. Any other method on one of their
// paths is refused with 405; every other path is not the control API's.
func (a *API) Mux() *http.ServeMux { return a.mux() }
