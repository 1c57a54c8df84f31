// Package kubeapiserver runs the real Kubernetes API server for tests:
// the kube-apiserver that .ci/kube-apiserver/build.sh builds, on a real
// etcd, on 127.0.0.1, with bearer tokens, RBAC, and an audit log of the
// EndpointSlice requests. Nothing else of a cluster runs: the tests
// create and change the objects a controller would.
package kubeapiserver

import (
	"bytes"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
)

// Version is the kube-apiserver the tests run, the one build.sh builds.
const Version = "v1.37.2"

// home is the user's home as the test binary started, before a TestMain
// gave the tests an empty one: the build script caches the binary there.
var home = os.Getenv("HOME")

// Binary is the kube-apiserver to run: $KUBE_APISERVER, or where
// .ci/kube-apiserver/build.sh caches it
// (${KUBE_APISERVER_CACHE:-$HOME/.cache/kube-apiserver}/v1.37.2). Where
// there is none the test is skipped, except under CI=true, where it fails.
func Binary(t testing.TB) string {
	t.Helper()
	bin := os.Getenv("KUBE_APISERVER")
	if bin == "" {
		cache := os.Getenv("KUBE_APISERVER_CACHE")
		if cache == "" {
			cache = filepath.Join(home, ".cache", "kube-apiserver")
		}
		bin = filepath.Join(cache, Version, "kube-apiserver")
	}
	if _, err := os.Stat(bin); err == nil {
		return bin
	}
	why := fmt.Sprintf("no kube-apiserver at %s: build it with .ci/kube-apiserver/build.sh (about 8 minutes), or name it in KUBE_APISERVER", bin)
	if os.Getenv("CI") == "true" {
		t.Fatal(why)
	}
	t.Skip(why)
	return ""
}

// Server is one running kube-apiserver.
type Server struct {
	// URL is where it serves, https://127.0.0.1:port.
	URL string
	// AdminToken is the bearer token of a user in system:masters.
	AdminToken string
	dir        string
	process    *testkit.Process
	client     *http.Client
}

// auditPolicy logs every request on EndpointSlices, by whom and how it
// was answered, and nothing else.
const auditPolicy = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    resources: [{group: discovery.k8s.io, resources: [endpointslices]}]
  - level: None
`

// Start runs bin on etcd at etcdURL until the test ends, and returns once
// it is ready. It listens on 127.0.0.1 and advertises advertise, an
// address of the host it runs on (it stops where it finds none).
func Start(t testing.TB, bin, etcdURL, advertise string) *Server {
	t.Helper()
	dir := t.TempDir()
	s := &Server{AdminToken: rand.Text(), dir: dir}
	key := filepath.Join(dir, "sa.key")
	writeFile(t, key, serviceAccountKey(t))
	writeFile(t, filepath.Join(dir, "tokens.csv"), []byte(s.AdminToken+",admin,admin,system:masters\n"))
	writeFile(t, filepath.Join(dir, "audit-policy.yaml"), []byte(auditPolicy))
	port, err := testkit.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	s.URL = "https://127.0.0.1:" + strconv.Itoa(port)
	s.process = testkit.NewProcess(bin,
		"--etcd-servers="+etcdURL,
		"--bind-address=127.0.0.1", "--secure-port="+strconv.Itoa(port),
		"--advertise-address="+advertise,
		"--cert-dir="+filepath.Join(dir, "certs"),
		"--service-account-issuer=https://kubernetes.default.svc",
		"--service-account-key-file="+key, "--service-account-signing-key-file="+key,
		"--token-auth-file="+filepath.Join(dir, "tokens.csv"),
		"--authorization-mode=RBAC",
		"--service-cluster-ip-range=10.96.0.0/16",
		"--audit-policy-file="+filepath.Join(dir, "audit-policy.yaml"),
		"--audit-log-path="+filepath.Join(dir, "audit.log"),
	)
	t.Cleanup(func() {
		s.Stop()
		if t.Failed() {
			log, _ := os.ReadFile(filepath.Join(dir, "kube-apiserver.log"))
			t.Logf("kube-apiserver's log ends:\n%s", tail(log, 40))
		}
	})
	s.Restart(t)
	return s
}

// Restart starts the API server again after Stop, on the same port,
// certificate and etcd, and returns once it is ready.
func (s *Server) Restart(t testing.TB) {
	t.Helper()
	log, err := os.OpenFile(filepath.Join(s.dir, "kube-apiserver.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	if err := s.process.Start(log); err != nil {
		t.Fatalf("starting kube-apiserver: %v", err)
	}
	if !testkit.WaitUntil(60*time.Second, s.ready) {
		t.Fatalf("kube-apiserver at %s was not ready within 60 s", s.URL)
	}
}

// Stop kills the API server and waits for it to exit, as when it becomes
// unreachable; calling it twice is harmless.
func (s *Server) Stop() {
	s.process.Stop()
}

// ready says whether /readyz answers ok. The serving certificate exists
// from the first answer on.
func (s *Server) ready() bool {
	if s.process.Exited() {
		return false
	}
	if s.client == nil {
		s.client = s.newClient()
		if s.client == nil {
			return false
		}
	}
	req, err := http.NewRequest(http.MethodGet, s.URL+"/readyz", nil)
	if err != nil {
		return false
	}
	req.Header.Set("Authorization", "Bearer "+s.AdminToken)
	resp, err := s.client.Do(req)
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode == http.StatusOK && string(body) == "ok"
}

// CA is the path of the bundle that verifies the API server's
// self-signed serving certificate, for 127.0.0.1.
func (s *Server) CA() string {
	return filepath.Join(s.dir, "certs", "apiserver.crt")
}

// newClient is a client that trusts the serving certificate, nil before
// the API server wrote it.
func (s *Server) newClient() *http.Client {
	ca, err := os.ReadFile(s.CA())
	if err != nil {
		return nil
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return nil
	}
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
}

// Kubeconfig writes a kubeconfig that reaches s with token, and returns
// its path.
func (s *Server) Kubeconfig(t testing.TB, token string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kubeconfig")
	writeFile(t, path, []byte(`apiVersion: v1
kind: Config
clusters: [{name: test, cluster: {server: "`+s.URL+`", certificate-authority: "`+s.CA()+`"}}]
users: [{name: test, user: {token: "`+token+`"}}]
contexts: [{name: test, context: {cluster: test, user: test}}]
current-context: test
`))
	return path
}

// Do sends one request to the API at path with token, body (if not nil)
// as JSON, and returns the status and the body of the answer.
func (s *Server) Do(t testing.TB, token, method, path string, body any) (int, []byte) {
	t.Helper()
	var in io.Reader
	if body != nil {
		raw, err := json.Marshal(body)
		if err != nil {
			t.Fatal(err)
		}
		in = bytes.NewReader(raw)
	}
	req, err := http.NewRequestWithContext(t.Context(), method, s.URL+path, in)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Content-Type", "application/json")
	resp, err := s.client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	return resp.StatusCode, out
}

// Must is Do as the admin (AdminToken) that fails t unless the answer's
// status is want; it returns the answer's body.
func (s *Server) Must(t testing.TB, want int, method, path string, body any) []byte {
	t.Helper()
	status, out := s.Do(t, s.AdminToken, method, path, body)
	if status != want {
		t.Fatalf("%s %s: %d %s; want %d", method, path, status, out, want)
	}
	return out
}

// Request is one request on EndpointSlices, as the audit log has it.
type Request struct {
	Verb       string `json:"verb"`
	RequestURI string `json:"requestURI"`
	User       struct {
		Username string `json:"username"`
	} `json:"user"`
}

// Requests returns the requests on EndpointSlices that user sent, in the
// order the API server received them, across restarts.
func (s *Server) Requests(t testing.TB, user string) []Request {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(s.dir, "audit.log"))
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	seen := map[string]bool{} // a watch is logged as it starts and as it ends
	var out []Request
	for line := range strings.Lines(string(raw)) {
		var ev struct {
			AuditID string `json:"auditID"`
			Request
		}
		if err := json.Unmarshal([]byte(line), &ev); err != nil {
			t.Fatalf("audit log: %v: %s", err, line)
		}
		if ev.User.Username == user && !seen[ev.AuditID] {
			seen[ev.AuditID] = true
			out = append(out, ev.Request)
		}
	}
	return out
}

// serviceAccountKey is a PEM RSA key to sign service account tokens.
func serviceAccountKey(t testing.TB) []byte {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)})
}

func writeFile(t testing.TB, path string, data []byte) {
	t.Helper()
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
}

// tail is the last n lines of log.
func tail(log []byte, n int) []byte {
	lines := bytes.SplitAfter(log, []byte("\n"))
	return bytes.Join(lines[max(0, len(lines)-n):], nil)
}
