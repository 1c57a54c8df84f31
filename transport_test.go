package diffusionrouter

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/caddyserver/caddy/v2"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// unreadBody stands for reverse_proxy's wrappers of the client's body.
type unreadBody struct{ read bool }

func (b *unreadBody) Read([]byte) (int, error) { b.read = true; return 0, io.EOF }
func (b *unreadBody) Close() error             { return nil }

// A job's request goes out with the body the router holds, not through
// the wrappers of the request it was given, which it leaves as it was.
func TestDiffusionTransportSendsTheHeldBody(t *testing.T) {
	got := make(chan []byte, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got <- b
	}))
	defer srv.Close()
	ctx, err := caddy.ProvisionContext(&caddy.Config{})
	if err != nil {
		t.Fatal(err)
	}
	tr := new(DiffusionTransport)
	if err := tr.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	job := &scheduler.Ticket{Request: scheduler.Request{Body: []byte(`{"prompt":"x","size":"1x1"}`)}}
	wrapped := new(unreadBody)
	req, _ := http.NewRequestWithContext(scheduler.WithTicket(context.Background(), job), http.MethodPost, srv.URL, wrapped)
	req.ContentLength = int64(len(job.Body))
	res, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if b := <-got; !bytes.Equal(b, job.Body) {
		t.Errorf("the worker got %q; want %q", b, job.Body)
	}
	if wrapped.read || req.Body != wrapped {
		t.Error("the request given was read or changed")
	}
}
