// Package e2e tests the router as its users run it: Caddy built from
// cmd/caddy and run as processes, a group of routers electing a leader
// through etcd, a router killed and started again, and the dashboard in a
// real browser. It holds only tests; they are slower than the root
// package's, which test the Caddy adapter in one process.
package e2e

import (
	"os"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// TestMain keeps Caddy's files out of the user's home.
func TestMain(m *testing.M) { os.Exit(testrouter.Main(m, "diffusionrouter-e2e")) }
