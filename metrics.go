package diffusionrouter

import (
	"errors"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/miles-rollout/miles-diffusion-router/internal/attempt"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// Metrics, in Caddy's registry, so they appear on the admin /metrics
// endpoint and through the metrics directive. Per-worker series are read
// from the pools when scraped, so a removed worker's series disappear with
// it; the rest are counters and histograms labelled by pool, endpoint class
// and status class only, never by request, prompt or raw path.

const namespace, subsystem = "caddy", "diffusion"

var (
	// Seconds to many minutes: an image takes seconds, a video minutes.
	latencyBuckets = []float64{0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 3600}

	queueWait = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: namespace, Subsystem: subsystem, Name: "queue_wait_seconds",
		Help:    "Time generation jobs waited in the router's queue for a worker.",
		Buckets: latencyBuckets,
	}, []string{"pool"})
	jobDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: namespace, Subsystem: subsystem, Name: "job_duration_seconds",
		Help:    "Time from handing a generation job to a worker to the end of its response.",
		Buckets: latencyBuckets,
	}, []string{"pool"})
	predictionError = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: namespace, Subsystem: subsystem, Name: "prediction_error_ratio",
		Help:    "|predicted - actual| / actual running time of completed jobs.",
		Buckets: []float64{0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10},
	}, []string{"pool"})
	routingDecisions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: namespace, Subsystem: subsystem, Name: "routing_decisions_total",
		Help: "Requests given a worker, by routing strategy.",
	}, []string{"pool", "strategy"})
	weightUpdates = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: namespace, Subsystem: subsystem, Name: "weight_updates_total",
		Help: "Weight updates, LoRA calls, sleeps and wakes by outcome (success, partial, drain_timeout, no_workers, abandoned).",
	}, []string{"pool", "operation", "outcome"})
	requests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: namespace, Subsystem: subsystem, Name: "requests_total",
		Help: "Requests by endpoint class and status class.",
	}, []string{"pool", "endpoint", "code"})
	reruns = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: namespace, Subsystem: subsystem, Name: "job_reruns_total",
		Help: "Jobs sent again to another worker, by why the last one failed them (connection, status, asleep, cut_short, stalled).",
	}, []string{"pool", "cause"})
	brokenAnswers = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: namespace, Subsystem: subsystem, Name: "broken_answers_total",
		Help: "2xx answers a worker broke off or cut short: held (none of it reached the client) or streamed (the client's connection was reset).",
	}, []string{"pool", "delivery"})
	streamedAnswers = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: namespace, Subsystem: subsystem, Name: "streamed_answers_total",
		Help: "2xx answers streamed rather than held whole, by reason: size (over max_held_answer, or it is off), budget (max_held_total taken).",
	}, []string{"pool", "reason"})
	hedges = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: namespace, Subsystem: subsystem, Name: "hedges_total",
		Help: "Copies of overrunning jobs: launched (each copy), won (a copy's answer went to the client), cancelled (the job's own attempt answered first).",
	}, []string{"pool", "outcome"})
	jobAttempts = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: namespace, Subsystem: subsystem, Name: "job_attempts",
		Help:    "Workers each finished generation job was sent to.",
		Buckets: []float64{1, 2, 3, 5, 10},
	}, []string{"pool"})
	bodyBytesHeld = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: namespace, Subsystem: subsystem, Name: "request_body_bytes_held",
		Help: "Bytes of request bodies the router holds at once (max_body_total bounds it).",
	}, []string{"pool"})
	bodiesRefused = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: namespace, Subsystem: subsystem, Name: "request_bodies_refused_total",
		Help: "Request bodies refused before they were read whole, by reason: budget (no room in max_body_total within 5 s), timeout (body_timeout passed).",
	}, []string{"pool", "reason"})

	collectors = []prometheus.Collector{queueWait, jobDuration, predictionError, routingDecisions, weightUpdates, requests, reruns, brokenAnswers, streamedAnswers, hedges, jobAttempts, bodyBytesHeld, bodiesRefused, poolCollector{}}

	// bodyRefusals are the reasons of bodiesRefused.
	bodyRefusals = []string{"budget", "timeout"}
)

// registerMetrics adds the collectors to the config's registry. Each config
// load has a new registry, and several handlers may share one.
func registerMetrics(ctx caddy.Context) error {
	reg := ctx.GetMetricsRegistry()
	if reg == nil {
		return nil
	}
	for _, c := range collectors {
		if err := reg.Register(c); err != nil && !errors.As(err, new(prometheus.AlreadyRegisteredError)) {
			return err
		}
	}
	return nil
}

// Per-worker and per-pool series, read from the pools at scrape time.
var (
	workerLabels = []string{"pool", "worker"}

	descInflight  = newDesc("worker_inflight_jobs", "Generation jobs in flight on the worker.", workerLabels...)
	descWorkLeft  = newDesc("worker_predicted_work_seconds", "Predicted time for the worker to finish its jobs.", workerLabels...)
	descSpeed     = newDesc("worker_speed", "Learned speed, in cost units (one 1024x1024 image step) per second.", workerLabels...)
	descState     = newDesc("worker_state", "1 for the worker's state, 0 for the others.", "pool", "worker", "state")
	descVersion   = newDesc("worker_weight_version_info", "The weight version the worker serves, as a label.", "pool", "worker", "version")
	descJobs      = newDesc("worker_jobs_total", "Generation jobs the worker completed.", workerLabels...)
	descCost      = newDesc("worker_cost_total", "Cost units of the jobs the worker completed.", workerLabels...)
	descFailures  = newDesc("worker_failures_total", "Failed requests to the worker (connection errors, 5xx answers, answers cut short), and failed LoRA calls of placement.", workerLabels...)
	descEjections = newDesc("worker_ejections_total", "Times the worker was ejected for failed requests.", workerLabels...)
	descQueue     = newDesc("queue_length", "Generation jobs waiting in the pool's queue.", "pool")
	descQueueBy   = newDesc("priority_queue_length", "Generation jobs waiting in the pool's queue, by priority.", "pool", "priority")
	descServing   = newDesc("serving_workers", "Workers of the pool that may be given jobs.", "pool")
	descSources   = newDesc("workers_by_version_source", "Workers of the pool by where the router learned their weight version: reported, router, declared, verified, or unknown (it cannot vouch for their weights since a declaration, and gives them no job).", "pool", "source")
	descBacklog   = newDesc("backlog_seconds", "Predicted time for the pool's workers to finish every job running and waiting, at their learned speeds.", "pool")
	descHALeader  = newDesc("ha_leader", "1 while this router is the active one of the pool's HA group, 0 while it stands by; only for pools with ha.", "pool")
	descSynced    = newDesc("discovery_synced", "1 while every lookup of the kind (dns, kubernetes) answered its last try, 0 while one fails and its workers are those of its last answer, or has not answered yet; only for pools that look workers up.", "pool", "source")
	descAborted   = newDesc("aborted_total", "Generation jobs ended by POST /abort_request, by where they were (waiting, running), and requests refused on arrival because an abort remembers their id (resent).", "pool", "state")
	descHeldBack  = newDesc("version_policy_held_total", "Generation jobs a version policy held back (latest, max_staleness): a worker could have taken them but for weights too stale for them; each job counts once.", "pool", "policy")

	tenantLabels      = []string{"pool", "tenant"}
	descTenantBacklog = newDesc("tenant_backlog_seconds", "Predicted time for the pool's workers to finish the tenant's jobs running and waiting, the queue played out by the tenants' shares.", tenantLabels...)
	descTenantQueue   = newDesc("tenant_queue_length", "Generation jobs of the tenant waiting in the pool's queue.", tenantLabels...)
	descTenantRunning = newDesc("tenant_inflight_jobs", "Generation jobs of the tenant holding a worker.", tenantLabels...)
	descTenantCost    = newDesc("tenant_cost_total", "Cost units of the tenant's jobs given workers (a hedged copy counts again, a re-run does not).", tenantLabels...)

	adapterLabels          = []string{"pool", "adapter"} // "" for the base weights
	descAdapterSwitches    = newDesc("adapter_switches_total", "Switches of a worker to the adapter that succeeded.", adapterLabels...)
	descAdapterSwitchTime  = newDesc("adapter_switch_seconds_total", "Time workers spent switching to the adapter, in seconds.", adapterLabels...)
	descAdapterSwitchFails = newDesc("adapter_switch_failures_total", "Switches of a worker to the adapter that failed.", adapterLabels...)
	descAdapterWaiting     = newDesc("adapter_waiting_cost", "Cost units of the jobs waiting for the adapter.", adapterLabels...)
	descAdapterHolders     = newDesc("adapter_workers", "Workers holding the adapter or switching to it.", adapterLabels...)
)

func newDesc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc(prometheus.BuildFQName(namespace, subsystem, name), help, labels, nil)
}

// poolCollector reports every live pool's workers.
type poolCollector struct{}

// Describe sends the descriptors of the per-worker series.
func (poolCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descInflight, descWorkLeft, descSpeed, descState, descVersion, descJobs, descCost, descFailures, descEjections, descQueue, descQueueBy, descServing, descSources, descBacklog, descHALeader, descTenantBacklog, descTenantQueue, descTenantRunning, descTenantCost, descAborted, descHeldBack, descSynced,
		descAdapterSwitches, descAdapterSwitchTime, descAdapterSwitchFails, descAdapterWaiting, descAdapterHolders} {
		ch <- d
	}
}

// Collect reads the pools now.
func (poolCollector) Collect(ch chan<- prometheus.Metric) {
	pools.Range(func(_, v any) bool {
		p := v.(*pool)
		sources := make(map[string]int, len(scheduler.VersionSources))
		for _, w := range p.Snapshot() {
			collectWorker(ch, p.Name(), w)
			sources[w.VersionFrom]++
		}
		for _, s := range scheduler.VersionSources {
			ch <- prometheus.MustNewConstMetric(descSources, prometheus.GaugeValue, float64(sources[s]), p.Name(), s)
		}
		stats := p.Stats()
		ch <- prometheus.MustNewConstMetric(descQueue, prometheus.GaugeValue, float64(stats.Queued), p.Name())
		for prio, n := range stats.ByPriority {
			ch <- prometheus.MustNewConstMetric(descQueueBy, prometheus.GaugeValue, float64(n), p.Name(), strconv.Itoa(prio))
		}
		ch <- prometheus.MustNewConstMetric(descServing, prometheus.GaugeValue, float64(p.ServingCount()), p.Name())
		ch <- prometheus.MustNewConstMetric(descBacklog, prometheus.GaugeValue, p.Backlog().Seconds(), p.Name())
		collectAborts(ch, p.Name(), p.AbortStats())
		for source, synced := range p.LookupsInSync() {
			ch <- prometheus.MustNewConstMetric(descSynced, prometheus.GaugeValue, boolFloat(synced), p.Name(), source)
		}
		for policy, n := range p.HeldBack() {
			ch <- prometheus.MustNewConstMetric(descHeldBack, prometheus.CounterValue, float64(n), p.Name(), policy)
		}
		if p.election.inGroup() {
			ch <- prometheus.MustNewConstMetric(descHALeader, prometheus.GaugeValue, boolFloat(p.election.Leading()), p.Name())
		}
		for _, a := range p.Adapters() { // the declared ones: bounded labels
			ch <- prometheus.MustNewConstMetric(descAdapterSwitches, prometheus.CounterValue, float64(a.Switches), p.Name(), a.Name)
			ch <- prometheus.MustNewConstMetric(descAdapterSwitchTime, prometheus.CounterValue, a.SwitchSeconds, p.Name(), a.Name)
			ch <- prometheus.MustNewConstMetric(descAdapterSwitchFails, prometheus.CounterValue, float64(a.Failures), p.Name(), a.Name)
			ch <- prometheus.MustNewConstMetric(descAdapterWaiting, prometheus.GaugeValue, a.WaitingCost, p.Name(), a.Name)
			ch <- prometheus.MustNewConstMetric(descAdapterHolders, prometheus.GaugeValue, float64(a.Holders), p.Name(), a.Name)
		}
		for _, tn := range p.Tenants() { // at most max_tenants and other: bounded labels
			ch <- prometheus.MustNewConstMetric(descTenantBacklog, prometheus.GaugeValue, tn.Backlog, p.Name(), tn.Name)
			ch <- prometheus.MustNewConstMetric(descTenantQueue, prometheus.GaugeValue, float64(tn.Waiting), p.Name(), tn.Name)
			ch <- prometheus.MustNewConstMetric(descTenantRunning, prometheus.GaugeValue, float64(tn.Running), p.Name(), tn.Name)
			ch <- prometheus.MustNewConstMetric(descTenantCost, prometheus.CounterValue, tn.Cost, p.Name(), tn.Name)
		}
		return true
	})
}

func collectWorker(ch chan<- prometheus.Metric, pool string, w scheduler.WorkerInfo) {
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, append([]string{pool, w.URL}, labels...)...)
	}
	counter := func(d *prometheus.Desc, v float64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, pool, w.URL)
	}
	gauge(descInflight, float64(w.Inflight))
	gauge(descWorkLeft, w.WorkLeft/w.Speed)
	gauge(descSpeed, w.Speed)
	for s := range scheduler.State(scheduler.StateCount) {
		gauge(descState, boolFloat(s == w.State), s.String())
	}
	if w.Version != "" {
		gauge(descVersion, 1, w.Version)
	}
	counter(descJobs, float64(w.Jobs))
	counter(descCost, w.Cost)
	counter(descFailures, float64(w.Failures))
	counter(descEjections, float64(w.Ejections))
}

func collectAborts(ch chan<- prometheus.Metric, pool string, s scheduler.AbortStats) {
	for state, n := range map[string]uint64{"waiting": s.Waiting, "running": s.Running, "resent": s.Resent} {
		ch <- prometheus.MustNewConstMetric(descAborted, prometheus.CounterValue, float64(n), pool, state)
	}
}

func boolFloat(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// statusClass is 2xx, 4xx, ...
func statusClass(status int) string {
	if status == 0 {
		status = 499 // nothing was written: the client left
	}
	if status < 100 || status > 599 {
		return strconv.Itoa(status/100) + "xx"
	}
	return statusClasses[status/100-1]
}

var statusClasses = [...]string{"1xx", "2xx", "3xx", "4xx", "5xx"}

// poolMetrics are one handler's series, looked up once rather than on
// every request.
type poolMetrics struct {
	queueWait, jobDuration, predictionError, attempts prometheus.Observer
	decisions                                         prometheus.Counter
	requests                                          *prometheus.CounterVec // by endpoint and code
	bodiesRefused                                     *prometheus.CounterVec // by reason
	runs                                              attempt.Metrics        // what becomes of attempts
}

func newPoolMetrics(pool, strategy string) poolMetrics {
	// The body budget's series exist from the pool's first config on, at
	// 0: its panels show 0 rather than no data, and rate() counts the
	// first refusal.
	bodyBytesHeld.WithLabelValues(pool)
	for _, reason := range bodyRefusals {
		bodiesRefused.WithLabelValues(pool, reason)
	}
	return poolMetrics{
		queueWait:       queueWait.WithLabelValues(pool),
		jobDuration:     jobDuration.WithLabelValues(pool),
		predictionError: predictionError.WithLabelValues(pool),
		decisions:       routingDecisions.WithLabelValues(pool, strategy),
		requests:        requests.MustCurryWith(prometheus.Labels{"pool": pool}),
		bodiesRefused:   bodiesRefused.MustCurryWith(prometheus.Labels{"pool": pool}),
		runs: attempt.Metrics{
			Reruns:   reruns.MustCurryWith(prometheus.Labels{"pool": pool}),
			Broken:   brokenAnswers.MustCurryWith(prometheus.Labels{"pool": pool}),
			Streamed: streamedAnswers.MustCurryWith(prometheus.Labels{"pool": pool}),
			Hedges:   hedges.MustCurryWith(prometheus.Labels{"pool": pool}),
		},
		attempts: jobAttempts.WithLabelValues(pool),
	}
}

// observeJob records the metrics of a finished generation job, which
// was sent to workers attempts times.
func (m poolMetrics) observeJob(t *scheduler.Ticket, attempts int, waited, took time.Duration) {
	m.queueWait.Observe(waited.Seconds())
	m.jobDuration.Observe(took.Seconds())
	m.attempts.Observe(float64(attempts))
	if t.Predicted() > 0 && took > 0 {
		m.predictionError.Observe(absDuration(t.Predicted()-took).Seconds() / took.Seconds())
	}
}

func absDuration(d time.Duration) time.Duration {
	if d < 0 {
		return -d
	}
	return d
}
