package diffusionrouter_test

import (
	"cmp"
	"fmt"
	"maps"
	"net"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// dnsServer answers DNS queries on 127.0.0.1 from records the test
// changes while the router looks them up.
type dnsServer struct {
	addr    string
	queries atomic.Int64

	mu      sync.Mutex
	records map[string][]dns.RR // by lower-case name; a name without records does not exist
	rcode   int                 // answered instead of the records when not RcodeSuccess
}

func startDNS(t *testing.T) *dnsServer {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &dnsServer{addr: pc.LocalAddr().String(), records: map[string][]dns.RR{}}
	started := make(chan struct{})
	srv := &dns.Server{PacketConn: pc, Handler: dns.HandlerFunc(s.serve), NotifyStartedFunc: func() { close(started) }}
	go func() { _ = srv.ActivateAndServe() }()
	<-started
	t.Cleanup(func() { _ = srv.Shutdown() })
	return s
}

func (s *dnsServer) serve(w dns.ResponseWriter, r *dns.Msg) {
	s.queries.Add(1)
	m := new(dns.Msg)
	m.SetReply(r)
	s.mu.Lock()
	defer s.mu.Unlock()
	q := r.Question[0]
	rrs, known := s.records[strings.ToLower(q.Name)]
	switch {
	case s.rcode != dns.RcodeSuccess:
		m.Rcode = s.rcode
	case !known:
		m.Rcode = dns.RcodeNameError
	}
	if m.Rcode == dns.RcodeSuccess {
		for _, rr := range rrs {
			if rr.Header().Rrtype == q.Qtype {
				m.Answer = append(m.Answer, rr)
			}
		}
	}
	_ = w.WriteMsg(m)
}

// set makes name answer the records, given in zone file syntax; with none,
// the name does not exist.
func (s *dnsServer) set(t *testing.T, name string, records ...string) {
	t.Helper()
	var rrs []dns.RR
	for _, text := range records {
		rr, err := dns.NewRR(text)
		if err != nil {
			t.Fatal(err)
		}
		rrs = append(rrs, rr)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(rrs) == 0 {
		delete(s.records, name)
		return
	}
	s.records[name] = rrs
}

// answerAll makes every query answer rcode (RcodeSuccess: the records).
func (s *dnsServer) answerAll(rcode int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.rcode = rcode
}

// waitLookups waits until the router has looked the names up a few times
// more, so that at least one whole round began and ended after now.
func (s *dnsServer) waitLookups(t *testing.T) {
	t.Helper()
	seen := s.queries.Load()
	testrouter.WaitFor(t, func() bool { return s.queries.Load() >= seen+12 })
}

// podFleet is fake workers as the pods behind a headless Service: each on
// an address of its own, all on one port, since A records carry no port.
type podFleet struct {
	port    int
	ip      map[string]string // worker name -> its loopback address
	workers map[string]*fakeworker.Worker
}

// startPods starts one fake worker per name on 127.0.0.2, 127.0.0.3, ...,
// all on one port.
func startPods(t *testing.T, cfg fakeworker.Config, names ...string) *podFleet {
	t.Helper()
	cfg.UnitMs = cmp.Or(cfg.UnitMs, 1)
	for range 10 { // another process may hold the port on one address
		if f := tryPods(t, cfg, names); f != nil {
			return f
		}
	}
	t.Fatal("found no port free on every loopback address")
	return nil
}

func tryPods(t *testing.T, cfg fakeworker.Config, names []string) *podFleet {
	f := &podFleet{ip: map[string]string{}, workers: map[string]*fakeworker.Worker{}}
	var lns []net.Listener
	for i, name := range names {
		ip := fmt.Sprintf("127.0.0.%d", i+2)
		ln, err := net.Listen("tcp", net.JoinHostPort(ip, fmt.Sprint(f.port)))
		if err != nil && i == 0 {
			t.Skipf("no loopback address but 127.0.0.1 to listen on (%v): the test needs Linux's 127.0.0.0/8", err)
		}
		if err != nil {
			for _, l := range lns {
				l.Close()
			}
			return nil
		}
		f.port = ln.Addr().(*net.TCPAddr).Port
		f.ip[name] = ip
		lns = append(lns, ln)
	}
	for i, name := range names {
		c := cfg
		c.Name = name
		w := fakeworker.New(c)
		go func() { _ = w.Serve(lns[i]) }()
		t.Cleanup(w.Close)
		f.workers[name] = w
	}
	return f
}

// records are the A records of name for the named pods.
func (f *podFleet) records(name string, pods ...string) []string {
	out := make([]string, len(pods))
	for i, p := range pods {
		out[i] = fmt.Sprintf("%s 0 IN A %s", name, f.ip[p])
	}
	return out
}

// urls are the worker URLs of the named pods.
func (f *podFleet) urls(pods ...string) []string {
	out := make([]string, len(pods))
	for i, p := range pods {
		out[i] = fmt.Sprintf("http://%s:%d", f.ip[p], f.port)
	}
	return out
}

// dnsSite is a router that looks its workers up on the test's DNS server
// every 50 ms.
func dnsSite(srv *dnsServer, lines ...string) string {
	return "diffusion_router {\n" + strings.Join(lines, "\n") + "\n dns_refresh 50ms\n dns_resolvers " + srv.addr + "\n}"
}

// sources is what /workers says keeps each worker in the pool, by URL.
func sources(t *testing.T, r *testrouter.Router) map[string]string {
	t.Helper()
	out := map[string]string{}
	for u, w := range r.Workers() {
		out[u] = w["source"].(string)
	}
	return out
}

// waitForWorkers waits until the pool has exactly these workers.
func waitForWorkers(t *testing.T, r *testrouter.Router, urls ...string) {
	t.Helper()
	want := slices.Sorted(slices.Values(urls))
	var got []string
	if !testkit.WaitUntil(10*time.Second, func() bool {
		got = slices.Sorted(maps.Keys(r.Workers()))
		return slices.Equal(got, want)
	}) {
		t.Fatalf("the pool has workers %v; want %v", got, want)
	}
}

func TestDNSDiscoveryFollowsRecordsUnderLoad(t *testing.T) {
	dnsSrv := startDNS(t)
	pods := startPods(t, fakeworker.Config{UnitMs: 20}, "a", "b", "c", "d", "e")
	const name = "workers.rollout.test."
	dnsSrv.set(t, name, pods.records(name, "a", "b")...)
	r := testrouter.Start(t, dnsSite(dnsSrv, fmt.Sprintf("workers_dns %s %d", name, pods.port)))
	waitForWorkers(t, r, pods.urls("a", "b")...)
	for u, src := range sources(t, r) {
		if src != "dns" {
			t.Fatalf("%s has source %q; want dns", u, src)
		}
	}

	stop, answered := load(t, r, 8)
	steps := [][]string{
		{"b", "c", "d"}, // a leaves, c and d join
		{"d", "e"},      // b and c leave, e joins
		{"e", "a"},      // d leaves, a comes back
	}
	// Each step publishes its records, waits until the pool has just those
	// workers, and then until each has served three requests sent after that.
	// Between the pool following a step and the next step's records, only
	// the step's workers may serve.
	type window struct{ from, to time.Time }
	windows := make([]window, len(steps))
	for i, names := range steps {
		published := time.Now()
		if i > 0 {
			windows[i-1].to = published
		}
		dnsSrv.set(t, name, pods.records(name, names...)...)
		waitForWorkers(t, r, pods.urls(names...)...)
		windows[i].from = time.Now()
		for _, n := range names {
			testrouter.WaitFor(t, func() bool {
				return answered(func(s sample) bool { return s.worker == n && s.sent.After(windows[i].from) }) >= 3
			})
		}
	}
	samples := stop()
	windows[len(steps)-1].to = time.Now()

	for _, s := range samples {
		if s.status != 200 {
			t.Fatalf("a request sent at %s was answered %d while the records changed", s.sent.Format(time.StampMicro), s.status)
		}
		for i, w := range windows {
			if s.sent.After(w.from) && s.received.Before(w.to) && !slices.Contains(steps[i], s.worker) {
				t.Fatalf("worker %s got a job while DNS named only %v, after the pool had followed", s.worker, steps[i])
			}
		}
	}
	t.Logf("%d requests, all answered 200", len(samples))
}

func TestDNSLookupFailureKeepsWorkers(t *testing.T) {
	dnsSrv := startDNS(t)
	pods := startPods(t, fakeworker.Config{}, "a", "b")
	const name = "workers.rollout.test."
	dnsSrv.set(t, name, pods.records(name, "a", "b")...)
	r := testrouter.Start(t, testrouter.MetricsSite(dnsSite(dnsSrv, fmt.Sprintf("workers_dns %s %d", name, pods.port))))
	waitForWorkers(t, r, pods.urls("a", "b")...)
	synced := func() float64 {
		return testrouter.Value(t, r, "caddy_diffusion_discovery_synced", map[string]string{"source": "dns"})
	}
	if v := synced(); v != 1 {
		t.Fatalf("discovery_synced while DNS answers: %v; want 1", v)
	}

	for _, fault := range []struct {
		name  string
		apply func()
	}{
		{"server failure", func() { dnsSrv.answerAll(dns.RcodeServerFailure) }},
		{"refused", func() { dnsSrv.answerAll(dns.RcodeRefused) }},
		{"name gone", func() { dnsSrv.answerAll(dns.RcodeSuccess); dnsSrv.set(t, name) }},
		{"only addresses that are never workers", func() {
			dnsSrv.set(t, name, name+" 0 IN A 169.254.169.254", name+" 0 IN A 0.0.0.0")
		}},
	} {
		fault.apply()
		dnsSrv.waitLookups(t)
		if got := slices.Sorted(maps.Keys(r.Workers())); !slices.Equal(got, pods.urls("a", "b")) {
			t.Fatalf("%s: the pool has workers %v; want the last ones DNS named", fault.name, got)
		}
		testrouter.ExpectStatus(t, fault.name+": /health", r.Get("/health"), 200)
		testrouter.ExpectStatus(t, fault.name+": a generation", r.Post("/v1/images/generations", testrouter.SmallImage), 200)
		if v := synced(); v != 0 {
			t.Errorf("%s: discovery_synced %v; want 0", fault.name, v)
		}
	}

	dnsSrv.set(t, name, pods.records(name, "b")...)
	waitForWorkers(t, r, pods.urls("b")...) // answers again: the pool follows
	testrouter.WaitFor(t, func() bool { return synced() == 1 })
}

func TestDiscoveredListedAndRegisteredWorkersCoexist(t *testing.T) {
	dnsSrv := startDNS(t)
	pods := startPods(t, fakeworker.Config{}, "a", "b", "listed", "registered")
	const name = "workers.rollout.test."
	dnsSrv.set(t, name, append(pods.records(name, "a", "listed"), name+" 0 IN A 169.254.169.254")...)
	listed, registered := pods.urls("listed")[0], pods.urls("registered")[0]
	r := testrouter.Start(t, dnsSite(dnsSrv, "workers "+listed, fmt.Sprintf("workers_dns %s %d", name, pods.port)))
	waitForWorkers(t, r, append(pods.urls("a"), listed)...) // not the metadata address
	testrouter.ExpectStatus(t, "registration", r.Post("/workers?url="+url.QueryEscape(registered), ""), 200)

	want := map[string]string{pods.urls("a")[0]: "dns", listed: "config", registered: "registered"}
	if got := sources(t, r); !maps.Equal(got, want) {
		t.Fatalf("sources %v; want %v", got, want)
	}

	// DNS now names b and the registered worker, and no longer a or the
	// listed one: a leaves, the others stay for their own reasons.
	dnsSrv.set(t, name, pods.records(name, "b", "registered")...)
	waitForWorkers(t, r, append(pods.urls("b"), listed, registered)...)
	want = map[string]string{pods.urls("b")[0]: "dns", listed: "config", registered: "registered"}
	if got := sources(t, r); !maps.Equal(got, want) {
		t.Fatalf("sources %v; want %v", got, want)
	}
	for range 6 {
		testrouter.ExpectStatus(t, "a generation", r.Post("/v1/images/generations", testrouter.SmallImage), 200)
	}
}

func TestDNSWorkerJoinsAtThePoolsWeights(t *testing.T) {
	dnsSrv := startDNS(t)
	pods := startPods(t, fakeworker.Config{}, "a", "b")
	const name = "workers.rollout.test."
	dnsSrv.set(t, name, pods.records(name, "a")...)
	r := testrouter.Start(t, dnsSite(dnsSrv, fmt.Sprintf("workers_dns %s %d", name, pods.port)))
	waitForWorkers(t, r, pods.urls("a")...)
	testrouter.ExpectStatus(t, "update", r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/step-1"}`), 200)

	dnsSrv.set(t, name, pods.records(name, "a", "b")...)
	waitForWorkers(t, r, pods.urls("a", "b")...)
	servedByB := 0
	for servedByB == 0 {
		rp := r.Post("/v1/images/generations", testrouter.SmallImage)
		testrouter.ExpectStatus(t, "a generation", rp, 200)
		if v := rp.Header.Get(weightVersionHeader); v != "/ckpt/step-1" {
			t.Fatalf("%s answered from weights %q, after the update to /ckpt/step-1", rp.Header.Get("X-Fake-Worker"), v)
		}
		if rp.Header.Get("X-Fake-Worker") == "b" {
			servedByB++
		}
	}
	if got := pods.workers["b"].Weights(); got != "/ckpt/step-1" {
		t.Fatalf("the worker that joined serves weights %q", got)
	}
}

func TestDNSDiscoverySRV(t *testing.T) {
	dnsSrv := startDNS(t)
	ws := namedWorkers(t, 3, fakeworker.Config{UnitMs: 50})
	const name = "_http._tcp.workers.rollout.test."
	// SRV targets stay names, dialled through the system's resolver:
	// localhost is the one name every test machine resolves.
	records := func(ws ...*fakeworker.Worker) (rrs, urls []string) {
		for _, w := range ws {
			_, port, _ := net.SplitHostPort(strings.TrimPrefix(w.URL(), "http://"))
			rrs = append(rrs, fmt.Sprintf("%s 0 IN SRV 0 0 %s localhost.", name, port))
			urls = append(urls, "http://localhost:"+port)
		}
		return rrs, urls
	}
	rrs, urls := records(ws[0], ws[1])
	dnsSrv.set(t, name, rrs...)
	r := testrouter.Start(t, dnsSite(dnsSrv, "workers_srv "+name))
	waitForWorkers(t, r, urls...)

	rrs, urls = records(ws[1], ws[2])
	dnsSrv.set(t, name, rrs...)
	waitForWorkers(t, r, urls...)
	// Jobs of 50 ms, sent at once: each worker runs one at a time, so
	// both get some.
	var mu sync.Mutex
	var wg sync.WaitGroup
	served := map[string]int{}
	for range 8 {
		wg.Go(func() {
			rp := testrouter.Do(t, "POST", r.Base+"/v1/images/generations", strings.NewReader(`{"response_format":"b64_json","prompt":"x","size":"512x512","num_inference_steps":4}`))
			mu.Lock()
			defer mu.Unlock()
			served[fmt.Sprint(rp.Status, " ", rp.Header.Get("X-Fake-Worker"))]++
		})
	}
	wg.Wait()
	if len(served) != 2 || served["200 b"] == 0 || served["200 c"] == 0 {
		t.Fatalf("answers by status and worker %v; want 200 from b and c only", served)
	}
}

func TestDNSWorkersSurviveReload(t *testing.T) {
	dnsSrv := startDNS(t)
	pods := startPods(t, fakeworker.Config{}, "a", "listed")
	const name = "workers.rollout.test."
	dnsSrv.set(t, name, pods.records(name, "a")...)
	site := dnsSite(dnsSrv, fmt.Sprintf("workers_dns %s %d", name, pods.port))
	r := testrouter.Start(t, site)
	waitForWorkers(t, r, pods.urls("a")...)
	testrouter.ExpectStatus(t, "a generation", r.Post("/v1/images/generations", testrouter.SmallImage), 200)

	r.Load(site)
	a := r.Workers()[pods.urls("a")[0]]
	if a == nil || a["requests_served"] != 1.0 {
		t.Fatalf("after a reload the discovered worker is %v; want it kept, with its one request served", a)
	}

	r.Load("diffusion_router {\n workers " + pods.urls("listed")[0] + "\n}")
	waitForWorkers(t, r, pods.urls("listed")...) // a config without the lookup lets its workers go
	for _, stack := range testkit.Stacks() {
		if strings.Contains(stack, "(*discovery).run") {
			t.Fatalf("the unloaded configs' lookups still run:\n%s", stack)
		}
	}
}

func TestDNSDiscoveryAAAA(t *testing.T) {
	ln, err := net.Listen("tcp", "[::1]:0")
	if err != nil {
		t.Skipf("no IPv6 loopback: %v", err)
	}
	w := fakeworker.New(fakeworker.Config{Name: "v6", UnitMs: 1})
	go func() { _ = w.Serve(ln) }()
	t.Cleanup(w.Close)
	port := ln.Addr().(*net.TCPAddr).Port
	dnsSrv := startDNS(t)
	const name = "workers.rollout.test."
	dnsSrv.set(t, name, name+" 0 IN AAAA ::1")
	r := testrouter.Start(t, dnsSite(dnsSrv, fmt.Sprintf("workers_dns %s %d", name, port)))
	waitForWorkers(t, r, fmt.Sprintf("http://[::1]:%d", port))
	rp := r.Post("/v1/images/generations", testrouter.SmallImage)
	testrouter.ExpectStatus(t, "a generation", rp, 200)
	if got := rp.Header.Get("X-Fake-Worker"); got != "v6" {
		t.Fatalf("served by %q; want the worker of the AAAA record", got)
	}
}
