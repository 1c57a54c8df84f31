package diffusionrouter_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"syscall"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/msgpack"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// A worker that answers 200 and then breaks its answer, each way the fake
// worker breaks one: cuts (the connection closed or reset short of the
// promised Content-Length, or a complete HTTP answer whose JSON or msgpack
// is cut in half), or a 200 page of HTML, labelled text/html, in place of
// the endpoint's answer: a small page, held whole whatever the answer's
// size would have been.
var (
	cuts   = []fakeworker.Break{fakeworker.BreakClose, fakeworker.BreakReset, fakeworker.BreakTruncate}
	breaks = append(cuts, fakeworker.BreakHTML)
)

// generation is a job and the check that its answer is whole, as its
// client would decode it.
type generation struct {
	path, body string
	decode     func([]byte) error
}

var (
	imageJob   = generation{"/v1/images/generations", testrouter.SmallImage, func(b []byte) error { return json.Unmarshal(b, new(map[string]any)) }}
	rolloutJob = generation{"/rollout/generate", `{"prompt":"a cat","seed":1,"width":8,"height":8,"num_inference_steps":1}`,
		func(b []byte) error { _, err := msgpack.Unmarshal(b); return err }}
)

// answer is what a client read: the status, who served it, the body as far
// as it came, and how reading it ended.
type answer struct {
	status int
	worker string
	body   []byte
	err    error // nil when the body ended as its framing said
}

// post sends a job to the router and reads its answer to the end, whether
// or not that end is clean.
func post(t *testing.T, r *testrouter.Router, g generation) answer {
	t.Helper()
	resp, err := testrouter.Client.Post(r.Base+g.path, "application/json", strings.NewReader(g.body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return answer{resp.StatusCode, resp.Header.Get("X-Fake-Worker"), body, err}
}

func TestBrokenAnswerRunsAgainOnAnotherWorker(t *testing.T) {
	for _, g := range []generation{imageJob, rolloutJob} {
		for _, b := range breaks {
			t.Run(fmt.Sprintf("%s/%s", g.path, b), func(t *testing.T) {
				ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "breaks"}, fakeworker.Config{Name: "good"})
				ws[0].SetBreakRate(b, 1)
				// Room for four of these answers held at once (4 KiB each),
				// no more: answers whose room was never given back would
				// soon leave none, and a broken answer would then stream
				// to its client.
				pool := fmt.Sprintf("held-%s-%s", strings.Split(g.path, "/")[1], b) // counters of their own
				r := testrouter.Start(t, testrouter.MetricsSite("diffusion_router "+pool+" {\n workers "+testrouter.URLs(ws)+
					"\n policy round_robin\n max_fails 100\n max_held_total 16KiB\n}"))
				reruns, held := counter(t, r, "job_reruns_total", "pool", pool, "cause", "cut_short"), counter(t, r, "broken_answers_total", "pool", pool, "delivery", "held")
				for i := range 8 {
					a := post(t, r, g)
					if a.status != http.StatusOK || a.err != nil || g.decode(a.body) != nil {
						t.Fatalf("job %d: status %d, %d bytes, read error %v, decodes: %v; want a whole answer", i, a.status, len(a.body), a.err, g.decode(a.body))
					}
					if a.worker != "good" {
						t.Fatalf("job %d answered by %q; want the worker that does not break its answers", i, a.worker)
					}
				}
				broken := ws[0].Stats().Broken
				if broken == 0 {
					t.Fatal("no answer was broken; the test proves nothing")
				}
				if got := r.Workers()[ws[0].URL()]["failures"]; got != float64(broken) {
					t.Errorf("the worker that broke %d answers shows %v failures", broken, got)
				}
				if got := reruns(); got != float64(broken) {
					t.Errorf("job_reruns_total{cause=cut_short} rose by %g after %d broken answers", got, broken)
				}
				if got := held(); got != float64(broken) {
					t.Errorf("broken_answers_total{delivery=held} rose by %g after %d broken answers", got, broken)
				}
			})
		}
	}
}

func TestAnswerBrokenOnEveryAttemptIsAnError(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a"}, fakeworker.Config{Name: "b"})
	for _, w := range ws {
		w.SetBreakRate(fakeworker.BreakTruncate, 1)
	}
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n max_attempts 2\n max_fails 100\n}")
	a := post(t, r, rolloutJob)
	if a.status != http.StatusBadGateway || a.err != nil {
		t.Fatalf("status %d, read error %v; want a 502 read whole", a.status, a.err)
	}
	rp := testrouter.Reply{Status: a.status, Body: a.body}
	if msg := rp.ErrorText(t); !strings.Contains(msg, "cut short") {
		t.Fatalf("error %q does not say the answer was cut short", msg)
	}
	for _, w := range ws {
		if got := r.Workers()[w.URL()]["failures"]; got != 1.0 {
			t.Errorf("worker %s, one of the two attempts, shows %v failures; want 1", w.URL(), got)
		}
	}
}

// TestHTMLPageIsNoAnswer: a 200 page of HTML from a JSON or msgpack
// endpoint passed as a success because the worker labelled it text/html.
// It is checked as what the endpoint answers: with no other worker to run
// the job, the client gets a 502 JSON error.
func TestHTMLPageIsNoAnswer(t *testing.T) {
	for _, g := range []generation{imageJob, rolloutJob} {
		t.Run(g.path, func(t *testing.T) {
			ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "proxied", HTMLRate: 1})
			r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n max_fails 100\n}")
			a := post(t, r, g)
			rp := testrouter.Reply{Status: a.status, Body: a.body}
			testrouter.ExpectStatus(t, g.path+" answered by a page of HTML", rp, http.StatusBadGateway)
			if msg := rp.ErrorText(t); !strings.Contains(msg, "Worker request failed: its 200 answer is not the") {
				t.Fatalf("error %q does not say the worker's answer is not the endpoint's", msg)
			}
			if got := r.Workers()[ws[0].URL()]["failures"]; got != float64(ws[0].Stats().Broken) {
				t.Errorf("the worker shows %v failures after %d pages of HTML", got, ws[0].Stats().Broken)
			}
		})
	}
}

func TestBrokenVideoJobAnswerDoesNotRunAgain(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "breaks", TaskType: "T2V"}, fakeworker.Config{Name: "good", TaskType: "T2V"})
	ws[0].SetBreakRate(fakeworker.BreakTruncate, 1)
	r := testrouter.Start(t, "diffusion_router {\n workers "+ws[0].URL()+" "+ws[1].URL()+"\n policy round_robin\n max_fails 100\n}")
	statuses := map[string]int{}
	for range 2 {
		a := post(t, r, generation{"/v1/videos", `{"prompt":"a cat","num_frames":4,"num_inference_steps":1}`, nil})
		statuses[fmt.Sprint(a.status, a.worker)]++
	}
	// The job its worker answered for may exist there: the client gets an
	// error, not a second video, and never the cut answer as a success.
	if statuses["502"] != 1 || statuses["200good"] != 1 {
		t.Fatalf("answers %v; want one 502, and one 200 from the good worker", statuses)
	}
}

// counter reads caddy_diffusion_<name> over the series with the labels
// given as name, value pairs, and returns how much it has risen since.
func counter(t *testing.T, r *testrouter.Router, name string, labels ...string) func() float64 {
	t.Helper()
	want := map[string]string{}
	for i := 0; i+1 < len(labels); i += 2 {
		want[labels[i]] = labels[i+1]
	}
	before := testrouter.Value(t, r, "caddy_diffusion_"+name, want)
	return func() float64 { return testrouter.Value(t, r, "caddy_diffusion_"+name, want) - before }
}

// connectionReset reports whether err, from reading an answer, is the
// router resetting the connection.
func connectionReset(err error) bool {
	return errors.Is(err, syscall.ECONNRESET)
}

func TestBrokenAnswerTooLargeToHoldResetsTheClient(t *testing.T) {
	for _, b := range cuts {
		t.Run(b.String(), func(t *testing.T) {
			ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "breaks", ImageBytes: 256 << 10})
			pool := "streamed-" + b.String() // counters of its own
			r := testrouter.Start(t, testrouter.MetricsSite("diffusion_router "+pool+" {\n workers "+testrouter.URLs(ws)+"\n max_fails 100\n max_held_answer 64KiB\n}"))
			broken, streamed := counter(t, r, "broken_answers_total", "pool", pool, "delivery", "streamed"), counter(t, r, "streamed_answers_total", "pool", pool, "reason", "size")
			whole := post(t, r, imageJob)
			if whole.status != http.StatusOK || whole.err != nil || imageJob.decode(whole.body) != nil {
				t.Fatalf("an answer larger than max_held_answer: status %d, %d bytes, %v", whole.status, len(whole.body), whole.err)
			}
			ws[0].SetBreakRate(b, 1)
			a := post(t, r, imageJob)
			if a.status != http.StatusOK || !connectionReset(a.err) || len(a.body) >= len(whole.body) {
				t.Fatalf("status %d, %d of %d bytes, read error %v; want the answer's beginning, then the connection reset", a.status, len(a.body), len(whole.body), a.err)
			}
			if got := r.Workers()[ws[0].URL()]["failures"]; got != 1.0 {
				t.Errorf("the worker that broke its answer shows %v failures; want 1", got)
			}
			if got := broken(); got != 1 {
				t.Errorf("broken_answers_total{delivery=streamed} rose by %g; want 1", got)
			}
			if got := streamed(); got != 2 {
				t.Errorf("streamed_answers_total{reason=size} rose by %g after two answers over max_held_answer", got)
			}
		})
	}
}

func TestAnswersStreamWhenTheHoldBudgetIsTaken(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "breaks", ImageBytes: 64 << 10})
	ws[0].SetBreakRate(fakeworker.BreakTruncate, 1)
	r := testrouter.Start(t, testrouter.MetricsSite("diffusion_router {\n workers "+testrouter.URLs(ws)+"\n max_fails 100\n max_held_total 16KiB\n}"))
	streamed := counter(t, r, "streamed_answers_total", "reason", "budget")
	a := post(t, r, imageJob)
	if a.status != http.StatusOK || !connectionReset(a.err) {
		t.Fatalf("status %d, read error %v; an answer beyond max_held_total streams, and a break resets the client", a.status, a.err)
	}
	if got := streamed(); got != 1 {
		t.Errorf("streamed_answers_total{reason=budget} rose by %g; want 1", got)
	}
}
