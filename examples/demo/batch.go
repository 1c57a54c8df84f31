package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
)

// job is one image generation request.
type job struct {
	width, height, steps int
}

func (j job) cost() float64 { return fakeworker.Cost(j.width, j.height, j.steps, 1, 1) }

func (j job) String() string { return fmt.Sprintf("%dx%d/%d steps", j.width, j.height, j.steps) }

// mix is the make-up of a batch: each kind of job and its share in percent.
var mix = []struct {
	job     job
	percent int
}{
	{job{512, 512, 20}, 50},
	{job{1024, 1024, 30}, 30},
	{job{1024, 1024, 50}, 15},
	{job{2048, 2048, 50}, 5},
}

// batch is the jobs of one rollout step, in the order they are sent.
type batch []job

// makeBatch returns n jobs in the proportions of mix, shuffled with seed.
func makeBatch(n int, seed uint64) batch {
	var b batch
	for _, m := range mix {
		for range n * m.percent / 100 {
			b = append(b, m.job)
		}
	}
	for len(b) < n { // rounding: top up with the most common kind
		b = append(b, mix[0].job)
	}
	rng := rand.New(rand.NewPCG(seed, 0))
	rng.Shuffle(len(b), func(i, j int) { b[i], b[j] = b[j], b[i] })
	return b
}

func (b batch) describe() string {
	counts := map[job]int{}
	for _, j := range b {
		counts[j]++
	}
	parts := make([]string, len(mix))
	for i, m := range mix {
		parts[i] = fmt.Sprintf("%d× %s", counts[m.job], m.job)
	}
	return fmt.Sprintf("%d requests: %s", len(b), strings.Join(parts, ", "))
}

func (b batch) totalCost() (total, longest float64) {
	for _, j := range b {
		total += j.cost()
		longest = max(longest, j.cost())
	}
	return total, longest
}

// result is what came back for a batch.
type result struct {
	wall     time.Duration
	servedBy map[string]int // requests per X-Fake-Worker name
}

// sendBatch sends every job at once and waits for all the answers; any
// answer other than 200 with an image fails the batch.
func sendBatch(ctx context.Context, routerURL string, b batch) (result, error) {
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: len(b)}}
	defer client.CloseIdleConnections()

	var (
		mu   sync.Mutex
		res  = result{servedBy: map[string]int{}}
		errs []error
		wg   sync.WaitGroup
		fire = make(chan struct{})
	)
	for i, j := range b {
		wg.Go(func() {
			<-fire
			worker, err := generate(ctx, client, routerURL, i, j)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, fmt.Errorf("request %d (%s): %w", i, j, err))
				return
			}
			res.servedBy[worker]++
		})
	}
	start := time.Now()
	close(fire) // all in flight together, like a rollout step
	wg.Wait()
	res.wall = time.Since(start)
	if len(errs) > 0 {
		return res, fmt.Errorf("%d of %d requests failed, first: %w", len(errs), len(b), errs[0])
	}
	return res, nil
}

// generate sends one POST /v1/images/generations and returns the name of
// the worker that answered.
func generate(ctx context.Context, client *http.Client, routerURL string, i int, j job) (string, error) {
	body, err := json.Marshal(map[string]any{
		"prompt":              fmt.Sprintf("demo prompt %d", i),
		"size":                fmt.Sprintf("%dx%d", j.width, j.height),
		"num_inference_steps": j.steps,
		"n":                   1,
		"response_format":     "b64_json",
	})
	if err != nil {
		return "", err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, routerURL+"/v1/images/generations", bytes.NewReader(body))
	if err != nil {
		return "", err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("%s: %s", resp.Status, bytes.TrimSpace(raw))
	}
	var out struct {
		Data []struct {
			B64JSON string `json:"b64_json"`
		} `json:"data"`
	}
	if err := json.Unmarshal(raw, &out); err != nil || len(out.Data) != 1 || out.Data[0].B64JSON == "" {
		return "", fmt.Errorf("answer is not one b64_json image: %.200s", raw)
	}
	return resp.Header.Get("X-Fake-Worker"), nil
}
