package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/url"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// The soak's load: closed-loop clients, each sending its next request as
// soon as the last one ended. A request is an image of the mix, a rollout
// (/rollout/generate, as miles sends) or a video job with its polls.
const (
	rolloutPercent = 10
	videoPercent   = 1
	// requestLimit bounds one request (a video job: all its calls); one
	// still open then is lost.
	requestLimit = time.Minute
	// videoPoll is how often a video job's status is polled.
	videoPoll = 5 * time.Millisecond
)

// soakKind is a kind of request of the soak's load.
type soakKind int

const (
	kindImage soakKind = iota
	kindRollout
	kindVideo
	kinds
)

func (k soakKind) String() string {
	return [...]string{"image", "rollout", "video"}[k]
}

// fate is how a request ended, from the client's side.
type fate int

const (
	answered fate = iota // 2xx, its answer read whole and checked
	refused              // a 4xx: the router or worker said clearly what was wrong
	// reset is a 2xx answer over the router's max_held_answer whose body
	// broke off: the router streams such an answer and, when its worker
	// breaks it, resets the client's connection rather than end it as if
	// whole. Its client knows it has no answer.
	reset
	// broken is a 2xx answer read to its end that is not whole: a broken
	// answer delivered as a success, which a trainer would take for a
	// sample.
	broken
	lost // anything else: a 5xx, a broken connection, a timeout, a held answer cut off
	fates
)

func (f fate) String() string {
	return [...]string{"answered", "refused", "reset", "broken", "lost"}[f]
}

// fateOf is how a request that ended with err fared: nil for a 2xx read
// whole and checked.
func fateOf(err error) fate {
	var se *statusError
	var be *brokenError
	var ce *cutError
	switch {
	case err == nil:
		return answered
	case errors.As(err, &se) && se.status >= 400 && se.status < 500:
		return refused
	case errors.As(err, &be):
		return broken
	case errors.As(err, &ce) && ce.length > soakHeldAnswer:
		return reset
	}
	return lost
}

// tally counts the soak's requests by kind and fate, and why each one that
// was not answered ended as it did.
type tally struct {
	began   time.Time
	mu      sync.Mutex
	counts  [kinds][fates]int
	reasons map[string]int // "image lost: 502 Bad Gateway: ..." → requests
	resent  int            // requests the client sent again (see client.onResend)
}

func newTally() *tally { return &tally{began: time.Now(), reasons: make(map[string]int)} }

// add counts request i, of kind k, which ended with err: nil for a 2xx
// read whole, a *statusError for another answer.
func (t *tally) add(k soakKind, i int, err error) {
	f := fateOf(err)
	t.mu.Lock()
	defer t.mu.Unlock()
	t.counts[k][f]++
	if err == nil {
		return
	}
	reason := fmt.Sprintf("%s %s: %v", k, f, err)
	t.reasons[reason]++
	// As it happens, to be matched with the faults and the router's log.
	fmt.Fprintf(os.Stderr, "soak: %6.1fs  request bench-%d: %s\n", time.Since(t.began).Seconds(), i, reason)
}

// resend counts request i sent again by the client's transport: the router
// closed the connection it was written on before reading it, which a
// reload does to idle keep-alive connections.
func (t *tally) resend(i int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.resent++
	fmt.Fprintf(os.Stderr, "soak: %6.1fs  request bench-%d: sent again: the router closed the reused connection before answering\n", time.Since(t.began).Seconds(), i)
}

// total is the count of requests of every kind with any of the fates fs.
func (t *tally) total(fs ...fate) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for k := range kinds {
		for _, f := range fs {
			n += t.counts[k][f]
		}
	}
	return n
}

// unanswered is the count of requests that got no whole answer.
func (t *tally) unanswered() int { return t.total(refused, reset, broken, lost) }

// requests is the count of requests that ended, however they did.
func (t *tally) requests() int { return t.total(answered) + t.unanswered() }

// soakClients runs the load: clients loop until n requests have been sent
// or issuing ends, counting each request's fate in t; a request under way
// when issuing ends runs to its end, in ctx. images and videos send to the
// image pool's site and the video pool's.
func soakClients(ctx context.Context, issuing <-chan struct{}, clients, n int, mix []share, seed uint64, images, videos *client, t *tally) {
	var issued atomic.Int64
	var wg sync.WaitGroup
	for k := range clients {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(seed, uint64(k)))
			for ctx.Err() == nil && !closed(issuing) {
				i := issued.Add(1)
				if i > int64(n) {
					return
				}
				kind, err := soakRequest(ctx, rng, int(i), mix, images, videos)
				if ctx.Err() != nil && err != nil {
					return // cut short by a failed run, not by the router
				}
				t.add(kind, int(i), err)
			}
		})
	}
	wg.Wait()
}

// closed reports whether c is closed.
func closed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// soakRequest sends the i-th request, of a kind drawn with rng.
func soakRequest(ctx context.Context, rng *rand.Rand, i int, mix []share, images, videos *client) (soakKind, error) {
	ctx, cancel := context.WithTimeout(ctx, requestLimit)
	defer cancel()
	switch p := rng.IntN(100); {
	case p < videoPercent:
		return kindVideo, videoJob(ctx, videos, i)
	case p < videoPercent+rolloutPercent:
		body, header, err := images.call(ctx, "", http.MethodPost, "/rollout/generate", i, rolloutRequest(i))
		if err != nil {
			return kindRollout, err
		}
		return kindRollout, whole("", checkRollout(body, header.Get("Content-Type")))
	default:
		body, _, err := images.call(ctx, "", http.MethodPost, "/v1/images/generations", i, drawJob(mix, rng).request(i))
		if err != nil {
			return kindImage, err
		}
		return kindImage, whole("", checkImages(body))
	}
}

// rolloutRequest is the body of the i-th request, a rollout, as miles
// sends one.
func rolloutRequest(i int) map[string]any {
	return map[string]any{
		"prompt": fmt.Sprintf("soak rollout %d", i), "seed": i,
		"size": "512x512", "num_inference_steps": 8,
	}
}

// drawJob draws a job of the mix, each kind with its share's probability.
func drawJob(mix []share, rng *rand.Rand) job {
	p := rng.IntN(100)
	for _, s := range mix {
		if p < s.percent {
			return s.job
		}
		p -= s.percent
	}
	return mix[len(mix)-1].job
}

// videoJob creates a small video, polls it until it has ended, fetches it
// and deletes it, as a client of the video API does.
func videoJob(ctx context.Context, c *client, i int) error {
	body, _, err := c.call(ctx, "create ", http.MethodPost, "/v1/videos", i, map[string]any{
		"prompt": fmt.Sprintf("soak video %d", i), "size": "256x256",
		"num_frames": 8, "num_inference_steps": 4,
	})
	if err != nil {
		return err
	}
	var job struct{ ID, Status string }
	if err := json.Unmarshal(body, &job); err != nil || job.ID == "" {
		return whole("create ", fmt.Errorf("no job id in %.200s", body))
	}
	path := "/v1/videos/" + url.PathEscape(job.ID)
	for job.Status != "completed" {
		if job.Status == "failed" {
			return fmt.Errorf("poll: the job failed: %.200s", body)
		}
		if err := sleepCtx(ctx, videoPoll); err != nil {
			return fmt.Errorf("poll: %w", err)
		}
		if body, _, err = c.call(ctx, "poll ", http.MethodGet, path, i, nil); err != nil {
			return err
		}
		if err := json.Unmarshal(body, &job); err != nil {
			return whole("poll ", err)
		}
	}
	content, _, err := c.call(ctx, "content ", http.MethodGet, path+"/content", i, nil)
	if err != nil {
		return err
	}
	if len(content) == 0 {
		return whole("content ", errors.New("no video"))
	}
	if body, _, err = c.call(ctx, "delete ", http.MethodDelete, path, i, nil); err != nil {
		return err
	}
	var deleted map[string]any
	return whole("delete ", json.Unmarshal(body, &deleted))
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
