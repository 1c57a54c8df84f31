// Command fakeworker serves a fake sglang-diffusion worker, for demos and
// benchmarks of the router without GPUs. It stops cleanly on SIGINT or
// SIGTERM and exits with status 1 when a --crash-after fault kills it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"syscall"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
)

func main() {
	if err := run(); err != nil {
		log.Fatal(err)
	}
}

func run() error {
	host := flag.String("host", "127.0.0.1", "address to listen on")
	port := flag.Int("port", 30000, "port to listen on")
	var cfg fakeworker.Config
	flag.StringVar(&cfg.Name, "name", "fake", "name reported in the X-Fake-Worker header")
	flag.StringVar(&cfg.ModelPath, "model-path", "fake/diffusion-model", "model path served, the model id in /v1/models")
	flag.StringVar(&cfg.TaskType, "task-type", "T2I", "T2I, I2I, TI2I (image) or T2V, I2V, TI2V (video)")
	flag.Float64Var(&cfg.Speed, "speed", 1, "relative speed; service time = cost * unit-ms / speed")
	flag.Float64Var(&cfg.UnitMs, "unit-ms", 100, "milliseconds per cost unit (one 1024x1024 image, one step)")
	flag.IntVar(&cfg.ImageBytes, "image-bytes", 1024, "size in bytes of each fake image or video")
	flag.Float64Var(&cfg.FailRate, "fail-rate", 0, "fraction of generation jobs answered 500")
	flag.Int64Var(&cfg.Seed, "seed", 0, "seed for --fail-rate and the rates of broken answers")
	flag.BoolVar(&cfg.HealthFail, "health-fail", false, "answer /health with 503")
	flag.DurationVar(&cfg.HealthDelay, "health-delay", 0, "delay before answering /health")
	flag.IntVar(&cfg.HangAfter, "hang-after", 0, "after N finished jobs, later jobs hang (0 = never)")
	flag.IntVar(&cfg.CrashAfter, "crash-after", 0, "after N finished jobs, the next job kills the worker (0 = never)")
	flag.BoolVar(&cfg.UpdateFail, "update-fail", false, "weight updates fail (400) and roll back")
	flag.BoolVar(&cfg.UpdateHang, "update-hang", false, "weight updates never end: each holds the worker until it stops, /health still answering")
	flag.BoolVar(&cfg.RolloutJSON, "rollout-json", false, "answer /rollout/generate with the older JSON list instead of msgpack")
	flag.Float64Var(&cfg.CloseRate, "close-rate", 0, "fraction of successful generation answers cut off by closing the connection short of their Content-Length (1 = every one)")
	flag.Float64Var(&cfg.ResetRate, "reset-rate", 0, "fraction of successful generation answers cut off by resetting the connection (TCP RST) (1 = every one)")
	flag.Float64Var(&cfg.TruncateRate, "truncate-rate", 0, "fraction of successful generation answers sent complete in HTTP but with the body cut in half (1 = every one)")
	flag.Float64Var(&cfg.StallRate, "stall-rate", 0, "fraction of successful generation answers that send half the body, then nothing until the client leaves (1 = every one)")
	flag.Float64Var(&cfg.HTMLRate, "html-rate", 0, "fraction of successful generation answers replaced by a whole 200 HTML page, as a proxy in front of a worker may answer (1 = every one)")
	flag.IntVar(&cfg.OOMPixels, "oom-pixels", 0, "jobs whose width*height reaches this run out of GPU memory and fail as sglang does, e.g. 2359296 for 1536x1536 (0 = never)")
	flag.DurationVar(&cfg.LoraSwitch, "lora-switch", 0, "time a LoRA call that changes the adapter jobs run on holds the worker (base weights restored, adapter merged), e.g. 2s")
	flag.StringVar(&cfg.CloudStorage, "cloud-storage", "", "base URL of the cloud storage outputs are uploaded to; empty: none, so response_format \"url\" fails (400) as on a worker without storage")
	flag.Parse()

	ln, err := net.Listen("tcp", net.JoinHostPort(*host, strconv.Itoa(*port)))
	if err != nil {
		return err
	}
	w := fakeworker.New(cfg)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() {
		<-ctx.Done()
		w.Close()
	}()

	log.Printf("fake sglang-diffusion worker %q (%s, %s) listening on http://%s", cfg.Name, cfg.ModelPath, cfg.TaskType, ln.Addr())
	err = w.Serve(ln)
	switch {
	case !errors.Is(err, http.ErrServerClosed):
		return err
	case ctx.Err() == nil:
		return fmt.Errorf("worker crashed after %d jobs (--crash-after)", cfg.CrashAfter)
	}
	log.Print("stopped")
	return nil
}
