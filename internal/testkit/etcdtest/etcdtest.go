// Package etcdtest starts a real etcd server (Debian's etcd-server, the
// version the router's high-availability mode is tested against) for one
// test, on 127.0.0.1 ports the test picks, with its data in a temporary
// directory.
package etcdtest

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
)

// Server is one running etcd.
type Server struct {
	// Endpoint is the client URL, as a router's `ha etcd` option names it.
	Endpoint string
	t        testing.TB
	args     []string // etcd and its flags, to start it again as it was
	cmd      *exec.Cmd
	exited   chan struct{}
}

// Start runs etcd until the test ends. Without an etcd on the PATH the
// test is skipped, except under CI=true, where CI must have installed it
// and the test fails instead.
func Start(t testing.TB) *Server {
	t.Helper()
	bin, err := exec.LookPath("etcd")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("etcd is not on the PATH; .ci/run installs Debian's etcd-server")
		}
		t.Skip("etcd is not on the PATH (Debian: apt-get install etcd-server)")
	}
	client, peer := freeURL(t), freeURL(t)
	s := &Server{Endpoint: client, t: t, args: []string{bin,
		"--name", "test",
		"--data-dir", t.TempDir(),
		"--listen-client-urls", client,
		"--advertise-client-urls", client,
		"--listen-peer-urls", peer,
		"--initial-advertise-peer-urls", peer,
		"--initial-cluster", "test=" + peer,
		"--logger", "zap", "--log-level", "error",
	}}
	t.Cleanup(s.Stop)
	s.run()
	return s
}

// run starts the process and waits until etcd is healthy.
func (s *Server) run() {
	s.t.Helper()
	cmd := exec.Command(s.args[0], s.args[1:]...)
	if testing.Verbose() {
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	}
	if err := cmd.Start(); err != nil {
		s.t.Fatalf("starting etcd: %v", err)
	}
	exited := make(chan struct{})
	s.cmd, s.exited = cmd, exited
	go func() { _ = cmd.Wait(); close(exited) }()
	if !testkit.WaitUntil(30*time.Second, s.healthy) {
		s.t.Fatalf("etcd at %s was not healthy within 30s", s.Endpoint)
	}
}

// Restart starts etcd again after Stop, on the same ports and data, as
// when the cluster comes back.
func (s *Server) Restart() {
	s.t.Helper()
	s.Stop()
	s.run()
}

// Stop kills etcd and waits for it to exit, as when the cluster becomes
// unreachable; calling it twice is harmless.
func (s *Server) Stop() {
	select {
	case <-s.exited:
		return
	default:
	}
	_ = s.cmd.Process.Kill()
	<-s.exited
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
func freeURL(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return fmt.Sprintf("http://%s", l.Addr())
}
