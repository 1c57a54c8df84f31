package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// findCaddyfile returns path if given, else examples/Caddyfile of the
// module that holds the working directory (go run ./examples/demo runs
// from the repository root, but any directory inside it will do).
func findCaddyfile(path string) (string, error) {
	if path != "" {
		if _, err := os.Stat(path); err != nil {
			return "", fmt.Errorf("caddyfile: %w", err)
		}
		return path, nil
	}
	wd, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for dir := wd; ; dir = filepath.Dir(dir) {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			p := filepath.Join(dir, "examples", "Caddyfile")
			if _, err := os.Stat(p); err != nil {
				return "", fmt.Errorf("no examples/Caddyfile in module root %s: %w", dir, err)
			}
			return p, nil
		}
		if filepath.Dir(dir) == dir {
			return "", fmt.Errorf("cannot find examples/Caddyfile: %s is not inside the repository; run from its root (go run ./examples/demo) or pass -caddyfile", wd)
		}
	}
}

// startRouter fills in the environment variables the Caddyfile uses, adapts
// and loads it, and waits until the router's /health answers 200. It
// returns the router's URL; stop it with stopRouter.
func startRouter(ctx context.Context, caddyfile string, workers []string) (string, error) {
	port, err := testrouter.FreePort()
	if err != nil {
		return "", err
	}
	for name, val := range map[string]string{
		"ROUTER_PORT":  strconv.Itoa(port),
		"ROUTER_BIND":  "127.0.0.1",
		"WORKERS":      strings.Join(workers, " "), // Caddy splits it into arguments
		"ROUTER_ADMIN": "off",                      // no admin API: nothing to reload, nothing to clash with
		"LOG_LEVEL":    "ERROR",                    // failed requests fail the demo anyway
	} {
		os.Setenv(name, val)
	}

	cfg, err := adapt(caddyfile)
	if err != nil {
		return "", err
	}
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	if err := testrouter.StartRouter(ctx, cfg, url); err != nil {
		return "", fmt.Errorf("starting the router: %w", err)
	}
	return url, nil
}

// adapt turns the Caddyfile into Caddy's JSON config.
func adapt(path string) ([]byte, error) {
	body, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	cfg, warnings, err := testrouter.Adapt(body, path)
	if err != nil {
		return nil, fmt.Errorf("adapting %s: %w", path, err)
	}
	for _, w := range warnings {
		fmt.Fprintf(os.Stderr, "caddyfile warning: %s\n", w)
	}
	return cfg, nil
}

func stopRouter() {
	if err := testrouter.StopRouter(); err != nil {
		fmt.Fprintln(os.Stderr, "demo: stopping the router:", err)
	}
}
