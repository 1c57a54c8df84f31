package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
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
	breakFor      = 3 * time.Second // a worker breaks breakShare of its answers this long
	breakShare    = 0.5
	oomFor        = 3 * time.Second // a worker runs out of memory on the mix's largest jobs this long
	removalGrace  = time.Second     // a removed worker is stopped this long after its removal
	joinedWorkers = "r"             // names of workers registered at run time: r1, r2, ...
)

// fault is one event of the soak's schedule.
type fault struct {
	name   string
	inject func(s *soak, ctx context.Context) error
}

// schedule is the soak's faults, one every --fault-every, in this order,
// round and round. Crashes, hangs, 500s and the gray failures (broken
// answers, jobs out of memory, a hung update) hit the image workers the
// config lists; each fault moves on to the next worker every round. The
// video worker gets none, since a video job its worker accepted cannot run
// again elsewhere.
var schedule = []fault{
	{"crash and restart", (*soak).crash},
	{"reload, same config", (*soak).reloadSame},
	{"hang, then restart", (*soak).hang},
	{"30% 500s", spell(failFor, failing)},
	{"register a worker", (*soak).register},
	{"reload, queue_order changed", (*soak).reloadChanged},
	{"remove that worker", (*soak).remove},
	{"answers closed mid-body", spell(breakFor, breaking(fakeworker.BreakClose))},
	{"largest jobs out of memory", spell(oomFor, outOfMemory)},
	{"answers reset mid-body", spell(breakFor, breaking(fakeworker.BreakReset))},
	{"update, one worker's call hangs", (*soak).hungUpdate},
	{"answers truncated", spell(breakFor, breaking(fakeworker.BreakTruncate))},
	{"storage unwritable", (*soak).unwritableStorage},
}

// blackholeLeaves ends the fault the run starts with: a worker that takes
// jobs and never answers, in the config from the router's start.
var blackholeLeaves = fault{"blackhole from the start leaves", (*soak).dropBlackhole}

// faults is every fault the soak injects, for its report.
func faults() []fault { return append([]fault{blackholeLeaves}, schedule...) }

// runSchedule injects a fault every --fault-every until done closes: the
// schedule's, round and round, and once its first round is over the
// blackhole's end. After --rounds rounds it calls stopLoad and injects no
// more. Once done closes it removes the workers the faults added, so that
// the fleet ends as the config lists it. A fault is always seen through to
// its end (a hung or crashed worker started again, 500s stopped).
func (s *soak) runSchedule(ctx context.Context, done <-chan struct{}, stopLoad func()) error {
	tick := time.NewTicker(s.o.faultEvery)
	defer tick.Stop()
	for step := 0; ; {
		select {
		case <-done:
			return s.endFaults(ctx)
		case <-tick.C:
		}
		// A fault that took longer than a tick finds both ready, and
		// select picks either: none starts once the load has ended, when
		// a check that jobs were answered meanwhile cannot hold.
		select {
		case <-done:
			return s.endFaults(ctx)
		default:
		}
		f := blackholeLeaves
		if s.blackhole == nil || step < len(schedule) {
			s.round, s.place = step/len(schedule), step%len(schedule)
			f = schedule[s.place]
			step++
		}
		if err := s.apply(ctx, f); err != nil {
			return err
		}
		if s.o.rounds > 0 && step == s.o.rounds*len(schedule) && s.blackhole == nil {
			stopLoad()
			<-done
			return s.endFaults(ctx)
		}
	}
}

// endFaults removes the workers that faults added and that are still
// there when the load ends.
func (s *soak) endFaults(ctx context.Context) error {
	if s.joined != nil {
		if err := s.apply(ctx, fault{"remove that worker", (*soak).remove}); err != nil {
			return err
		}
	}
	if s.blackhole != nil {
		return s.apply(ctx, blackholeLeaves)
	}
	return nil
}

func (s *soak) apply(ctx context.Context, f fault) error {
	fmt.Fprintf(os.Stderr, "soak: %6.1fs  %s\n", time.Since(s.began).Seconds(), f.name)
	if err := f.inject(s, ctx); err != nil {
		return fmt.Errorf("%s: %w", f.name, err)
	}
	s.injected[f.name]++
	s.applied.Add(1)
	return nil
}

// victim is the image worker the fault now injected hits: the fault's
// place in the schedule, moved on by one worker every round, so that every
// fault hits every worker in turn whatever their number.
func (s *soak) victim() int {
	return (s.place + s.round) % len(s.images)
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

// spell is a fault that sets, with set(w, true), a fault of the next
// victim's for d, and then ends it with set(w, false).
func spell(d time.Duration, set func(s *soak, w *fakeworker.Worker, on bool)) func(*soak, context.Context) error {
	return func(s *soak, _ context.Context) error {
		w := s.images[s.victim()].Worker
		set(s, w, true)
		time.Sleep(d)
		set(s, w, false)
		return nil
	}
}

// failing answers failShare of a worker's jobs 500.
func failing(_ *soak, w *fakeworker.Worker, on bool) { w.SetFailRate(ifOn(on, failShare)) }

// breaking breaks breakShare of a worker's successful answers the way b
// says, after their status and half their body.
func breaking(b fakeworker.Break) func(*soak, *fakeworker.Worker, bool) {
	return func(_ *soak, w *fakeworker.Worker, on bool) { w.SetBreakRate(b, ifOn(on, breakShare)) }
}

// outOfMemory fails a worker's jobs of the mix's largest shape as sglang
// fails a job CUDA has no memory for: the load sends that shape, so each
// such job must run again on another worker.
func outOfMemory(s *soak, w *fakeworker.Worker, on bool) {
	w.SetOOMPixels(ifOn(on, largestPixels(mixes[s.o.mix])))
}

// ifOn is v while a fault is on, and the zero value, no fault, after.
func ifOn[T any](on bool, v T) T {
	if on {
		return v
	}
	var none T
	return none
}

// largestPixels is the largest width×height of the mix's jobs.
func largestPixels(mix []share) int {
	largest := 0
	for _, s := range mix {
		largest = max(largest, s.job.width*s.job.height)
	}
	return largest
}

// register starts a worker and registers it through the router's API, as
// miles adds an engine.
func (s *soak) register(ctx context.Context) error {
	_, err := s.join(ctx)
	return err
}

// remove removes the worker register added through the router's API and
// stops it removalGrace later, once the jobs it held have ended.
func (s *soak) remove(ctx context.Context) error {
	_, err := s.leave(ctx)
	return err
}

// join is register, returning the router's answer.
func (s *soak) join(ctx context.Context) (map[string]any, error) {
	s.joins++
	w, err := fakeworker.Start(fakeworker.Config{Name: fmt.Sprintf("%s%d", joinedWorkers, s.joins), UnitMs: s.o.unitMs})
	if err != nil {
		return nil, err
	}
	answer, err := s.controlOK(ctx, http.MethodPost, "/workers?url="+url.QueryEscape(w.URL()))
	if err != nil {
		w.Close()
		return nil, err
	}
	s.joined = w
	return answer, nil
}

// leave is remove, returning the router's answer (nil with no worker to
// remove).
func (s *soak) leave(ctx context.Context) (map[string]any, error) {
	w := s.joined
	if w == nil {
		return nil, nil
	}
	s.joined = nil
	defer w.Close()
	answer, err := s.controlOK(ctx, http.MethodDelete, "/workers/"+url.PathEscape(w.URL()))
	if err != nil {
		return nil, err
	}
	time.Sleep(removalGrace)
	return answer, nil
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

// control calls one of the router's control endpoints on the image site,
// with body as JSON (none if nil), and returns the status and the JSON
// answer.
func (s *soak) control(ctx context.Context, method, path string, body any) (int, map[string]any, error) {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return 0, nil, err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, s.imagesURL()+path, rd)
	if err != nil {
		return 0, nil, err
	}
	// A connection of its own: a reload closes the kept-alive ones, and
	// a call written on one just then is never read (see client.onResend).
	req.Close = true
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	var answer map[string]any
	if err == nil {
		err = json.Unmarshal(raw, &answer)
	}
	if err != nil {
		return resp.StatusCode, nil, fmt.Errorf("%s %s: %s: %w: %.300s", method, path, resp.Status, err, raw)
	}
	return resp.StatusCode, answer, nil
}

// controlOK is control for a call without a body that must answer 200.
func (s *soak) controlOK(ctx context.Context, method, path string) (map[string]any, error) {
	status, answer, err := s.control(ctx, method, path, nil)
	if err == nil && status != http.StatusOK {
		err = fmt.Errorf("%s %s: %d %v", method, path, status, answer)
	}
	return answer, err
}

// config is the router's config: the image workers' pool on one site, the
// video worker's on another, the admin API on a third port, the fleet's
// record in a storage folder of the run's own. Re-runs also follow a
// worker's 500 (sglang's answer to a scheduler error), since the schedule
// injects those; probes run every soakHealth, so that workers that crashed
// or hung are seen within the schedule's faults. Until a worker has
// answered, each is taken for one of speed 1 (initial_speed), so that the
// blackhole's first jobs are copied as soon as one of speed 1 would have
// answered them several times over. A weight update waits weights_timeout
// for a worker's call, so that a hung one holds it up that long.
// max_held_answer lies between the image answers and the rollout answers
// (see soakHeldAnswer), so that images are held until whole and rollouts
// stream, as rollouts with trajectories do past the default. A job may go
// to soakAttempts workers (max_attempts), as the schedule may fail one on
// three.
func (s *soak) config() ([]byte, error) {
	workers := s.images.URLs()
	if s.blackhole != nil {
		workers = append(workers, s.blackhole.URL())
	}
	text := caddyGlobals(s.ports.admin, s.storage, "\tservers {\n\t\tprotocols h1\n\t}\n\tlog {\n\t\tlevel WARN\n\t}\n") + fmt.Sprintf(`:%d {
	diffusion_router soak-images {
		workers %s
		retry_on 500
		max_attempts %d
		queue_order %s
		initial_speed %g
		health_interval %s
		health_timeout %s
		weights_timeout %s
		drain_timeout %s
		max_held_answer %d
	}
}
:%d {
	diffusion_router soak-videos {
		workers %s
		health_interval %s
		health_timeout %s
	}
}
`, s.ports.images, strings.Join(workers, " "), soakAttempts, s.order, 1000/s.o.unitMs,
		soakHealth, soakHealth, soakWeightsTimeout, soakDrainTimeout, soakHeldAnswer,
		s.ports.videos, s.video.URL(), soakHealth, soakHealth)
	cfg, _, err := testrouter.Adapt([]byte(text), "soak.Caddyfile")
	return cfg, err
}

// The soak router's options.
const (
	soakHealth         = "1s" // health_interval and health_timeout
	soakWeightsTimeout = 3 * time.Second
	soakDrainTimeout   = 10 * time.Second
	// soakHeldAnswer is max_held_answer: above the image answers of the
	// soak's load (1.6 KB: a 1 KB image in base64 in JSON) and below its
	// rollout answers (2.7 KB of msgpack), as the fake worker makes them.
	soakHeldAnswer = 2048
	// soakAttempts is max_attempts, one above the default. The first round
	// may fail an image job on three workers, the default's budget of
	// copies and re-runs together: the worker crashed at the start refuses
	// it, its re-run lands on the blackhole, and the blackhole's copy on
	// the hung worker, whose restart fails the copy; the job then waits on
	// the blackhole until the blackhole leaves and answers 503. A fourth
	// attempt is a second copy, on a worker that has not failed the job.
	soakAttempts = 4
)
