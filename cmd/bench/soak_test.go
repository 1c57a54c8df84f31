package main

import (
	"context"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

func TestParseSoakFlags(t *testing.T) {
	o, err := parseFlags([]string{"--mode", "soak", "--n", "100000"})
	if err != nil {
		t.Fatal(err)
	}
	if o.warmup != 1000 || o.durationSet || o.faultEvery != 2*time.Second {
		t.Errorf("parsed %+v", o)
	}
	if o, err = parseFlags([]string{"--mode", "soak", "--duration", "5m"}); err != nil || !o.durationSet {
		t.Errorf("--duration 5m: durationSet %v, %v", o.durationSet, err)
	}
	if o, err = parseFlags([]string{"--mode", "soak", "--rounds", "2"}); err != nil || o.rounds != 2 {
		t.Errorf("--rounds 2: rounds %d, %v", o.rounds, err)
	}
	for _, bad := range [][]string{{"--mode", "soak", "--router", "http://x:1"}, {"--mode", "soak", "--fault-every", "0s"}, {"--mode", "soak", "--rounds", "-1"}} {
		if _, err := parseFlags(bad); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
}

// TestSoakConfig checks the router config the soak loads, and that the
// reload with a changed option changes only that option.
func TestSoakConfig(t *testing.T) {
	f, err := testrouter.StartFleet([]float64{1, 2}, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	video, err := fakeworker.Start(fakeworker.Config{TaskType: "T2V"})
	if err != nil {
		t.Fatal(err)
	}
	defer video.Close()
	s := &soak{o: options{unitMs: 0.5}, images: f, video: video, order: "fifo", storage: "/tmp/soak/storage"}
	if err := s.startBlackhole(); err != nil {
		t.Fatal(err)
	}
	defer s.blackhole.Close()
	s.ports.images, s.ports.videos, s.ports.admin = 10001, 10002, 10003

	first, err := s.config()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"soak-images"`, `"soak-videos"`, `"retry_on":[500]`, `"max_attempts":4`, `"order":"fifo"`, `"listen":"127.0.0.1:10003"`,
		`"initial_speed":2000`, `"timeout":3000000000`, `"drain_timeout":10000000000`, `"max_held":2048`,
		`"storage":{"module":"file_system","root":"/tmp/soak/storage"}`, f[1].URL(), s.blackhole.URL(), video.URL()} {
		if !strings.Contains(string(first), want) {
			t.Errorf("config lacks %s:\n%s", want, first)
		}
	}
	s.order = otherOrder(s.order)
	changed, err := s.config()
	if err != nil {
		t.Fatal(err)
	}
	if want := strings.Replace(string(first), `"order":"fifo"`, `"order":"largest_first"`, 1); string(changed) != want {
		t.Errorf("changed config:\n%s\nwant:\n%s", changed, want)
	}
	blackhole := s.blackhole.URL()
	s.blackhole = nil
	if gone, err := s.config(); err != nil || strings.Contains(string(gone), blackhole) || !strings.Contains(string(gone), f[0].URL()) {
		t.Errorf("config once the blackhole left: %v\n%s", err, gone)
	}
}

func TestParseMetrics(t *testing.T) {
	m := parseMetrics([]byte(`# HELP x_total X.
# TYPE x_total counter
x_total{pool="a",cause="status"} 3
x_total{pool="b",cause="status"} 2
x_total{pool="a",cause="connection"} 1
go_goroutines 42
process_resident_memory_bytes 6.5e+07
`))
	if got := m.sum("x_total", `cause="status"`); got != 5 {
		t.Errorf("status re-runs %g, want 5", got)
	}
	if got := m.sum("x_total", ""); got != 6 {
		t.Errorf("all re-runs %g, want 6", got)
	}
	if m.sum("go_goroutines", "") != 42 || m.sum("process_resident_memory_bytes", "") != 6.5e7 {
		t.Errorf("parsed %v", m)
	}
}

func TestTallyFates(t *testing.T) {
	tl := newTally()
	tl.add(kindImage, 1, nil)
	tl.add(kindImage, 2, &statusError{status: 429, body: "queue full"})
	tl.add(kindRollout, 3, &statusError{status: 502, body: "Worker request failed"})
	tl.add(kindVideo, 4, errors.New("create POST: EOF"))
	tl.add(kindRollout, 5, &cutError{length: soakHeldAnswer + 1, err: io.ErrUnexpectedEOF}) // streamed, then broken
	tl.add(kindImage, 6, &cutError{length: soakHeldAnswer, err: io.ErrUnexpectedEOF})       // held, yet cut off: lost
	tl.add(kindImage, 7, whole("", errors.New("unexpected end of JSON input")))
	if tl.total(answered) != 1 || tl.total(refused) != 1 || tl.total(lost) != 3 || tl.total(reset) != 1 || tl.total(broken) != 1 {
		t.Errorf("counts %v", tl.counts)
	}
	if tl.requests() != 7 || tl.unanswered() != 6 {
		t.Errorf("%d requests, %d unanswered", tl.requests(), tl.unanswered())
	}
	if tl.counts[kindVideo][lost] != 1 || tl.reasons["video lost: create POST: EOF"] != 1 {
		t.Errorf("video counts %v, reasons %v", tl.counts[kindVideo], tl.reasons)
	}
}

// TestAnswerChecks: the soak's checks pass the whole answers of a fake
// worker, and fail them cut in half at any byte, as a worker that breaks
// its answer sends them.
func TestAnswerChecks(t *testing.T) {
	msgpackWorker, err := fakeworker.Start(fakeworker.Config{UnitMs: 0.001})
	if err != nil {
		t.Fatal(err)
	}
	defer msgpackWorker.Close()
	jsonWorker, err := fakeworker.Start(fakeworker.Config{RolloutJSON: true, UnitMs: 0.001})
	if err != nil {
		t.Fatal(err)
	}
	defer jsonWorker.Close()
	type answer struct {
		name  string
		body  []byte
		check func([]byte) error
	}
	var answers []answer
	for _, w := range []*fakeworker.Worker{msgpackWorker, jsonWorker} {
		body, header := fakeAnswer(t, w, "/rollout/generate", rolloutRequest(1))
		answers = append(answers, answer{"rollout " + header.Get("Content-Type"), body, func(b []byte) error { return checkRollout(b, header.Get("Content-Type")) }})
	}
	image, _ := fakeAnswer(t, msgpackWorker, "/v1/images/generations", mixes["heavy"][0].job.request(1))
	answers = append(answers, answer{"image", image, checkImages})
	for _, a := range answers {
		if err := a.check(a.body); err != nil {
			t.Errorf("%s: whole answer refused: %v", a.name, err)
		}
		for cut := range len(a.body) {
			if a.check(a.body[:cut]) == nil {
				t.Errorf("%s: the first %d of %d bytes pass", a.name, cut, len(a.body))
				break
			}
		}
	}
	if checkImages([]byte(`{"data":[]}`)) == nil || checkImages([]byte(`{"data":[{"b64_json":""}]}`)) == nil {
		t.Error("an answer without an image passes")
	}
	if checkRollout([]byte(`[{"generated_output":null}]`), "application/json") == nil {
		t.Error("a rollout without its output passes")
	}
}

// fakeAnswer sends body to a fake worker and returns its 200 answer.
func fakeAnswer(t *testing.T, w *fakeworker.Worker, path string, body any) ([]byte, http.Header) {
	t.Helper()
	b, header, err := newClient([]string{w.URL()}, 1).call(context.Background(), "", http.MethodPost, path, 1, body)
	if err != nil {
		t.Fatal(err)
	}
	return b, header
}

// TestSoakHeldAnswer: max_held_answer in the soak holds the image answers
// of its load and streams its rollout answers.
func TestSoakHeldAnswer(t *testing.T) {
	w, err := fakeworker.Start(fakeworker.Config{UnitMs: 0.001})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	for _, mix := range mixes {
		for _, share := range mix {
			if image, _ := fakeAnswer(t, w, "/v1/images/generations", share.job.request(999999)); len(image) > soakHeldAnswer {
				t.Errorf("an answer to %s is %d bytes, over %d: it would stream", share.job, len(image), soakHeldAnswer)
			}
		}
	}
	if rollout, _ := fakeAnswer(t, w, "/rollout/generate", rolloutRequest(1)); len(rollout) <= soakHeldAnswer {
		t.Errorf("a rollout's answer is %d bytes, within %d: it would be held", len(rollout), soakHeldAnswer)
	}
}

// TestStorageBroken: while the storage folder is broken nothing can be
// written under it, whoever runs the test, and afterwards what it held is
// back.
func TestStorageBroken(t *testing.T) {
	s := &soak{storage: filepath.Join(t.TempDir(), "storage")}
	kept := filepath.Join(s.storage, "kept")
	if err := os.MkdirAll(kept, 0o700); err != nil {
		t.Fatal(err)
	}
	err := s.withStorageBroken(func() error {
		return os.MkdirAll(filepath.Join(s.storage, "diffusion_router", "pool"), 0o700)
	})
	if err == nil {
		t.Error("a folder was made in the broken storage")
	}
	if _, err := os.Stat(kept); err != nil {
		t.Errorf("after: %v", err)
	}
	if err := s.withStorageBroken(func() error { return nil }); err != nil {
		t.Errorf("mending: %v", err)
	}
}

// TestCheckUpdate: an update with a hung call must fail on that worker,
// and on no other but the blackhole.
func TestCheckUpdate(t *testing.T) {
	s := &soak{}
	result := func(worker string, status float64) any {
		return map[string]any{"worker_url": worker, "status_code": status}
	}
	answer := func(results ...any) map[string]any { return map[string]any{"results": results} }
	if err := s.checkUpdate(502, answer(result("http://a", 200), result("http://hung", 502)), "http://hung"); err != nil {
		t.Error(err)
	}
	for _, bad := range []struct {
		status int
		answer map[string]any
	}{
		{200, answer(result("http://a", 200), result("http://hung", 200))},
		{502, answer(result("http://a", 502), result("http://hung", 200))},
		{502, answer(result("http://a", 504), result("http://hung", 502))},
	} {
		if s.checkUpdate(bad.status, bad.answer, "http://hung") == nil {
			t.Errorf("%d %v passes", bad.status, bad.answer)
		}
	}
}

// TestSoakRound runs the soak's schedule once, at a fault every 10 ms, the
// blackhole present from the router's start, under a small load (jobs ten
// times the soak's, so that it leaves the CPUs to tests run beside it): the
// faults check what the router must do under each (an update with a hung
// call answers and fails on that worker alone, a registration while
// storage cannot be written says it is not persisted), and no request may
// be lost nor a broken answer delivered as success. It builds Caddy and
// runs it as a process.
func TestSoakRound(t *testing.T) {
	if testing.Short() {
		t.Skip("builds Caddy and runs it as a process for a round of faults, about 40 s")
	}
	o := testOptions(t, "--mode", "soak", "--rounds", "1", "--fault-every", "10ms", "--n", "100000000",
		"--clients", "4", "--unit-ms", "5", "--warmup", "100", "--timeout", "10m")
	s, r, err := runSoak(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	s.report(&out, r)
	t.Log(out.String())
	if r.t.total(answered) == 0 || r.t.total(lost) > 0 || r.t.total(broken) > 0 {
		t.Errorf("%d answered, %d lost, %d broken answers delivered as success", r.t.total(answered), r.t.total(lost), r.t.total(broken))
	}
	for _, f := range faults() {
		if s.injected[f.name] != 1 {
			t.Errorf("%q injected %d times, want once", f.name, s.injected[f.name])
		}
	}
}
