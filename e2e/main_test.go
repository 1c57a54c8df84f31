// Package e2e tests the router as its users run it, in scenarios that take
// seconds each: Caddy built from cmd/caddy and run as processes, a group
// of routers electing a leader through etcd, a router killed and started
// again, the dashboard in a real browser, and a rollout step's batch timed
// with a worker that hangs. It holds only tests; the root package's tests
// test the Caddy adapter, and each internal package's its own behaviour.
package e2e

import (
	"os"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// TestMain keeps Caddy's files out of the user's home.
func TestMain(m *testing.M) { os.Exit(testrouter.Main(m, "diffusionrouter-e2e")) }
