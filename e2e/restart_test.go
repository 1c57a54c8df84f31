package e2e

import (
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// buildEnv is the environment this test binary started with, before
// TestMain moved HOME: the go command finds its build cache through it.
var buildEnv = os.Environ()

// buildCaddy returns the repository's Caddy (cmd/caddy), built once for
// all the tests of this binary: linking it takes seconds each time, even
// with the build cache warm.
func buildCaddy(t *testing.T) string {
	t.Helper()
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("no go command to build Caddy with")
	}
	bin, err := builtCaddy()
	if err != nil {
		t.Fatal(err)
	}
	return bin
}

// builtCaddy builds Caddy into the home TestMain made for the tests,
// which it removes when they end.
var builtCaddy = sync.OnceValues(func() (string, error) {
	bin := filepath.Join(os.Getenv("HOME"), "caddy")
	cmd := exec.Command("go", "build", "-buildvcs=false", "-o", bin, "github.com/miles-rollout/miles-diffusion-router/cmd/caddy")
	cmd.Env = buildEnv
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build cmd/caddy: %w\n%s", err, out)
	}
	return bin, nil
})

// caddyProcess is the built Caddy running as a process of its own.
type caddyProcess struct {
	t   *testing.T
	cmd *exec.Cmd
	log string // its output
}

// startCaddy runs bin on the Caddyfile in dir and waits until r answers
// /healthz.
func startCaddy(t *testing.T, bin, dir string, r *testrouter.Router) *caddyProcess {
	t.Helper()
	logFile, err := os.CreateTemp(dir, "caddy-*.log")
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	home := filepath.Join(dir, "home")
	cmd := exec.Command(bin, "run", "--config", filepath.Join(dir, "Caddyfile"), "--adapter", "caddyfile")
	cmd.Env = append(os.Environ(), "HOME="+home, "XDG_CONFIG_HOME="+home, "XDG_DATA_HOME="+home)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &caddyProcess{t: t, cmd: cmd, log: logFile.Name()}
	t.Cleanup(p.kill)
	up := testkit.WaitUntil(60*time.Second, func() bool {
		resp, err := testrouter.Client.Get(r.Base + "/healthz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	if !up {
		p.fail("Caddy did not answer /healthz within 60 s")
	}
	return p
}

// kill ends the process with SIGKILL, as `kill -9` does: nothing of it
// runs after, no cleanup, no last write.
func (p *caddyProcess) kill() {
	if p.cmd.ProcessState != nil {
		return
	}
	_ = p.cmd.Process.Kill()
	_ = p.cmd.Wait()
	testrouter.Client.CloseIdleConnections() // they were to the process now gone
}

// terminate sends SIGTERM, as Kubernetes does to a pod it stops, and
// returns at once: Caddy drains its requests before it exits.
func (p *caddyProcess) terminate() {
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		p.t.Fatal(err)
	}
}

func (p *caddyProcess) fail(format string, args ...any) {
	p.t.Helper()
	out, _ := os.ReadFile(p.log)
	p.t.Fatalf("%s\nCaddy's output:\n%s", fmt.Sprintf(format, args...), out)
}

// fleetView is what a user sees of the fleet: the worker list, who is
// held back, and the pool's weight version.
type fleetView struct {
	urls          []string
	dead          map[string]bool
	weightVersion string
}

// workerView is what the test reads of a worker in the control API's
// answers.
type workerView struct {
	URL           string `json:"url"`
	IsDead        bool   `json:"is_dead"`
	State         string `json:"state"`
	WeightVersion string `json:"weight_version"`
	PausedSince   string `json:"paused_since"`
}

func viewFleet(t *testing.T, r *testrouter.Router) fleetView {
	t.Helper()
	var list struct{ URLs []string }
	if err := json.Unmarshal(r.Get("/list_workers").Body, &list); err != nil {
		t.Fatal(err)
	}
	var workers struct{ Workers []workerView }
	if err := json.Unmarshal(r.Get("/workers").Body, &workers); err != nil {
		t.Fatal(err)
	}
	v := fleetView{urls: list.URLs, dead: map[string]bool{}}
	for _, w := range workers.Workers {
		v.dead[w.URL] = w.IsDead
	}
	v.weightVersion, _ = r.Get("/health").JSON(t)["weight_version"].(string)
	return v
}

func workerOf(t *testing.T, r *testrouter.Router, u string) workerView {
	t.Helper()
	var one struct{ Worker workerView }
	if err := json.Unmarshal(r.Get("/workers/"+url.QueryEscape(u)).Body, &one); err != nil {
		t.Fatal(err)
	}
	return one.Worker
}

// After `kill -9` and a start on the same storage, the router has the
// workers registered at run time, the ones held back, the ones a trainer
// paused (since when they were) and its weight version as they were; a
// worker read back that is now down gets no job, nor does a paused one
// that is back until a continue, and a worker that joins later is
// brought to the weights read back.
func TestFleetSurvivesKill9(t *testing.T) {
	if testing.Short() {
		t.Skip("builds Caddy and runs it as a process")
	}
	bin := buildCaddy(t)
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a"}, fakeworker.Config{Name: "b"}, fakeworker.Config{Name: "c"}, fakeworker.Config{Name: "d"})
	a, b, c, d := ws[0], ws[1], ws[2], ws[3]
	dir := t.TempDir()
	storage := filepath.Join(dir, "storage")
	r := testrouter.Attach(t, testrouter.Port(t))
	caddyfile := fmt.Sprintf(`{
	admin off
	persist_config off
	auto_https off
	default_bind 127.0.0.1
	storage file_system %s
}
:%d {
	diffusion_router {
		workers %s
		health_interval 200ms
	}
}
`, storage, r.Port, a.URL())
	if err := os.WriteFile(filepath.Join(dir, "Caddyfile"), []byte(caddyfile), 0o600); err != nil {
		t.Fatal(err)
	}

	first := startCaddy(t, bin, dir, r)
	testrouter.ExpectStatus(t, "add_worker", r.Post("/add_worker?url="+b.URL(), ""), 200)
	testrouter.ExpectStatus(t, "POST /workers", r.Post("/workers", `{"url":"`+c.URL()+`"}`), 200)
	testrouter.ExpectStatus(t, "update", r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/step-7","weight_version":"step-7"}`), 200)
	testrouter.ExpectStatus(t, "set_lora", r.Post("/v1/set_lora", `{"lora_nickname":"x","lora_path":"/lora/x"}`), 200)
	testrouter.ExpectStatus(t, "hold back", testrouter.Do(t, "PUT", r.Base+"/workers/"+url.QueryEscape(c.URL()), strings.NewReader(`{"is_dead":true}`)), 200)
	testrouter.ExpectStatus(t, "pause b", r.Post("/pause_generation", `{"workers":["`+b.URL()+`"]}`), 200)
	pausedSince := workerOf(t, r, b.URL()).PausedSince
	before := viewFleet(t, r)
	if !slices.Equal(before.urls, []string{a.URL(), b.URL(), c.URL()}) || !before.dead[c.URL()] || before.weightVersion != "step-7+lora:x" {
		t.Fatalf("fleet before the kill: %+v", before)
	}
	// Writes follow each change within moments; the kill comes after the
	// last one reached the disk, as it would some time after an
	// operator's change.
	record := filepath.Join(storage, "diffusion_router", "default", "fleet.json")
	written := testkit.WaitUntil(10*time.Second, func() bool {
		data, _ := os.ReadFile(record)
		return strings.Contains(string(data), `"is_dead":true`) && strings.Contains(string(data), `"paused_since"`)
	})
	if !written {
		first.fail("the held-back and the paused worker were not written to %s within 10 s", record)
	}
	first.kill()

	b.SetHealthFail(true) // b's probes fail now, though it would still run a job
	second := startCaddy(t, bin, dir, r)
	if after := viewFleet(t, r); !slices.Equal(after.urls, before.urls) || !maps.Equal(after.dead, before.dead) || after.weightVersion != before.weightVersion {
		second.fail("fleet after kill -9 and a start: %+v; want %+v", after, before)
	}
	for i := range 10 {
		rp := r.Post("/v1/images/generations", testrouter.SmallImage)
		testrouter.ExpectStatus(t, fmt.Sprintf("job %d after the start", i), rp, 200)
		if by := rp.Header.Get("X-Fake-Worker"); by != "a" {
			second.fail("job %d served by %s; only a may serve (b failed its probe and is paused, c is held back)", i, by)
		}
		if v := rp.Header.Get("X-Weight-Version"); v != "step-7+lora:x" {
			second.fail("job %d served on weights %q; want step-7+lora:x", i, v)
		}
	}
	if st := workerOf(t, r, b.URL()); st.State != "unhealthy" || b.Stats().Jobs != 0 {
		second.fail("b, read back and failing its probes, is %s and ran %d jobs; want unhealthy and none", st.State, b.Stats().Jobs)
	}
	b.SetHealthFail(false)
	if !testkit.WaitUntil(30*time.Second, func() bool { return workerOf(t, r, b.URL()).State == "paused" }) {
		second.fail("b is %+v 30 s after it passes its probes; want paused, as before the kill", workerOf(t, r, b.URL()))
	}
	if got := workerOf(t, r, b.URL()).PausedSince; got != pausedSince {
		second.fail("b read back paused since %s; want %s", got, pausedSince)
	}
	for i := range 3 {
		if by := r.Post("/v1/images/generations", testrouter.SmallImage).Header.Get("X-Fake-Worker"); by != "a" {
			second.fail("job %d once b passed its probes served by %s; want a (b is paused)", i, by)
		}
	}
	testrouter.ExpectStatus(t, "continue b", r.Post("/continue_generation", ""), 200)
	if st := workerOf(t, r, b.URL()).State; st != "serving" {
		second.fail("b after the continue is %s; want serving", st)
	}

	// A worker that joins after the restart is sent the update and the
	// LoRA call read back before its first job.
	testrouter.ExpectStatus(t, "add_worker d", r.Post("/add_worker?url="+d.URL(), ""), 200)
	if !testkit.WaitUntil(30*time.Second, func() bool { return workerOf(t, r, d.URL()).WeightVersion == "step-7+lora:x" }) {
		second.fail("d was not brought to step-7+lora:x: %+v", workerOf(t, r, d.URL()))
	}
	if w := d.Weights(); w != "/ckpt/step-7" {
		t.Fatalf("d runs %q; want /ckpt/step-7", w)
	}
}
