// Command bench measures how well miles-diffusion-router spreads diffusion
// generation jobs over workers of unequal speed, against the ideal and
// against Caddy's own load balancing, all in one process and without a GPU.
//
// For each routing strategy it starts fresh fake sglang-diffusion workers
// (internal/fakeworker: one job at a time, first come first served, a job
// of cost c keeps a worker of speed s busy for c × unit-ms / s
// milliseconds, where c = (width × height / 1024²) × steps) and loads a
// fresh router config in-process with caddy.Load: a new port and a new
// pool name, so nothing the router learned about the workers carries over.
// Every strategy then gets the same warm-up (--warmup jobs of the mix, by
// default two per worker, sent at once and awaited, so that least_work has
// seen every worker's speed) and the same measured requests.
//
// Strategies (--strategies, comma-separated):
//
//	least_work/fifo, least_work/largest_first  diffusion_router policy least_work with that queue_order
//	least_request, round_robin, random         diffusion_router policy of that name
//	caddy/least_conn, caddy/round_robin        a plain reverse_proxy with that lb_policy, no diffusion_router
//
// Any "<policy>" or "<policy>/<queue_order>" is passed to diffusion_router
// and any "caddy/<lb_policy>" to reverse_proxy; a strategy whose config Caddy
// refuses (say, a policy this build of the router does not have) is
// reported as not run and the others go on.
//
// A suffix runs a strategy on several routers, as replicas behind one
// Kubernetes Service: "least_work/fifo@2" is two routers, each with a pool
// of its own and all the workers; "least_work/fifo@2split" is two routers
// that each own every other worker. The client sends its requests to the
// routers in turn.
//
// Modes (--mode):
//
//	batch     all --n jobs at once, like a rollout step. makespan is the time
//	          until the last answer; ÷bound divides it by the lower bound
//	          max(longest job on the fastest worker, total cost / total speed)
//	          and ÷LPT by the makespan of a simulated ideal router (one
//	          central queue, largest job first, perfect knowledge, no
//	          overhead). The latency columns are each answer's time since the
//	          batch was released.
//	open      Poisson arrivals at a rate that offers --util of the fleet's
//	          capacity (in cost units per second, by the mix's mean cost);
//	          the same arrival trace for every strategy. Latency is request
//	          sent → response read. "ideal (simulated)" replays the trace
//	          through one central FIFO queue whose head goes to the first
//	          free worker (the fastest, if several are free); mean÷ideal and
//	          p99÷ideal compare against it.
//	overhead  --clients closed loops send the lightest real generation
//	          request (a 1x1 image, 1 step: no service time to speak of)
//	          for --duration; req/s is what the proxy path sustains, and
//	          worker/job the fake worker's own time per request (its
//	          one-job slot and timer, a few µs; HTTP handling excluded).
//	all       batch, open and overhead in turn.
//	soak      a long mixed load with faults injected on a schedule (below);
//	          not part of all.
//	oversample  --steps RL steps back to back, each needing --n groups of
//	          --group images that pass a filter dropping --filter-rate of
//	          the groups (drawn with --seed): sent exactly, the dropped
//	          groups sent again, against --oversample times as many sent at
//	          once and the rest aborted (POST /abort_request with the step's
//	          id prefix) once enough have passed. It runs on the first of
//	          --strategies and reports the step times; not part of all.
//	adapters  LoRA placement against switching per request and a static
//	          split, on --adapters adapters and one worker of speed 1 per
//	          adapter (unless --speeds says otherwise) whose set_lora takes
//	          --lora-switch to change the adapter, jobs of --job-time:
//	          phase 1 sends --adapter-jobs jobs of each adapter at once,
//	          phase 2 moves all demand to adapter a (see adapters.go); not
//	          part of all.
//	failover  two routers of one pool with `ha etcd` (a real etcd, which
//	          must be on the PATH; lease_ttl --lease-ttl) as processes of
//	          their own behind a Caddy reverse_proxy that checks /readyz;
//	          --clients clients that retry as miles does (any error, 1 s
//	          apart, 60 times) send small images through the proxy while
//	          the active router is killed with SIGKILL --kills times, a
//	          second of load before each, and a new standby started in its
//	          place after each. It reports the time from each kill to the
//	          standby's /readyz 200 (median, max) and the requests sent,
//	          answered, lost and retried (see failover.go); not part of all.
//	refit     one rollout step of --n jobs of --mix sent at once, each with
//	          X-Weight-Version-Policy latest, then (fresh workers and router)
//	          max-staleness:1, --runs times alternating, on 8 workers of
//	          speed 1 unless --speeds says otherwise. All start on step-1
//	          (tensors sent to each worker, declared with checksums);
//	          --refit-after the release a trainer refits them --refit-group
//	          at a time past the router: pause_generation, each worker's own
//	          update_weights_from_tensor, a sleep of --transfer for the
//	          transfer (the fake loads at once), continue_generation with
//	          step-2 and checksums. It reports the makespan, the share of
//	          the available workers' time (those not being refit) that they
//	          held no job while jobs waited in the router's queue (GET
//	          /workers every 10 ms) and the answers by X-Weight-Version,
//	          median and range over the runs (see refit.go); not part of all.
//	schedule  the router's scheduler alone (its pool: queue, dispatch,
//	          speeds learned from nothing, timers; and each job's attempts:
//	          held answers, hedged copies, stall watches, re-runs) on a
//	          virtual clock, with no HTTP and no sleeping, for each fleet
//	          size of --fleets (workers of --speeds repeated; default 1,2):
//	          a batch of --per-worker jobs per worker sent at once, its
//	          makespan ÷ the earliest-finish schedule's (longest job first,
//	          each on the worker that ends it first, true times known) and
//	          ÷ the lower bound; then as many jobs (at least --open-jobs,
//	          default 16,384) in an open loop at --util, the mean and p99
//	          wait (arrival to its worker beginning it) ÷ least_work/fifo's. The median over seeds 1-5, for each
//	          diffusion_router strategy of --strategies (default
//	          least_work/fifo, least_work/largest_first and least_work, the
//	          router's default order); not part of all. With --hang
//	          silent|stall, worker 0 of every 64 hangs after its first job
//	          (its /health answering): it answers no more, or each answer
//	          stops halfway; then only the batch runs, with hedge_after off
//	          and at its default, and the report says how many jobs were
//	          never answered, how many copies ran and won, and how many
//	          jobs ran again after a stall.
//	cluster   the schedule mode's batch through the whole router: Caddy
//	          (./cmd/caddy, or --caddy) and --speeds-repeated fake workers
//	          (./cmd/fakeworker) as processes of their own on 127.0.0.1,
//	          for each fleet size of --fleets (default 4,32,128) and each
//	          strategy of --strategies (default least_work, the router's
//	          defaults, and caddy/least_conn), --runs alternating rounds of
//	          a warm-up (2 jobs per worker) and one batch of --per-worker
//	          jobs per worker sent at once, each on a fresh router. It
//	          reports the makespan ÷ the earliest-finish schedule and ÷ the
//	          lower bound, medians over the rounds, and the router
//	          process's CPU per job; not part of all.
//
// The soak runs the router as a process of its own, Caddy built from
// ./cmd/caddy (or --caddy), so that the memory, goroutines and open files
// it reports are the router's and not those of the fake workers and clients
// in the bench. The router has two pools: the --speeds image workers, and
// one video worker. --clients closed loops send --n requests in all (or
// run for --duration, or --rounds of the schedule, when given), after
// --warmup of the same load: 89% images of --mix, 10% rollouts
// (/rollout/generate), 1% video jobs (create, poll until done, fetch,
// delete). From the router's start, a blackhole is one more image worker:
// it takes jobs and never answers, its /health answering; once the
// schedule's first round is over it leaves the config by a reload and
// stops. Every --fault-every one fault of the schedule, in turn: an image
// worker crashes and starts again on its port a second later; the config
// is reloaded unchanged; an image worker hangs (its /health still answers)
// and is restarted 3 s later; an image worker answers 30% of its jobs 500
// for 3 s; a worker is registered through POST /workers; the config is
// reloaded with queue_order changed; that worker is removed through DELETE
// /workers/{id} and stopped; an image worker breaks half its answers after
// their 2xx status for 3 s, by closing the connection; an image worker
// fails the mix's largest jobs as sglang fails a CUDA out-of-memory, for
// 3 s; an image worker breaks half its answers by a reset; the weights are
// updated through the router while one image worker's update call hangs
// (the update must answer within drain_timeout plus 4 weights_timeout,
// failing on that worker alone, with jobs answered meanwhile; the worker is
// then restarted and must be brought to the new weights); an image worker
// truncates half its answers, Content-Length matching; the router's
// storage folder becomes a file (unwritable, even by root), a worker is
// registered, whose answer must say "persisted": false, and once the
// folder is back its removal must be persisted. Each fault moves on to the
// next image worker every round. The image pool re-runs a job after a 500
// (retry_on 500), takes workers for speed 1 until one answers
// (initial_speed), gives a worker's update call 3 s (weights_timeout) and
// holds answers of up to 2 KiB back until whole (max_held_answer: the
// image answers; the rollouts, 2.7 KB, stream); both pools probe their
// workers every second. Every 2xx answer is read whole and decoded (JSON,
// msgpack, base64 media): one that is not whole is a broken answer
// delivered as success. A 2xx over max_held_answer whose body broke off is
// a reset: the router streams it, and resets the client's connection when
// its worker breaks it. A request is lost when it got none of these nor a
// 4xx answer; each request not answered is printed as it happens, with its
// X-Request-Id (bench-<n>, as the router's job log has it), and summed by
// reason under the table. The table gives the requests by kind and fate,
// the re-runs, hedges and broken answers (the router's metrics), how long
// the updates took, the faults injected, and the router's resident memory,
// heap, goroutines and open files after the warm-up, half way and at the
// end (each after a garbage collection), and their peak.
//
// Mixes (--mix), POST /v1/images/generations with size and
// num_inference_steps:
//
//	uniform  100% 1024x1024 20 steps
//	mixed    50% 512x512 20 steps, 30% 1024x1024 30, 15% 1024x1024 50, 5% 2048x2048 50
//	heavy    90% 512x512 8 steps, 10% 1536x1536 50 steps
//
// Each run prints the command line and the settings, then one table per
// mode: strategy, requests, failed (any answer other than 200, or no
// answer), makespan or req/s, latency mean / p50 / p90 / p99 over the
// successful requests (nearest-rank percentiles), the ratio to the bound or
// the ideal, one column per worker ("w4×2" is worker 4, speed 2) with the
// jobs it answered and its share of the cost served, and how long the
// strategy's run took (start-up, warm-up, measuring, shut-down). The
// reasons for failures are listed under the table. --svg writes the latency
// CDF of every strategy, one panel per mode, as a self-contained SVG file.
//
// The default --unit-ms 10 makes a heavy batch of 400 take 10-20 s per
// strategy and the default batch run about two minutes.
//
// Run it from the repository root (-h lists every flag, with defaults):
//
//	go run ./cmd/bench --mode batch --mix heavy --n 400 --speeds 1,1,1,2
//	go run ./cmd/bench --mode open --mix heavy --util 0.7 --svg open.svg
//	go run ./cmd/bench --mode overhead --strategies least_work/fifo,caddy/least_conn
//	go run ./cmd/bench --mode soak --n 100000 --clients 6 --unit-ms 0.5
//	go run ./cmd/bench --mode oversample --n 32 --group 4 --steps 5 --mix uniform --speeds 1,1,1,1
//	go run ./cmd/bench --mode adapters --adapter-jobs 15 --lora-switch 5s --job-time 1s
//	go run ./cmd/bench --mode failover --kills 10 --clients 6 --speeds 1,1,1
//	go run ./cmd/bench --mode schedule --fleets 4,32,128,1024
//	go run ./cmd/bench --mode schedule --fleets 4,32,128 --strategies least_work --hang silent
//	go run ./cmd/bench --mode cluster --fleets 4,32,128 --runs 3
//	go run ./cmd/bench --mode refit --mix uniform --n 320 --unit-ms 3 --transfer 300ms --refit-after 300ms --runs 3
//
// --router URL drives a router that is already running instead: it is
// measured as it is (its own workers, strategy and learned state), once
// per mode, since the bench cannot restart it or change its strategy;
// --strategies is ignored, and --speeds and --unit-ms must describe its
// fleet for the bound and the ideal to mean anything. Per-worker columns
// then come from the X-Fake-Worker header, so they are empty for real
// workers.
//
// Timings are wall-clock on the machine that runs the bench, where client,
// router and workers share the CPUs, so a busy machine inflates them and
// the overhead mode's req/s can move by a third between runs; the ratios
// to the bound and the ideal are the numbers to compare.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// options are the parsed flags.
type options struct {
	mode        string
	mix         string
	speeds      []float64
	n           int
	util        float64
	unitMs      float64
	seed        uint64
	strategies  []strategy
	svg         string
	warmup      int
	router      string
	clients     int
	duration    time.Duration
	maxInflight int
	timeout     time.Duration
	durationSet bool          // --duration was given
	caddy       string        // soak: a built Caddy to run as the router
	faultEvery  time.Duration // soak: time between faults
	group       int           // oversample: images per group
	steps       int           // oversample: steps run
	filterRate  float64       // oversample: share of groups the filter drops
	oversample  float64       // oversample: groups sent per group needed
	rounds      int           // soak: rounds of the schedule after which the load ends; 0: no such end
	adapters    int           // adapters: LoRA adapters served
	adapterJobs int           // adapters: phase 1's jobs per adapter
	loraSwitch  time.Duration // adapters: how long a set_lora that changes the adapter takes
	jobTime     time.Duration // adapters: how long a job takes at speed 1
	kills       int           // failover: SIGKILLs of the active router
	leaseTTL    time.Duration // failover: the routers' lease_ttl
	refitGroup  int           // refit: workers refit at a time
	refitAfter  time.Duration // refit: time from the step's release to the first pause
	transfer    time.Duration // refit: how long a group's transfer takes
	runs        int           // refit: runs of each policy
	fleets      []int         // schedule: fleet sizes
	perWorker   int           // schedule: jobs per worker
	hang        string        // schedule: how hung workers answer; "": none hangs
	openJobs    int           // schedule: the fewest jobs of an open loop
}

func main() {
	o, err := parseFlags(os.Args[1:])
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(2)
	}
	if err := run(context.Background(), o, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func parseFlags(args []string) (options, error) {
	var o options
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.StringVar(&o.mode, "mode", "batch", "batch|open|overhead|all|soak|oversample|adapters|failover|refit|schedule|cluster")
	fs.StringVar(&o.mix, "mix", "heavy", "the jobs: "+mixNames())
	speeds := fs.String("speeds", "1,1,1,2", "one fake worker per value, its relative speed (adapters mode: one of speed 1 per adapter)")
	fs.IntVar(&o.n, "n", 400, "requests per strategy (batch and open); soak: requests in all; oversample: groups a step needs")
	fs.Float64Var(&o.util, "util", 0.7, "open mode: offered load as a share of the fleet's capacity")
	fs.Float64Var(&o.unitMs, "unit-ms", 10, "fake worker milliseconds per cost unit (one 1024x1024 step) at speed 1")
	fs.Uint64Var(&o.seed, "seed", 1, "seed of the job sequence and the arrival trace")
	list := fs.String("strategies", defaultStrategies, "comma-separated: <policy>[/<queue_order>] for diffusion_router, caddy/<lb_policy> for plain reverse_proxy")
	fs.StringVar(&o.svg, "svg", "", "write the latency CDFs to this SVG file")
	fs.IntVar(&o.warmup, "warmup", -1, "jobs of the mix sent at once and awaited before measuring (-1: 2 per worker; soak: the soak's load, 1000 requests)")
	fs.StringVar(&o.router, "router", "", "measure this running router (http://host:port) instead of starting workers and routers")
	fs.IntVar(&o.clients, "clients", 16, "overhead and soak modes: concurrent clients")
	fs.DurationVar(&o.duration, "duration", 3*time.Second, "overhead mode: measuring time per strategy; soak: longest run when given (else --n decides)")
	fs.IntVar(&o.maxInflight, "max-inflight", 0, "max_inflight for least_work strategies (0: the router's default)")
	fs.DurationVar(&o.timeout, "timeout", 10*time.Minute, "limit on one strategy's run (soak: on the whole run); requests still open then fail")
	fs.StringVar(&o.caddy, "caddy", "", "soak, failover and cluster: the Caddy binary to run as the router (default: build ./cmd/caddy)")
	fs.IntVar(&o.kills, "kills", 10, "failover mode: SIGKILLs of the active router")
	fs.DurationVar(&o.leaseTTL, "lease-ttl", 5*time.Second, "failover mode: the routers' ha etcd lease_ttl (whole seconds)")
	fs.DurationVar(&o.faultEvery, "fault-every", 2*time.Second, "soak: time between the faults of the schedule")
	fs.IntVar(&o.group, "group", 4, "oversample: images per group (samples of one prompt)")
	fs.IntVar(&o.steps, "steps", 5, "oversample: rollout steps, back to back")
	fs.Float64Var(&o.filterRate, "filter-rate", 0.3, "oversample: share of the groups the filter drops, drawn with --seed")
	fs.Float64Var(&o.oversample, "oversample", 1.5, "oversample: groups sent at a step's start per group needed")
	fs.IntVar(&o.rounds, "rounds", 0, "soak: end the load once the schedule of faults has gone round this many times (0: --n or --duration decides)")
	fs.IntVar(&o.adapters, "adapters", 4, "adapters mode: LoRA adapters, named a, b, c, ...")
	fs.IntVar(&o.adapterJobs, "adapter-jobs", 15, "adapters mode: phase 1's jobs per adapter (phase 2 sends as many in all, of adapter a)")
	fs.DurationVar(&o.loraSwitch, "lora-switch", 5*time.Second, "adapters mode: how long a fake worker's set_lora takes when it changes the adapter")
	fs.DurationVar(&o.jobTime, "job-time", time.Second, "adapters mode: how long a job takes at speed 1 (rounded to whole steps of --unit-ms)")
	fs.IntVar(&o.refitGroup, "refit-group", 2, "refit mode: workers paused and refit at a time")
	fs.DurationVar(&o.refitAfter, "refit-after", time.Second, "refit mode: time from the step's release to the first pause")
	fs.DurationVar(&o.transfer, "transfer", time.Second, "refit mode: how long a group's weight transfer takes (a sleep between the direct update_weights_from_tensor calls and continue_generation)")
	fs.IntVar(&o.runs, "runs", 1, "refit and cluster modes: runs of each policy or strategy, alternating")
	fleets := fs.String("fleets", "", "schedule and cluster modes: fleet sizes, each of --speeds repeated (default 4,32,128,1024; cluster 4,32,128)")
	fs.IntVar(&o.perWorker, "per-worker", 64, "schedule and cluster modes: jobs per worker in a batch (and in the schedule mode's open loop)")
	fs.IntVar(&o.openJobs, "open-jobs", 16384, "schedule mode: the fewest jobs of an open loop (on a small fleet, 64 per worker leave its p99 wait to three jobs)")
	fs.StringVar(&o.hang, "hang", "", "schedule mode: worker 0 of every 64 hangs after its first job, its /health answering: silent (answers no more) or stall (each answer stops halfway); the batch alone then runs, with hedge_after off and at its default")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	given := make(map[string]bool)
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	o.durationSet = given["duration"]
	switch {
	case o.mode == "adapters" && !given["speeds"]:
		*speeds = strings.Repeat("1,", o.adapters-1) + "1"
	case o.mode == "refit" && !given["speeds"]:
		*speeds = "1,1,1,1,1,1,1,1"
	case (o.mode == "schedule" || o.mode == "cluster") && !given["speeds"]:
		*speeds = "1,2"
	}
	switch {
	case o.mode == "schedule" && !given["strategies"]:
		*list = scheduleStrategies
	case o.mode == "cluster" && !given["strategies"]:
		*list = clusterStrategies
	}
	switch {
	case *fleets != "":
	case o.mode == "cluster":
		*fleets = "4,32,128"
	default:
		*fleets = "4,32,128,1024"
	}
	var err error
	if o.speeds, err = parseSpeeds(*speeds); err != nil {
		return o, err
	}
	if o.strategies, err = parseStrategies(*list); err != nil {
		return o, err
	}
	if o.fleets, err = parseFleets(*fleets); err != nil {
		return o, err
	}
	switch {
	case o.warmup >= 0:
	case o.mode == "soak":
		o.warmup = 1000
	default:
		o.warmup = 2 * len(o.speeds)
	}
	o.router = strings.TrimRight(o.router, "/")
	return o, o.check()
}

func (o options) check() error {
	switch {
	case !slices.Contains([]string{"batch", "open", "overhead", "all", "soak", "oversample", "adapters", "failover", "refit", "schedule", "cluster"}, o.mode):
		return fmt.Errorf("--mode %q: want batch, open, overhead, all, soak, oversample, adapters, failover, refit, schedule or cluster", o.mode)
	case mixes[o.mix] == nil:
		return fmt.Errorf("--mix %q: want %s", o.mix, mixNames())
	case o.n <= 0, o.unitMs <= 0, o.util <= 0, o.clients <= 0, o.duration <= 0, o.timeout <= 0, o.faultEvery <= 0:
		return errors.New("--n, --unit-ms, --util, --clients, --duration, --timeout and --fault-every must be positive")
	case o.group <= 0, o.steps <= 0, o.filterRate < 0, o.filterRate >= 1, o.oversample < 1:
		return errors.New("--group and --steps must be positive, --filter-rate from 0 to below 1, --oversample at least 1")
	case o.rounds < 0:
		return errors.New("--rounds must not be negative")
	case o.adapters < 1, o.adapters > 26, o.adapterJobs < 1, o.loraSwitch <= 0, o.jobTime <= 0:
		return errors.New("--adapters must be from 1 to 26, --adapter-jobs, --lora-switch and --job-time positive")
	case o.mode == "adapters" && o.router != "":
		return errors.New("--router: the adapters mode starts its own workers, whose switch time it sets")
	case o.mode == "soak" && o.router != "":
		return errors.New("--router: the soak starts and reloads its own router")
	case o.mode == "failover" && o.router != "":
		return errors.New("--router: the failover mode starts and kills its own routers")
	case (o.mode == "cluster" || o.mode == "schedule") && o.router != "":
		return fmt.Errorf("--router: the %s mode starts its own workers and routers", o.mode)
	case o.mode == "refit" && o.router != "":
		return errors.New("--router: the refit mode starts its own workers, whose weights it transfers")
	case o.perWorker < 1, o.openJobs < 1:
		return errors.New("--per-worker and --open-jobs must be positive")
	case o.hang != "" && hangDescriptions[o.hang] == "":
		return fmt.Errorf("--hang %q: want silent or stall", o.hang)
	case o.refitGroup < 1, o.refitAfter < 0, o.transfer < 0, o.runs < 1:
		return errors.New("--refit-group and --runs must be positive, --refit-after and --transfer not negative")
	case o.kills < 1, o.leaseTTL < time.Second, o.leaseTTL%time.Second != 0:
		return errors.New("--kills must be positive and --lease-ttl whole seconds, at least 1s")
	case o.router != "" && !strings.HasPrefix(o.router, "http://") && !strings.HasPrefix(o.router, "https://"):
		return fmt.Errorf("--router %q: want http://host:port", o.router)
	}
	return nil
}

// fmtFleets reads like "4, 32 and 128".
func fmtFleets(fleets []int) string {
	s := make([]string, len(fleets))
	for i, n := range fleets {
		s[i] = strconv.Itoa(n)
	}
	if len(s) == 1 {
		return s[0]
	}
	return strings.Join(s[:len(s)-1], ", ") + " and " + s[len(s)-1]
}

// parseFleets reads --fleets: positive numbers of workers.
func parseFleets(s string) ([]int, error) {
	var out []int
	for f := range strings.SplitSeq(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return nil, fmt.Errorf("--fleets %q: want positive numbers of workers separated by commas", s)
		}
		out = append(out, n)
	}
	return out, nil
}

func parseSpeeds(s string) ([]float64, error) {
	var out []float64
	for f := range strings.SplitSeq(s, ",") {
		v, err := strconv.ParseFloat(strings.TrimSpace(f), 64)
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("--speeds %q: want positive numbers separated by commas", s)
		}
		out = append(out, v)
	}
	return out, nil
}

// run prints the header, runs the modes and writes the SVG.
func run(ctx context.Context, o options, out io.Writer) error {
	cleanHome, err := testrouter.IsolateHome("diffusion-router-bench-")
	if err != nil {
		return err
	}
	defer cleanHome()
	printHeader(out, o)
	switch o.mode {
	case "schedule":
		if o.hang != "" {
			benchScheduleHang(o, out)
		} else {
			benchSchedule(o, out)
		}
		return nil
	case "cluster":
		return benchCluster(ctx, o, out)
	case "soak":
		return benchSoak(ctx, o, out)
	case "failover":
		return benchFailover(ctx, o, out)
	}

	modes := []string{o.mode}
	if o.mode == "all" {
		modes = []string{"batch", "open", "overhead"}
	}
	var panels []panel
	for _, m := range modes {
		switch m {
		case "batch":
			panels = append(panels, benchBatch(ctx, o, out))
		case "open":
			panels = append(panels, benchOpen(ctx, o, out))
		case "overhead":
			panels = append(panels, benchOverhead(ctx, o, out))
		case "oversample":
			panels = append(panels, benchOversample(ctx, o, out))
		case "adapters":
			panels = append(panels, benchAdapters(ctx, o, out))
		case "refit":
			panels = append(panels, benchRefit(ctx, o, out))
		}
	}
	if o.svg == "" {
		return nil
	}
	f, err := os.Create(o.svg)
	if err != nil {
		return err
	}
	if err := writeSVG(f, panels); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	fmt.Fprintf(out, "\nwrote %s\n", o.svg)
	return nil
}

func printHeader(out io.Writer, o options) {
	fmt.Fprintf(out, "command: go run ./cmd/bench%s\n", shellArgs(os.Args[1:]))
	names := make([]string, len(o.strategies))
	for i, s := range o.strategies {
		names[i] = s.name
	}
	inflight := "router default"
	if o.maxInflight > 0 {
		inflight = fmt.Sprint(o.maxInflight)
	}
	fmt.Fprintf(out, "settings: mode=%s mix=%s n=%d speeds=%s unit-ms=%g seed=%d warmup=%d util=%g clients=%d duration=%s max-inflight=%s\n",
		o.mode, o.mix, o.n, fmtSpeeds(o.speeds), o.unitMs, o.seed, o.warmup, o.util, o.clients, o.duration, inflight)
	switch {
	case o.mode == "soak":
		fmt.Fprintf(out, "fleet:    %d fake image workers on 127.0.0.1, speeds %s, a blackhole until the schedule's first round is over, and one video worker of its own pool, %gms per cost unit at speed 1; faults every %s\n",
			len(o.speeds), fmtSpeeds(o.speeds), o.unitMs, o.faultEvery)
	case o.mode == "failover":
		fmt.Fprintf(out, "fleet:    %d fake workers on 127.0.0.1, speeds %s, %gms per cost unit at speed 1; two routers, lease_ttl %s, %d kills\n",
			len(o.speeds), fmtSpeeds(o.speeds), o.unitMs, o.leaseTTL, o.kills)
		fmt.Fprintf(out, "jobs:     %s, from %d clients in closed loops\n", failoverBody, o.clients)
	case o.mode == "adapters":
		fmt.Fprintf(out, "fleet:    %d fake workers on 127.0.0.1, speeds %s, a set_lora that changes the adapter taking %s, fresh for every strategy\n",
			len(o.speeds), fmtSpeeds(o.speeds), o.loraSwitch)
		fmt.Fprintf(out, "jobs:     %s at %gms per cost unit: %s each at speed 1; seed %d\n",
			adapterJob(o), o.unitMs, fmtSeconds(adapterJob(o).cost()*o.unitMs/1000), o.seed)
	case o.mode == "refit":
		fmt.Fprint(out, refitDescription(o))
	case o.mode == "schedule" || o.mode == "cluster":
		fmt.Fprintf(out, "fleets:   %s simulated workers, speeds %s repeated, %gms per cost unit at speed 1\n", fmtFleets(o.fleets), fmtSpeeds(o.speeds), o.unitMs)
		fmt.Fprintf(out, "strategies: %s\n", strings.Join(names, ", "))
	case o.router != "":
		fmt.Fprintf(out, "router:   %s (external: measured as it runs; --speeds and --unit-ms are taken to describe its fleet)\n", o.router)
	default:
		fmt.Fprintf(out, "fleet:    %d fake workers on 127.0.0.1, speeds %s, %gms per cost unit at speed 1 (capacity %.0f units/s), fresh for every strategy\n",
			len(o.speeds), fmtSpeeds(o.speeds), o.unitMs, sum(o.speeds)*1000/o.unitMs)
		fmt.Fprintf(out, "strategies: %s\n", strings.Join(names, ", "))
	}
	if o.mode == "oversample" {
		fmt.Fprintf(out, "steps:    %d back to back, each needing %d groups of %d images; the filter drops %.0f%% of groups; oversample %gx; router %s\n",
			o.steps, o.n, o.group, 100*o.filterRate, o.oversample, o.strategies[0].name)
	}
	if o.mode != "adapters" && o.mode != "failover" { // their jobs are all alike
		fmt.Fprintf(out, "mix:      %s: %s\n", o.mix, describeMix(mixes[o.mix]))
	}
	fmt.Fprintf(out, "machine:  %s, %d CPUs, GOMAXPROCS %d, %s\n",
		runtime.Version(), runtime.NumCPU(), runtime.GOMAXPROCS(0), time.Now().Format(time.RFC3339))
}

// shellArgs quotes args for a shell, each with a leading space.
func shellArgs(args []string) string {
	var b strings.Builder
	for _, a := range args {
		b.WriteByte(' ')
		if a != "" && strings.Trim(a, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_=.,/:") == "" {
			b.WriteString(a)
		} else {
			b.WriteString("'" + strings.ReplaceAll(a, "'", `'\''`) + "'")
		}
	}
	return b.String()
}
