package main

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/examples/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// How long the faults of the schedule last. A hang and a share of 500s
// outlast the router's stall detection and a few of its health probes
// (soakHealth), so that every rule that handles them gets to act.
const (
	crashDown     = time.Second     // a crashed worker is down this long before it starts again
	hangFor       = 3 * time.Second // a hung worker hangs this long before it is restarted
	failFor       = 3 * time.Second // a worker answers failShare of its jobs 500 this long
	failShare     = 0.3
	removalGrace  = time.Second // a removed worker is stopped this long after its removal
	joinedWorkers = "r"         // names of workers registered at run time: r1, r2, ...
)

// fault is one event of the soak's schedule.
type fault struct {
	name   string
	inject func(s *soak, ctx context.Context) error
}

// schedule is the soak's faults, one every --fault-every, in this order,
// round and round. Crashes, hangs and 500s hit the image workers the config
// lists, each in turn; the video worker gets none, since a video job its
// worker accepted cannot run again elsewhere.
var schedule = []fault{
	{"crash and restart", (*soak).crash},
	{"reload, same config", (*soak).reloadSame},
	{"hang, then restart", (*soak).hang},
	{"30% 500s", (*soak).fail},
	{"register a worker", (*soak).register},
	{"reload, queue_order changed", (*soak).reloadChanged},
	{"remove that worker", (*soak).remove},
}

// runSchedule injects a fault every --fault-every until done closes, then
// removes a worker it registered, so that the fleet ends as it began. A
// fault is always seen through to its end (a hung or crashed worker started
// again, 500s stopped).
func (s *soak) runSchedule(ctx context.Context, done <-chan struct{}) error {
	tick := time.NewTicker(s.o.faultEvery)
	defer tick.Stop()
	for i := 0; ; i++ {
		select {
		case <-done:
			if s.joined != nil {
				return s.apply(ctx, fault{"remove that worker", (*soak).remove})
			}
			return nil
		case <-tick.C:
		}
		if err := s.apply(ctx, schedule[i%len(schedule)]); err != nil {
			return err
		}
	}
}

func (s *soak) apply(ctx context.Context, f fault) error {
	fmt.Fprintf(os.Stderr, "soak: %6.1fs  %s\n", time.Since(s.began).Seconds(), f.name)
	if err := f.inject(s, ctx); err != nil {
		return fmt.Errorf("%s: %w", f.name, err)
	}
	s.injected[f.name]++
	return nil
}

// victim is the next image worker a fault hits.
func (s *soak) victim() int {
	s.turn++
	return (s.turn - 1) % len(s.images)
}

// crash kills a worker as a dying process would and starts it again on the
// same port after crashDown.
func (s *soak) crash(context.Context) error {
	i := s.victim()
	s.images[i].Crash()
	time.Sleep(crashDown)
	return s.restart(i)
}

// hang makes a worker's jobs hang while its /health still answers, then
// restarts it after hangFor, as an operator would.
func (s *soak) hang(context.Context) error {
	i := s.victim()
	s.images[i].Hang()
	time.Sleep(hangFor)
	return s.restart(i)
}

func (s *soak) restart(i int) error {
	m, err := s.images[i].Restart()
	if err != nil {
		return err
	}
	s.images[i] = m
	return nil
}

// fail makes a worker fail failShare of its jobs with 500 for failFor.
func (s *soak) fail(context.Context) error {
	w := s.images[s.victim()]
	w.SetFailRate(failShare)
	time.Sleep(failFor)
	w.SetFailRate(0)
	return nil
}

// register starts a worker and registers it through the router's API, as
// miles adds an engine.
func (s *soak) register(ctx context.Context) error {
	s.joins++
	w, err := fakeworker.Start(fakeworker.Config{Name: fmt.Sprintf("%s%d", joinedWorkers, s.joins), UnitMs: s.o.unitMs})
	if err != nil {
		return err
	}
	if err := s.control(ctx, http.MethodPost, "/workers?url="+url.QueryEscape(w.URL())); err != nil {
		w.Close()
		return err
	}
	s.joined = w
	return nil
}

// remove removes the worker register added through the router's API and
// stops it removalGrace later, once the jobs it held have ended.
func (s *soak) remove(ctx context.Context) error {
	w := s.joined
	if w == nil {
		return nil
	}
	s.joined = nil
	defer w.Close()
	if err := s.control(ctx, http.MethodDelete, "/workers/"+url.PathEscape(w.URL())); err != nil {
		return err
	}
	time.Sleep(removalGrace)
	return nil
}

// reloadSame loads the config the router runs again.
func (s *soak) reloadSame(ctx context.Context) error {
	return s.reload(ctx)
}

// reloadChanged loads the config with the other queue_order.
func (s *soak) reloadChanged(ctx context.Context) error {
	s.order = otherOrder(s.order)
	return s.reload(ctx)
}

func otherOrder(order string) string {
	if order == "fifo" {
		return "largest_first"
	}
	return "fifo"
}

func (s *soak) reload(ctx context.Context) error {
	cfg, err := s.config()
	if err != nil {
		return err
	}
	return s.router.load(ctx, cfg)
}

// control calls one of the router's control endpoints on the image site.
func (s *soak) control(ctx context.Context, method, path string) error {
	req, err := http.NewRequestWithContext(ctx, method, s.imagesURL()+path, nil)
	if err != nil {
		return err
	}
	_, err = adminCall(req)
	return err
}

// config is the router's config: the image workers' pool on one site, the
// video worker's on another, the admin API on a third port. Re-runs also
// follow a worker's 500 (sglang's answer to a scheduler error), since the
// schedule injects those; probes run every soakHealth, so that workers
// that crashed or hung are seen within the schedule's faults.
func (s *soak) config() ([]byte, error) {
	text := fmt.Sprintf(`{
	admin 127.0.0.1:%d
	auto_https off
	persist_config off
	default_bind 127.0.0.1
	servers {
		protocols h1
	}
	log {
		level WARN
	}
}
:%d {
	diffusion_router soak-images {
		workers %s
		retry_on 500
		queue_order %s
		health_interval %s
		health_timeout %s
	}
}
:%d {
	diffusion_router soak-videos {
		workers %s
		health_interval %s
		health_timeout %s
	}
}
`, s.ports.admin, s.ports.images, strings.Join(s.images.URLs(), " "), s.order, soakHealth, soakHealth,
		s.ports.videos, s.video.URL(), soakHealth, soakHealth)
	cfg, _, err := testrouter.Adapt([]byte(text), "soak.Caddyfile")
	return cfg, err
}

// soakHealth is the router's health_interval and health_timeout in the soak.
const soakHealth = "1s"
