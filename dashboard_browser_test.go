//go:build unix

package diffusionrouter

// Browser tests of the status page at /dashboard: headless Chromium driven
// through ChromeDriver's W3C WebDriver HTTP/JSON API, with nothing but the
// standard library. They need the chromium and chromedriver binaries (the
// Debian packages chromium and chromium-driver); without them they skip,
// unless DIFFUSION_ROUTER_REQUIRE_BROWSER=1 (as in CI), when they fail.
// DASHBOARD_SCREENSHOT=path makes TestDashboardInBrowser put some load on
// the router and save a screenshot of the page there.

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"image/png"
	"io"
	"math"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/miles-rollout/miles-diffusion-router/examples/fakeworker"
)

func TestDashboardInBrowser(t *testing.T) {
	wd := startBrowser(t)
	ws := startWorkers(t,
		fakeworker.Config{Name: "a", UnitMs: 100},
		fakeworker.Config{Name: "b", UnitMs: 100, Speed: 1.5},
		fakeworker.Config{Name: "c", UnitMs: 100, Speed: 0.7})
	r := startRouter(t, "diffusion_router {\n workers "+urlsOf(ws)+"\n}")

	wd.navigate(r.base + "/dashboard")
	waitUntil(t, 20*time.Second, "a table row for each worker", func() bool {
		for _, w := range ws {
			if len(wd.findElements(`#workers tr[data-worker="`+w.URL()+`"]`)) != 1 {
				return false
			}
		}
		return true
	})
	if n := len(wd.findElements("#workers tr")); n != len(ws) {
		t.Fatalf("%d table rows for %d workers", n, len(ws))
	}

	before := completedJobs(wd)
	if before < 0 {
		t.Fatalf("completed jobs shows %q", wd.text("#completed-jobs"))
	}
	for i := range 5 {
		expectStatus(t, fmt.Sprintf("generation %d", i), r.post("/v1/images/generations", smallImage), 200)
	}
	waitUntil(t, 20*time.Second, "completed jobs to grow by 5", func() bool { return completedJobs(wd) >= before+5 })
	if got := completedJobs(wd); got != before+5 {
		t.Fatalf("completed jobs went from %d to %d after 5 requests", before, got)
	}

	// A worker that does not answer gets a row of its own.
	dead := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	expectStatus(t, "register", r.post("/workers", `{"url":"`+dead+`"}`), 200)
	waitUntil(t, 20*time.Second, "a row for the registered worker", func() bool {
		return len(wd.findElements(`#workers tr[data-worker="`+dead+`"]`)) == 1
	})

	shot := os.Getenv("DASHBOARD_SCREENSHOT")
	loaded := make(chan struct{})
	if shot != "" {
		// Load that rises and falls, so that both charts have a shape; the
		// shot is taken while it falls, with jobs still in flight.
		go func() { defer close(loaded); generateLoad(r, 16*time.Second) }()
		waitUntil(t, 60*time.Second, "the queue chart to rise and fall", func() bool {
			select {
			case <-loaded:
				t.Fatal("the load ended before the page showed the queue rise and fall")
			default:
			}
			var q struct{ Peak, Last int }
			wd.execute(`const q = samples.map((s) => s.queued); return {peak: Math.max(0, ...q), last: q[q.length - 1] || 0}`, &q)
			return q.Peak >= 4 && 2*q.Last <= q.Peak
		})
	} else {
		close(loaded)
	}
	img := wd.screenshot()
	<-loaded
	cfg, err := png.DecodeConfig(bytes.NewReader(img))
	if err != nil || cfg.Width < 100 || cfg.Height < 100 {
		t.Fatalf("screenshot: %d bytes, %dx%d, %v", len(img), cfg.Width, cfg.Height, err)
	}
	if shot != "" {
		if err := os.MkdirAll(filepath.Dir(shot), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(shot, img, 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("screenshot (%dx%d) written to %s", cfg.Width, cfg.Height, shot)
	}

	// When the router goes away the page says so and keeps polling.
	if err := caddy.Stop(); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 20*time.Second, "the page to notice the router is gone", func() bool {
		return strings.Contains(wd.text("#status"), "disconnected, retrying")
	})
}

func TestDashboardWith500Workers(t *testing.T) {
	wd := startBrowser(t)
	r := startRouter(t, "diffusion_router {\n}")

	// Ports nothing listens on: registering probes each worker, and a
	// refused connection fails at once.
	var urls []string
	seen := map[int]bool{}
	for len(urls) < 500 {
		if p := freePort(t); !seen[p] {
			seen[p] = true
			urls = append(urls, fmt.Sprintf("http://127.0.0.1:%d", p))
		}
	}
	start := time.Now()
	for _, u := range urls {
		expectStatus(t, "register "+u, r.post("/workers", `{"url":"`+u+`"}`), 200)
	}
	t.Logf("registered 500 workers in %v", time.Since(start).Round(time.Millisecond))

	wd.navigate(r.base + "/dashboard")
	start = time.Now()
	rowCount := `return document.querySelectorAll('#workers tr').length`
	waitUntil(t, 15*time.Second, "500 table rows", func() bool {
		var n int
		wd.execute(rowCount, &n)
		return n == 500
	})
	t.Logf("500 rows shown %v after navigating", time.Since(start).Round(time.Millisecond))

	// Later polls update the rows in place, quickly, and the page answers.
	var renders int
	wd.execute(`window.firstRow = document.querySelector('#workers tr'); return dashboardStats.renders`, &renders)
	waitUntil(t, 15*time.Second, "two more polls", func() bool {
		var n int
		wd.execute(`return dashboardStats.renders`, &n)
		return n >= renders+2
	})
	var after struct {
		Kept   bool    `json:"kept"`
		Rows   int     `json:"rows"`
		Render float64 `json:"render_ms"`
	}
	callStart := time.Now()
	wd.execute(`return {kept: document.contains(window.firstRow), rows: document.querySelectorAll('#workers tr').length,
		render_ms: dashboardStats.lastRenderMs}`, &after)
	call := time.Since(callStart)
	t.Logf("a poll with 500 workers renders in %.1f ms; a script call took %v", after.Render, call.Round(time.Millisecond))
	if !after.Kept || after.Rows != 500 {
		t.Fatalf("after two more polls: first row kept %v, %d rows; want the same 500 rows", after.Kept, after.Rows)
	}
	if after.Render > 500 || call > 5*time.Second {
		t.Fatalf("page is sluggish: a render took %.0f ms, a script call %v", after.Render, call)
	}

	// Sorted by worker address, ascending; a click on the header reverses it.
	ports := make([]int, len(urls))
	for i, u := range urls {
		ports[i], _ = strconv.Atoi(u[strings.LastIndexByte(u, ':')+1:])
	}
	firstRow := `return document.querySelector('#workers tr').dataset.worker`
	var first string
	if wd.execute(firstRow, &first); first != fmt.Sprintf("http://127.0.0.1:%d", slices.Min(ports)) {
		t.Fatalf("first row %s; want the lowest port, %d", first, slices.Min(ports))
	}
	wd.click(wd.findElements("#columns th")[0])
	if wd.execute(firstRow, &first); first != fmt.Sprintf("http://127.0.0.1:%d", slices.Max(ports)) {
		t.Fatalf("first row after sorting descending %s; want the highest port, %d", first, slices.Max(ports))
	}

	// Typing in the filter box leaves the matching worker. Choose one whose
	// address is no prefix of another's.
	target := ""
	for _, u := range urls {
		if !slices.ContainsFunc(urls, func(o string) bool { return o != u && strings.HasPrefix(o, u) }) {
			target = u
			break
		}
	}
	wd.sendKeys(wd.findElements("#filter")[0], target)
	var shown []string
	wd.execute(`return Array.from(document.querySelectorAll('#workers tr')).filter(tr => !tr.hidden).map(tr => tr.dataset.worker)`, &shown)
	if len(shown) != 1 || shown[0] != target {
		t.Fatalf("filter %q shows %v", target, shown)
	}
}

// completedJobs is the completed-jobs figure the page shows.
func completedJobs(wd *webDriver) int {
	wd.t.Helper()
	text := wd.text("#completed-jobs")
	n, err := strconv.Atoi(regexp.MustCompile(`[^0-9]`).ReplaceAllString(text, ""))
	if err != nil {
		return -1 // not shown yet
	}
	return n
}

// generateLoad sends image requests from up to ten clients for d, their
// number rising and falling, and returns when all have been answered.
func generateLoad(r *testRouter, d time.Duration) {
	start := time.Now()
	var wg sync.WaitGroup
	for c := range 10 {
		wg.Go(func() {
			for i := 0; time.Since(start) < d; i++ {
				f := float64(time.Since(start)) / float64(d)
				if float64(c) >= 1+9*math.Pow(math.Sin(math.Pi*f), 2) {
					time.Sleep(50 * time.Millisecond)
					continue
				}
				body := fmt.Sprintf(`{"response_format":"b64_json","prompt":"a cat","size":"512x512","num_inference_steps":%d}`, 2+(c+i)%5)
				resp, err := client.Post(r.base+"/v1/images/generations", "application/json", strings.NewReader(body))
				if err == nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			}
		})
	}
	wg.Wait()
}

// waitUntil polls cond until it holds, for at most d.
func waitUntil(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %s", d, what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// A minimal W3C WebDriver client.

// webDriver is one session of a browser that ChromeDriver runs.
type webDriver struct {
	t       *testing.T
	session string // http://127.0.0.1:port/session/id
}

// elementKey names the id of an element in WebDriver's JSON.
const elementKey = "element-6066-11e4-a52e-4f735466cecf"

var webDriverClient = &http.Client{Timeout: 90 * time.Second}

// findBrowser finds Chromium and ChromeDriver, or skips the test without
// them, unless DIFFUSION_ROUTER_REQUIRE_BROWSER=1.
func findBrowser(t *testing.T) (chromium, chromedriver string) {
	t.Helper()
	find := func(names ...string) string {
		for _, name := range names {
			if p, err := exec.LookPath(name); err == nil {
				return p
			}
		}
		return ""
	}
	chromium = find("chromium", "chromium-browser", "/usr/bin/chromium")
	chromedriver = find("chromedriver", "/usr/bin/chromedriver")
	if chromium == "" || chromedriver == "" {
		msg := fmt.Sprintf("the dashboard browser test needs chromium and chromedriver on PATH "+
			"(found chromium %q, chromedriver %q; Debian: apt-get install chromium chromium-driver)", chromium, chromedriver)
		if os.Getenv("DIFFUSION_ROUTER_REQUIRE_BROWSER") == "1" {
			t.Fatal(msg + "; DIFFUSION_ROUTER_REQUIRE_BROWSER=1 requires it")
		}
		t.Skip(msg)
	}
	return chromium, chromedriver
}

// startBrowser starts ChromeDriver and a headless Chromium session with a
// fresh profile; both stop with the test.
func startBrowser(t *testing.T) *webDriver {
	t.Helper()
	chromium, chromedriver := findBrowser(t)
	profile := t.TempDir() // removed last, after the browser is gone
	logs := &lockedBuffer{}
	port := freePort(t)
	cmd := exec.Command(chromedriver, fmt.Sprintf("--port=%d", port))
	cmd.Stdout, cmd.Stderr = logs, logs
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // the browser joins its group
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		pgid := cmd.Process.Pid
		_ = syscall.Kill(-pgid, syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(5 * time.Second):
		}
		_ = syscall.Kill(-pgid, syscall.SIGKILL) // whatever is left of the group
		<-exited
	})

	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	deadline := time.Now().Add(20 * time.Second)
	for {
		var status struct {
			Ready bool `json:"ready"`
		}
		if err := webDriverCall("GET", base+"/status", nil, &status); err == nil && status.Ready {
			break
		}
		select {
		case <-exited:
			t.Fatalf("chromedriver exited: %s", logs)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("chromedriver not ready after 20 s: %s", logs)
		}
		time.Sleep(50 * time.Millisecond)
	}

	caps := map[string]any{"capabilities": map[string]any{"alwaysMatch": map[string]any{
		"browserName": "chrome",
		"goog:chromeOptions": map[string]any{
			"binary": chromium,
			"args": []string{
				"--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
				"--disable-background-networking", "--disable-component-update", "--disable-sync",
				"--disable-dev-shm-usage", "--user-data-dir=" + profile, "--window-size=1400,900",
			},
		},
	}}}
	var created struct {
		SessionID string `json:"sessionId"`
	}
	if err := webDriverCall("POST", base+"/session", caps, &created); err != nil {
		t.Fatalf("new session: %v; chromedriver says: %s", err, logs)
	}
	wd := &webDriver{t: t, session: base + "/session/" + created.SessionID}
	t.Cleanup(func() {
		if t.Failed() {
			var status string
			if webDriverCall("POST", wd.session+"/execute/sync", map[string]any{
				"script": `return document.getElementById('status').textContent`, "args": []any{}}, &status) == nil {
				t.Logf("the page's status line: %q", status)
			}
		}
		if err := webDriverCall("DELETE", wd.session, nil, nil); err != nil {
			t.Logf("deleting the WebDriver session: %v", err)
		}
	})
	return wd
}

// webDriverCall sends one WebDriver command and decodes its "value" into
// out, when out is not nil.
func webDriverCall(method, url string, body, out any) error {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, url, rd)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := webDriverClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var reply struct {
		Value json.RawMessage `json:"value"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&reply); err != nil {
		return fmt.Errorf("%s %s: status %d, %v", method, url, resp.StatusCode, err)
	}
	if resp.StatusCode != http.StatusOK {
		var e struct{ Error, Message string }
		_ = json.Unmarshal(reply.Value, &e)
		msg, _, _ := strings.Cut(e.Message, "\n")
		return fmt.Errorf("%s %s: %s: %s", method, url, e.Error, msg)
	}
	if out == nil {
		return nil
	}
	return json.Unmarshal(reply.Value, out)
}

func (wd *webDriver) call(method, path string, body, out any) {
	wd.t.Helper()
	if err := webDriverCall(method, wd.session+path, body, out); err != nil {
		wd.t.Fatal(err)
	}
}

func (wd *webDriver) navigate(url string) {
	wd.t.Helper()
	wd.call("POST", "/url", map[string]string{"url": url}, nil)
}

// findElements returns the ids of the elements that match a CSS selector.
func (wd *webDriver) findElements(css string) []string {
	wd.t.Helper()
	var found []map[string]string
	wd.call("POST", "/elements", map[string]string{"using": "css selector", "value": css}, &found)
	ids := make([]string, len(found))
	for i, e := range found {
		ids[i] = e[elementKey]
	}
	return ids
}

func (wd *webDriver) elementText(id string) string {
	wd.t.Helper()
	var text string
	wd.call("GET", "/element/"+id+"/text", nil, &text)
	return text
}

// text is the text of the first element that matches css, "" if none does.
func (wd *webDriver) text(css string) string {
	wd.t.Helper()
	if ids := wd.findElements(css); len(ids) > 0 {
		return wd.elementText(ids[0])
	}
	return ""
}

func (wd *webDriver) click(id string) {
	wd.t.Helper()
	wd.call("POST", "/element/"+id+"/click", map[string]any{}, nil)
}

func (wd *webDriver) sendKeys(id, text string) {
	wd.t.Helper()
	wd.call("POST", "/element/"+id+"/value", map[string]string{"text": text}, nil)
}

// execute runs script in the page, as the body of a function, and decodes
// what it returns into out.
func (wd *webDriver) execute(script string, out any, args ...any) {
	wd.t.Helper()
	if args == nil {
		args = []any{}
	}
	wd.call("POST", "/execute/sync", map[string]any{"script": script, "args": args}, out)
}

// screenshot returns a PNG of the viewport.
func (wd *webDriver) screenshot() []byte {
	wd.t.Helper()
	var b64 string
	wd.call("GET", "/screenshot", nil, &b64)
	img, err := base64.StdEncoding.DecodeString(b64)
	if err != nil {
		wd.t.Fatal(err)
	}
	return img
}

// lockedBuffer collects a process's output.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
