package jobkinds

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"testing"

	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/attempt"
	"github.com/miles-rollout/miles-diffusion-router/internal/request"
	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// The tests read answers into a real pool of two workers, one making
// images and one making videos, as an attempt on them would have them.

const (
	imageWorker = "http://10.0.0.1:30000"
	videoWorker = "http://10.0.0.2:30000"
)

// kindsPool is a pool of the two workers and its Kinds.
type kindsPool struct {
	t    *testing.T
	pool *scheduler.Pool
	cfg  scheduler.Config
	k    Kinds
}

func newKindsPool(t *testing.T) *kindsPool {
	p := &kindsPool{t: t, pool: scheduler.New("test", zap.NewNop()), cfg: scheduler.Config{Strategy: scheduler.LeastWork{}, MaxAttempts: 1, MaxQueue: 10}}
	t.Cleanup(func() { _ = p.pool.Close() })
	p.pool.Declare([]string{imageWorker, videoWorker})
	p.pool.SetCapabilities(imageWorker, []string{"T2I"}, "fake/image")
	p.pool.SetCapabilities(videoWorker, []string{"T2V"}, "fake/video")
	p.k = New(p.pool)
	return p
}

// attempt is a request of tenant's, method on target, with its ticket on
// the worker the pool gives it: a new job's on any worker that makes its
// task, a poll's on the worker that made the job.
func (p *kindsPool) attempt(method, target, tenant string) (*http.Request, *scheduler.Ticket) {
	p.t.Helper()
	r := httptest.NewRequest(method, target, nil)
	u, _ := url.Parse(target)
	t := p.pool.NewTicket(&p.cfg)
	t.Route, t.Tenant = request.Endpoints.Match(method, u), tenant
	switch t.Route.Serves {
	case request.VideoTask:
		t.Task = request.VideoTask
	case request.ImageTask:
		t.Task = request.ImageTask
	}
	if t.Route.Poll {
		owners := p.pool.Videos()
		if t.Route.Kind == request.ImagePoll {
			owners = p.pool.Images()
		}
		worker, ok := owners.Worker(t.Route.JobID, tenant)
		if !ok {
			p.t.Fatalf("%s %s: no worker made the job", method, target)
		}
		t.Pin = worker
	} else {
		t.Job, t.Cost = true, 1000 // predicted to run long: a held video is not given back meanwhile
	}
	if err := p.pool.Acquire(context.Background(), t); err != nil {
		p.t.Fatal(err)
	}
	return r, t
}

// inflight is how many jobs the pool counts on url.
func (p *kindsPool) inflight(url string) int {
	info, _ := p.pool.Worker(url)
	return info.Inflight
}

func TestWatchReadsVideoJobsWholeAndImageAnswersStart(t *testing.T) {
	p := newKindsPool(t)
	for _, c := range []struct {
		method, target string
		want           attempt.Watch
	}{
		{"POST", "/v1/videos", attempt.Watch{Peek: maxVideoResponsePeek, Holds: true}},
		{"POST", "/v1/images/generations", attempt.Watch{Peek: maxImageAnswerPeek, Learns: true}},
		{"POST", "/v1/diffusion/generate", attempt.Watch{}},
	} {
		r, tk := p.attempt(c.method, c.target, "")
		if got := p.k.Watch(r, tk); got != c.want {
			t.Errorf("%s %s: watch %+v; want %+v", c.method, c.target, got, c.want)
		}
		p.pool.Release(tk, scheduler.End{Worker: scheduler.Succeeded})
	}
}

// A new video job is its maker's, for its tenant only, and keeps its
// worker's slot until a poll says it completed.
func TestAVideoJobKeepsItsWorkerUntilAPollSaysItEnded(t *testing.T) {
	p := newKindsPool(t)
	r, made := p.attempt("POST", "/v1/videos", "team-a")
	if !p.k.Ended(r, made, attempt.Ending{Status: 200, Sent: 200, Peek: []byte(`{"id":"video-1","status":"queued"}`)}) {
		t.Fatal("a new video job was not held")
	}
	if w, ok := p.pool.Videos().Worker("video-1", "team-a"); !ok || w != videoWorker {
		t.Fatalf("video-1 is %q's (%v); want the video worker's", w, ok)
	}
	if _, ok := p.pool.Videos().Worker("video-1", "team-b"); ok {
		t.Fatal("another tenant finds team-a's video job")
	}

	r, poll := p.attempt("GET", "/v1/videos/video-1", "team-a")
	p.k.Ended(r, poll, attempt.Ending{Status: 200, Sent: 200, Peek: []byte(`{"id":"video-1","status":"in_progress"}`)})
	p.pool.Release(poll, scheduler.End{Worker: scheduler.Succeeded})
	if n := p.inflight(videoWorker); n != 1 {
		t.Fatalf("the video worker counts %d jobs while its video runs; want 1", n)
	}
	r, poll = p.attempt("GET", "/v1/videos/video-1", "team-a")
	p.k.Ended(r, poll, attempt.Ending{Status: 200, Sent: 200, Peek: []byte(`{"id":"video-1","status":"completed"}`)})
	p.pool.Release(poll, scheduler.End{Worker: scheduler.Succeeded})
	if n := p.inflight(videoWorker); n != 0 {
		t.Fatalf("the video worker counts %d jobs once its video completed; want 0", n)
	}
}

// A worker that answers a status poll 404 no longer has the job (it
// restarted): the job failed, its slot goes free and the job is
// forgotten. A 404 for its content only means it is not done.
func TestAVideoJobItsWorkerDeniesIsForgotten(t *testing.T) {
	p := newKindsPool(t)
	r, made := p.attempt("POST", "/v1/videos", "")
	p.k.Ended(r, made, attempt.Ending{Status: 200, Sent: 200, Peek: []byte(`{"id":"video-2","status":"queued"}`)})

	r, content := p.attempt("GET", "/v1/videos/video-2/content", "")
	p.k.Ended(r, content, attempt.Ending{Status: 404, Sent: 404})
	p.pool.Release(content, scheduler.End{Worker: scheduler.Succeeded})
	if _, ok := p.pool.Videos().Worker("video-2", ""); !ok {
		t.Fatal("a content poll's 404 forgot the job")
	}

	r, poll := p.attempt("GET", "/v1/videos/video-2", "")
	p.k.Ended(r, poll, attempt.Ending{Status: 404, Sent: 404, Peek: []byte(`{"detail":"Video not found"}`)})
	p.pool.Release(poll, scheduler.End{Worker: scheduler.Succeeded})
	if _, ok := p.pool.Videos().Worker("video-2", ""); ok {
		t.Fatal("a job its worker denies is still remembered")
	}
	if n := p.inflight(videoWorker); n != 0 {
		t.Fatalf("the video worker counts %d jobs after denying its video; want 0", n)
	}
}

// An image answer's id is read from its first bytes, whole or streamed;
// an answer cut before the id asks for more, and a deletion the worker
// confirms forgets the job.
func TestAnImageJobIsLearnedFromItsAnswersStart(t *testing.T) {
	p := newKindsPool(t)
	r, made := p.attempt("POST", "/v1/images/generations", "team-a")
	if p.k.Learn(r, made, []byte(`{"id":"img`)) {
		t.Fatal("an answer cut inside its id was read as having one")
	}
	if !p.k.Learn(r, made, []byte(`{"id":"img-1","created":1,"data":[{"b64_json":"AAAA`)) {
		t.Fatal("the answer's id was not read")
	}
	p.pool.Release(made, scheduler.End{Worker: scheduler.Succeeded})
	if w, ok := p.pool.Images().Worker("img-1", "team-a"); !ok || w != imageWorker {
		t.Fatalf("img-1 is %q's (%v); want the image worker's", w, ok)
	}

	r, streamed := p.attempt("POST", "/v1/images/generations/stream", "team-a")
	if !p.k.Learn(r, streamed, []byte("event: accepted\ndata: {\"type\":\"accepted\",\"id\":\"img-2\"}\n\n")) {
		t.Fatal("the stream's first event was not read")
	}
	p.pool.Release(streamed, scheduler.End{Worker: scheduler.Succeeded})
	if _, ok := p.pool.Images().Worker("img-2", "team-a"); !ok {
		t.Fatal("the streamed image job is not remembered")
	}

	r, del := p.attempt("DELETE", "/v1/images/img-1", "team-a")
	if !p.k.Learn(r, del, []byte(`{"id":"img-1","status":"deleted"}`)) {
		t.Fatal("the deletion's answer was not read")
	}
	p.pool.Release(del, scheduler.End{Worker: scheduler.Succeeded})
	if _, ok := p.pool.Images().Worker("img-1", "team-a"); ok {
		t.Fatal("a deleted image job is still remembered")
	}
}
