// Package etcdtest starts a real etcd server (Debian's etcd-server, the
// version the router's high-availability mode is tested against) for one
// test or bench run, on 127.0.0.1 ports it picks, with its data in a
// directory of its own.
package etcdtest

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
)

// ErrNoEtcd is why Launch cannot run etcd: none is on the PATH.
var ErrNoEtcd = errors.New("etcd is not on the PATH (Debian: apt-get install etcd-server)")

// Server is one running etcd.
type Server struct {
	// Endpoint is the client URL, as a router's `ha etcd` option names it.
	Endpoint string
	process  *testkit.Process
}

// Start runs etcd until the test ends. Without an etcd on the PATH the
// test is skipped, except under CI=true, where CI must have installed it
// and the test fails instead.
func Start(t testing.TB) *Server {
	t.Helper()
	Require(t)
	s, err := Launch(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	return s
}

// Require skips the test when no etcd is on the PATH, or fails it under
// CI=true, where CI must have installed it.
func Require(t testing.TB) {
	t.Helper()
	if _, err := exec.LookPath("etcd"); err == nil {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("etcd is not on the PATH; .ci/run installs Debian's etcd-server")
	}
	t.Skip(ErrNoEtcd)
}

// Launch runs etcd with its data in dir until Stop is called.
func Launch(dir string) (*Server, error) {
	bin, err := exec.LookPath("etcd")
	if err != nil {
		return nil, ErrNoEtcd
	}
	client, err := freeURL()
	if err != nil {
		return nil, err
	}
	peer, err := freeURL()
	if err != nil {
		return nil, err
	}
	s := &Server{Endpoint: client, process: testkit.NewProcess(bin,
		"--name", "test",
		"--data-dir", dir,
		"--listen-client-urls", client,
		"--advertise-client-urls", client,
		"--listen-peer-urls", peer,
		"--initial-advertise-peer-urls", peer,
		"--initial-cluster", "test="+peer,
		"--logger", "zap", "--log-level", "error",
	)}
	return s, s.run()
}

// run starts the process and waits until etcd is healthy.
func (s *Server) run() error {
	var out io.Writer
	if testing.Testing() && testing.Verbose() {
		out = os.Stderr
	}
	if err := s.process.Start(out); err != nil {
		return fmt.Errorf("starting etcd: %w", err)
	}
	if !testkit.WaitUntil(30*time.Second, s.healthy) {
		s.Stop()
		return fmt.Errorf("etcd at %s was not healthy within 30s", s.Endpoint)
	}
	return nil
}

// Restart starts etcd again after Stop, on the same ports and data, as
// when the cluster comes back.
func (s *Server) Restart() error {
	return s.run()
}

// Stop kills etcd and waits for it to exit, as when the cluster becomes
// unreachable; calling it twice is harmless.
func (s *Server) Stop() {
	s.process.Stop()
}

// Compact writes a key, so that etcd's revision passes every one a
// client has seen, and then drops the history up to that revision, as
// etcd's periodic compaction does: a watch from any earlier revision is
// refused from then on (the Kubernetes API answers it 410 Gone).
func (s *Server) Compact() error {
	var put struct {
		Header struct {
			Revision string `json:"revision"`
		} `json:"header"`
	}
	key := base64.StdEncoding.EncodeToString([]byte("/etcdtest/compacted"))
	if err := s.call("/v3/kv/put", map[string]any{"key": key, "value": key}, &put); err != nil {
		return err
	}
	return s.call("/v3/kv/compaction", map[string]any{"revision": put.Header.Revision, "physical": true}, nil)
}

// call posts req to etcd's JSON gateway at path and decodes the answer
// into resp, if not nil.
func (s *Server) call(path string, req, resp any) error {
	body, err := json.Marshal(req)
	if err != nil {
		return err
	}
	r, err := http.Post(s.Endpoint+path, "application/json", bytes.NewReader(body))
	if err != nil {
		return err
	}
	defer r.Body.Close()
	if r.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(r.Body)
		return fmt.Errorf("etcd %s: %s %s", path, r.Status, msg)
	}
	if resp == nil {
		return nil
	}
	return json.NewDecoder(r.Body).Decode(resp)
}

func (s *Server) healthy() bool {
	resp, err := http.Get(s.Endpoint + "/health")
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// freeURL picks a port nobody listens on; etcd binds it a moment later.
func freeURL() (string, error) {
	port, err := testkit.FreePort()
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("http://127.0.0.1:%d", port), nil
}
