package attempt

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/answer"
	"github.com/miles-rollout/miles-diffusion-router/internal/clock"
	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// The tests run jobs on a real pool of workers that are functions: the
// attempt's Next calls the one its ticket holds, in the test's process,
// and every timer of the attempts runs on a clock the test moves.

// worker answers an attempt as a worker behind the proxy would: it writes
// the answer to w, or returns the proxy's error.
type worker func(w http.ResponseWriter, r *http.Request) error

// testFleet is a pool of worker functions and the Runner over it.
type testFleet struct {
	t     *testing.T
	pool  *scheduler.Pool
	cfg   scheduler.Config
	clock *fakeClock
	run   *Runner
	urls  []string

	mu      sync.Mutex
	workers map[string]worker
}

// newFleet is a fleet of n idle workers, whose jobs may go to 3 of them
// and are not hedged.
func newFleet(t *testing.T, n int) *testFleet {
	t.Helper()
	f := &testFleet{t: t, pool: scheduler.New("test", zap.NewNop()), clock: &fakeClock{now: time.Unix(1e9, 0)}, workers: map[string]worker{}}
	t.Cleanup(func() { _ = f.pool.Close() })
	for i := range n {
		f.urls = append(f.urls, "http://10.0.0."+strconv.Itoa(i+1)+":30000")
	}
	f.join(f.urls...)
	f.cfg = scheduler.Config{Strategy: scheduler.LeastWork{}, MaxAttempts: 3, MaxQueue: 100,
		Health: &scheduler.HealthConfig{Timeout: time.Second, StallFactor: 5, MaxFails: 100, FailWindow: time.Minute, EjectTime: time.Minute, MaxEjectTime: time.Minute}}
	f.run = &Runner{
		Pool: f.pool, Proxy: Proxy{NeverSent: isDialError, ClientLeft: func(error) bool { return false }, Vars: func(context.Context) map[string]any { return nil },
			WithVars: func(ctx context.Context, _ map[string]any) context.Context { return ctx }},
		Kinds: noKinds{}, Budget: answer.NewBudget(1<<20, 1<<24), StallTimeout: 10 * time.Second,
		Metrics: Metrics{Reruns: counters("cause"), Broken: counters("delivery"), Streamed: counters("reason"), Hedges: counters("outcome")},
		Logger:  zap.NewNop(), Clock: f.clock,
	}
	return f
}

// join has the workers at urls join the pool, ready to serve.
func (f *testFleet) join(urls ...string) {
	f.pool.Declare(urls)
	for _, u := range urls {
		f.pool.SetCapabilities(u, []string{"T2I"}, "fake/model")
	}
}

func counters(label string) *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Name: "test_total"}, []string{label})
}

// expectCount fails unless vec reads want for value.
func expectCount(t *testing.T, vec *prometheus.CounterVec, value string, want int) {
	t.Helper()
	var m dto.Metric
	if err := vec.WithLabelValues(value).Write(&m); err != nil {
		t.Fatal(err)
	}
	if got := int(m.GetCounter().GetValue()); got != want {
		t.Fatalf("%s: %d; want %d", value, got, want)
	}
}

// serve has the worker at url answer as w does.
func (f *testFleet) serve(url string, w worker) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.workers[url] = w
}

// ServeHTTP is the Next of the fleet's jobs: the proxy that sends an
// attempt to the worker its ticket holds.
func (f *testFleet) ServeHTTP(w http.ResponseWriter, r *http.Request) error {
	f.mu.Lock()
	wk := f.workers[scheduler.TicketFrom(r.Context()).ServedBy()]
	f.mu.Unlock()
	return wk(w, r)
}

// job is a client's image job, given a worker, in ctx.
type job struct {
	t      *scheduler.Ticket
	r      *http.Request
	client *httptest.ResponseRecorder
	rec    *Recorder
	leave  context.CancelFunc // the client leaves
}

const jobBody = `{"prompt":"a cat","size":"256x256"}`

func (f *testFleet) job(rid string) *job {
	f.t.Helper()
	ctx, leave := context.WithCancel(context.Background())
	f.t.Cleanup(leave)
	tk := f.pool.NewTicket(&f.cfg)
	tk.Job, tk.Cost, tk.Body, tk.RID = true, 1, []byte(jobBody), rid
	tk.Route = request.Endpoints.Match(http.MethodPost, &url.URL{Path: "/v1/images/generations"})
	ctx = tk.WithCancel(ctx)
	if err := f.pool.Track(tk); err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { f.pool.Untrack(tk) })
	if err := f.pool.Acquire(ctx, tk); err != nil {
		f.t.Fatal(err)
	}
	r := httptest.NewRequestWithContext(ctx, http.MethodPost, "/v1/images/generations", strings.NewReader(jobBody))
	client := httptest.NewRecorder()
	return &job{t: tk, r: r, client: client, rec: NewRecorder(client), leave: leave}
}

// runJob runs j to its end and returns what Run returned; a job that
// does not end within a bound no healthy run nears fails the test.
func (f *testFleet) runJob(j *job) error {
	f.t.Helper()
	select {
	case err := <-f.startJob(j):
		return err
	case <-time.After(10 * time.Second):
		f.t.Fatal("the job never ended")
		return nil
	}
}

// startJob runs j in the background; what Run returned arrives on the
// channel.
func (f *testFleet) startJob(j *job) <-chan error {
	ended := make(chan error, 1)
	go func() { ended <- f.run.Run(j.rec, j.r, j.t, f) }()
	return ended
}

// other is a worker of the fleet that is not url.
func (f *testFleet) other(url string) string {
	for _, u := range f.urls {
		if u != url {
			return u
		}
	}
	f.t.Fatal("no other worker")
	return ""
}

// expectIdle fails unless no worker of the fleet holds a job.
func (f *testFleet) expectIdle() {
	f.t.Helper()
	for _, u := range f.urls {
		if info, _ := f.pool.Worker(u); info.Inflight != 0 {
			f.t.Errorf("worker %s holds %d jobs after the job ended; want 0", u, info.Inflight)
		}
	}
}

// eventually waits, within a bound no healthy run nears, until cond holds.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("never: %s", what)
		}
	}
}

// expectAnswer fails unless j's client got status and body.
func expectAnswer(t *testing.T, j *job, status int, body string) {
	t.Helper()
	if j.client.Code != status || j.client.Body.String() != body {
		t.Fatalf("client got %d %q; want %d %q", j.client.Code, j.client.Body.String(), status, body)
	}
}

var errDial = errors.New("dial tcp: connection refused")

func isDialError(err error) bool { return errors.Is(err, errDial) }

// answers is a worker that answers status with body, as JSON.
func answers(status int, body string) worker {
	return func(w http.ResponseWriter, _ *http.Request) error {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		w.WriteHeader(status)
		_, err := w.Write([]byte(body))
		return err
	}
}

// answersAfter is a worker that, as its job arrives, moves the fleet's
// clock by d, gives a copy that is then due a while to start (it would at
// once), and answers the image.
func (f *testFleet) answersAfter(d time.Duration) worker {
	return func(w http.ResponseWriter, r *http.Request) error {
		f.clock.Advance(d)
		time.Sleep(50 * time.Millisecond)
		return answers(http.StatusOK, imageAnswer)(w, r)
	}
}

// hangs is a worker that never answers: its attempt ends when the router
// or the client ends it. entered, when set, is closed as the job arrives.
func hangs(entered chan struct{}) worker {
	return func(_ http.ResponseWriter, r *http.Request) error {
		if entered != nil {
			close(entered)
		}
		<-r.Context().Done()
		return r.Context().Err()
	}
}

// stalls is a worker whose 200 stops after its first bytes; wrote is
// closed once they went out.
func stalls(wrote chan struct{}) worker {
	return func(w http.ResponseWriter, r *http.Request) error {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write([]byte(imageAnswer[:10]))
		close(wrote)
		<-r.Context().Done()
		return r.Context().Err()
	}
}

// firstThen is a worker that answers its first attempt as first does and
// every later one as then does.
func firstThen(first, then worker) worker {
	var n atomic.Int32
	return func(w http.ResponseWriter, r *http.Request) error {
		if n.Add(1) == 1 {
			return first(w, r)
		}
		return then(w, r)
	}
}

// runPastStall runs j, moving the clock past the stall bound once wrote
// is closed, and expects its client to get imageAnswer.
func (f *testFleet) runPastStall(j *job, wrote chan struct{}) {
	f.t.Helper()
	go func() {
		<-wrote
		f.clock.Advance(f.run.StallTimeout)
	}()
	if err := f.runJob(j); err != nil {
		f.t.Fatal(err)
	}
	expectAnswer(f.t, j, http.StatusOK, imageAnswer)
}

const imageAnswer = `{"created":1,"data":[{"b64_json":"aW1hZ2U="}]}`

// noKinds reads nothing of the answers.
type noKinds struct{}

func (noKinds) Watch(*http.Request, *scheduler.Ticket) Watch        { return Watch{} }
func (noKinds) Learn(*http.Request, *scheduler.Ticket, []byte) bool { return true }
func (noKinds) Ended(*http.Request, *scheduler.Ticket, Ending) bool { return false }

// fakeClock is a clock that moves only when a test moves it.
type fakeClock struct {
	mu     sync.Mutex
	now    time.Time
	timers []*fakeTimer
}

type fakeTimer struct {
	c      *fakeClock
	at     time.Time
	f      func()
	active bool
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) AfterFunc(d time.Duration, f func()) clock.Timer {
	c.mu.Lock()
	t := &fakeTimer{c: c, f: f}
	c.timers = append(c.timers, t)
	c.mu.Unlock()
	t.Reset(d)
	return t
}

// Reset sets t to fire d from now; one due already fires at once, as a
// real timer does.
func (t *fakeTimer) Reset(d time.Duration) bool {
	t.c.mu.Lock()
	was := t.active
	t.at, t.active = t.c.now.Add(d), true
	t.c.mu.Unlock()
	if d <= 0 {
		t.c.Advance(0)
	}
	return was
}

func (t *fakeTimer) Stop() bool {
	t.c.mu.Lock()
	defer t.c.mu.Unlock()
	was := t.active
	t.active = false
	return was
}

// Advance moves the clock on by d and fires, each in its own goroutine,
// the timers that came due.
func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	var due []func()
	for _, t := range c.timers {
		if t.active && !t.at.After(c.now) {
			t.active = false
			due = append(due, t.f)
		}
	}
	c.mu.Unlock()
	for _, f := range due {
		go f()
	}
}
