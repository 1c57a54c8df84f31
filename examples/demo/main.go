// Command demo shows miles-diffusion-router spreading one rollout step of
// image generations over a small fleet, all in one process and without a GPU.
//
// It starts four fake sglang-diffusion workers (internal/fakeworker) on free
// ports of 127.0.0.1, three of speed 1 and one twice as fast; starts Caddy
// with the router from examples/Caddyfile, the same sample config a user
// would copy; sends 200 image requests of mixed sizes and step counts all at
// once, as a rollout step does; and prints which worker served how much
// work, the wall time of the batch and the ideal lower bound for it.
//
// Run it from the repository root:
//
//	go run ./examples/demo
//
// or name the config: go run ./examples/demo -caddyfile path/to/Caddyfile.
// It exits non-zero if any request fails or the run exceeds its time limit.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// The fleet: one fake worker per speed. A job keeps a worker busy for
// cost × unitMs / speed milliseconds.
var speeds = []float64{1, 1, 1, 2}

const (
	unitMs     = 4               // ms per cost unit (one 1024×1024 image, one step)
	batchSize  = 200             // requests in the rollout step
	batchSeed  = 42              // seed of the batch's order
	runTimeout = 2 * time.Minute // bound on the whole demo
)

func main() {
	caddyfile := flag.String("caddyfile", "", "the router config (default: examples/Caddyfile of the module the working directory is in)")
	flag.Parse()

	// A hard stop in case shutting down hangs after the run's context ends.
	time.AfterFunc(runTimeout+15*time.Second, func() {
		fmt.Fprintln(os.Stderr, "demo: did not finish in time")
		os.Exit(2)
	})
	ctx, cancel := context.WithTimeout(context.Background(), runTimeout)
	err := run(ctx, *caddyfile)
	cancel()
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, caddyfile string) error {
	path, err := findCaddyfile(caddyfile)
	if err != nil {
		return err
	}
	cleanHome, err := testrouter.IsolateHome("diffusion-router-demo-")
	if err != nil {
		return err
	}
	defer cleanHome()

	fleet, err := testrouter.StartFleet(speeds, unitMs)
	if err != nil {
		return err
	}
	defer fleet.Close()

	routerURL, err := startRouter(ctx, path, fleet.URLs())
	if err != nil {
		return err
	}
	defer stopRouter()

	batch := makeBatch(batchSize, batchSeed)
	fmt.Printf("router  %s, config %s\n", routerURL, path)
	fmt.Printf("fleet   %d fake workers, speeds %v, %g ms per cost unit at speed 1\n", len(fleet), speeds, float64(unitMs))
	fmt.Printf("batch   %s, sent at once\n\n", batch.describe())
	res, err := sendBatch(ctx, routerURL, batch)
	if err != nil {
		return err
	}
	return report(os.Stdout, fleet, batch, res)
}
