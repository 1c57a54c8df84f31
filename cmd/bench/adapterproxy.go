package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"sync"

	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// switchingProxy stands for a router without placement that must still
// run every job on its own adapter: before each job it calls set_lora on
// the worker for the job's adapter, then sends the job, one job at a time
// per worker. A worker whose adapter is already the job's skips the
// switch, as sglang does, so what it measures is the switching such a
// router cannot avoid. Jobs wait for a free worker in one queue, or, for a
// static split, each adapter in the queue of its own worker.
type switchingProxy struct {
	fleet    testrouter.Fleet
	adapters []string
	queues   []chan int // free workers: one shared queue, or one per worker
	client   *http.Client
	srv      *http.Server
	url      string

	mu     sync.Mutex
	active []string // each worker's adapter, as its last set_lora left it
}

// startSwitchingProxy serves the proxy on a free port of 127.0.0.1; pinned
// gives each adapter a worker of its own (adapter i, worker i mod n).
func startSwitchingProxy(f testrouter.Fleet, adapters []string, pinned bool) (*switchingProxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &switchingProxy{
		fleet:    f,
		adapters: adapters,
		client:   &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4, DisableCompression: true}},
		url:      "http://" + ln.Addr().String(),
		active:   make([]string, len(f)),
	}
	p.queues = []chan int{make(chan int, len(f))}
	if pinned {
		p.queues = make([]chan int, len(f))
	}
	for w := range f {
		q := w % len(p.queues)
		if p.queues[q] == nil {
			p.queues[q] = make(chan int, 1)
		}
		p.queues[q] <- w
	}
	p.srv = &http.Server{Handler: p}
	go p.srv.Serve(ln) // returns once closed
	return p, nil
}

func (p *switchingProxy) urls() []string { return []string{p.url} }

func (p *switchingProxy) close() {
	p.srv.Close()
	p.client.CloseIdleConnections()
}

// holdings are the adapters the proxy's own set_lora calls left; a switch
// is over when its call returns, so every worker is ready.
func (p *switchingProxy) holdings(context.Context) ([]holding, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]holding, len(p.fleet))
	for i, m := range p.fleet {
		out[i] = holding{worker: m.Name, adapter: p.active[i], state: "ready"}
	}
	return out, nil
}

// ServeHTTP runs one generation job on a worker of its adapter's queue,
// once that worker is free, after switching it to the job's adapter.
func (p *switchingProxy) ServeHTTP(rw http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	var req struct {
		Model string `json:"model"`
	}
	if err == nil {
		err = json.Unmarshal(body, &req)
	}
	a := slices.Index(p.adapters, req.Model)
	if err != nil || a < 0 {
		http.Error(rw, fmt.Sprintf("the model field names no adapter of %v", p.adapters), http.StatusBadRequest)
		return
	}
	q := p.queues[a%len(p.queues)]
	var w int
	select {
	case w = <-q:
	case <-r.Context().Done():
		return
	}
	defer func() { q <- w }()
	if err := p.setLora(r.Context(), w, req.Model); err != nil {
		http.Error(rw, err.Error(), http.StatusBadGateway)
		return
	}
	p.forward(rw, r, w, body)
}

// setLora makes adapter the worker's active one.
func (p *switchingProxy) setLora(ctx context.Context, w int, adapter string) error {
	body, err := json.Marshal(map[string]string{"lora_nickname": adapter, "lora_path": loraPath(adapter)})
	if err != nil {
		return err
	}
	resp, err := p.send(ctx, w, "/v1/set_lora", http.Header{"Content-Type": {"application/json"}}, body)
	if err != nil {
		return err
	}
	said, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("set_lora %s on %s: %d %.200s", adapter, p.fleet[w].Name, resp.StatusCode, said)
	}
	p.mu.Lock()
	p.active[w] = adapter
	p.mu.Unlock()
	return nil
}

// forward sends the job to worker w and copies its answer back.
func (p *switchingProxy) forward(rw http.ResponseWriter, r *http.Request, w int, body []byte) {
	resp, err := p.send(r.Context(), w, r.URL.Path, r.Header, body)
	if err != nil {
		http.Error(rw, err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	for k, vs := range resp.Header {
		rw.Header()[k] = vs
	}
	rw.WriteHeader(resp.StatusCode)
	io.Copy(rw, resp.Body)
}

func (p *switchingProxy) send(ctx context.Context, w int, path string, header http.Header, body []byte) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.fleet[w].URL()+path, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header = header.Clone()
	return p.client.Do(req)
}
