package e2e

// Browser tests of the status page at /dashboard: headless Chromium driven
// over the DevTools protocol with chromedp. They need the chromium binary
// (the Debian package chromium); without it they skip, unless
// DIFFUSION_ROUTER_REQUIRE_BROWSER=1 (as in CI), when they fail.
// DASHBOARD_SCREENSHOT=path makes TestDashboardInBrowser put some load on
// the router and save a screenshot of the page there.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"image/png"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/chromedp/chromedp"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/etcdtest"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

func TestDashboardInBrowser(t *testing.T) {
	tab := startBrowser(t)
	ws := testrouter.StartWorkers(t,
		fakeworker.Config{Name: "a", UnitMs: 100},
		fakeworker.Config{Name: "b", UnitMs: 100, Speed: 1.5},
		fakeworker.Config{Name: "c", UnitMs: 100, Speed: 0.7})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n}")

	tab.navigate(r.Base + "/dashboard")
	waitUntil(t, 20*time.Second, "a table row for each worker", func() bool {
		for _, w := range ws {
			if tab.count(`#workers tr[data-worker="`+w.URL()+`"]`) != 1 {
				return false
			}
		}
		return true
	})
	if n := tab.count("#workers tr"); n != len(ws) {
		t.Fatalf("%d table rows for %d workers", n, len(ws))
	}

	before := completedJobs(tab)
	if before < 0 {
		t.Fatalf("completed jobs shows %q", tab.text("#completed-jobs"))
	}
	for i := range 5 {
		testrouter.ExpectStatus(t, fmt.Sprintf("generation %d", i), r.Post("/v1/images/generations", testrouter.SmallImage), 200)
	}
	waitUntil(t, 20*time.Second, "completed jobs to grow by 5", func() bool { return completedJobs(tab) >= before+5 })
	if got := completedJobs(tab); got != before+5 {
		t.Fatalf("completed jobs went from %d to %d after 5 requests", before, got)
	}

	// A worker that does not answer gets a row of its own.
	dead := fmt.Sprintf("http://127.0.0.1:%d", testrouter.Port(t))
	testrouter.ExpectStatus(t, "register", r.Post("/workers", `{"url":"`+dead+`"}`), 200)
	waitUntil(t, 20*time.Second, "a row for the registered worker", func() bool {
		return tab.count(`#workers tr[data-worker="`+dead+`"]`) == 1
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
			tab.execute(`const q = samples.map((s) => s.queued); return {peak: Math.max(0, ...q), last: q[q.length - 1] || 0}`, &q)
			return q.Peak >= 4 && 2*q.Last <= q.Peak
		})
	} else {
		close(loaded)
	}
	img := tab.screenshot()
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
		return strings.Contains(tab.text("#status"), "disconnected, retrying")
	})
}

func TestDashboardShowsTenants(t *testing.T) {
	tab := startBrowser(t)
	ws := testrouter.StartWorkers(t, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n tenant {http.request.header.X-Tenant}\n}")
	tab.navigate(r.Base + "/dashboard")
	waitUntil(t, 20*time.Second, "the worker's row", func() bool { return tab.count("#workers tr") == 1 })
	if n := tab.count("#tenants tr"); n != 0 {
		t.Fatalf("%d tenant rows before any job named a tenant", n)
	}
	if tab.count("#ha-card[hidden]") != 1 {
		t.Fatal("the page shows an active router without ha")
	}
	rp := r.Post("/v1/images/generations", `{"response_format":"b64_json","prompt":"x","size":"8x8"}`, "X-Tenant", "trainer-1")
	testrouter.ExpectStatus(t, "job", rp, 200)
	waitUntil(t, 20*time.Second, "a row for the tenant trainer-1", func() bool {
		return tab.count(`#tenants tr[data-name="trainer-1"]`) == 1
	})
}

// With ha, the page says whether this router leads, and once it no
// longer does (etcd gone, its lease run out), that it stands by.
func TestDashboardShowsTheActiveRouter(t *testing.T) {
	tab := startBrowser(t)
	etcd := etcdtest.Start(t)
	ws := testrouter.StartWorkers(t, fakeworker.Config{})
	r := testrouter.Start(t, haRouter(etcd, ws, "advertise http://router-a:8080"))
	tab.navigate(r.Base + "/dashboard")
	waitUntil(t, 20*time.Second, "the page to say this router leads", func() bool { return tab.text("#ha") == "this router" })
	etcd.Stop()
	waitUntil(t, 20*time.Second, "the page to say this router stands by", func() bool { return strings.HasPrefix(tab.text("#ha"), "standby") })
}

func TestDashboardShowsAdapters(t *testing.T) {
	tab := startBrowser(t)
	ws := testrouter.StartWorkers(t, fakeworker.Config{})
	r := testrouter.Start(t, "diffusion_router {\n workers "+testrouter.URLs(ws)+"\n adapter policy-a /ckpt/a\n}")
	rp := r.Post("/v1/images/generations", `{"model":"policy-a","response_format":"b64_json","prompt":"x","size":"8x8"}`)
	testrouter.ExpectStatus(t, "job", rp, 200)
	tab.navigate(r.Base + "/dashboard")
	waitUntil(t, 20*time.Second, "rows for the base weights and the adapter", func() bool {
		return tab.count(`#adapters tr[data-name="base"]`) == 1 && tab.count(`#adapters tr[data-name="policy-a"]`) == 1
	})
	waitUntil(t, 20*time.Second, "the worker's row to name its adapter", func() bool {
		return strings.Contains(tab.text("#workers"), "policy-a")
	})
}

func TestDashboardWith500Workers(t *testing.T) {
	tab := startBrowser(t)
	r := testrouter.Start(t, "diffusion_router {\n}")

	// Ports nothing listens on: registering probes each worker, and a
	// refused connection fails at once.
	var urls []string
	seen := map[int]bool{}
	for len(urls) < 500 {
		if p := testrouter.Port(t); !seen[p] {
			seen[p] = true
			urls = append(urls, fmt.Sprintf("http://127.0.0.1:%d", p))
		}
	}
	start := time.Now()
	for _, u := range urls {
		testrouter.ExpectStatus(t, "register "+u, r.Post("/workers", `{"url":"`+u+`"}`), 200)
	}
	t.Logf("registered 500 workers in %v", time.Since(start).Round(time.Millisecond))

	tab.navigate(r.Base + "/dashboard")
	start = time.Now()
	rowCount := `return document.querySelectorAll('#workers tr').length`
	waitUntil(t, 15*time.Second, "500 table rows", func() bool {
		var n int
		tab.execute(rowCount, &n)
		return n == 500
	})
	t.Logf("500 rows shown %v after navigating", time.Since(start).Round(time.Millisecond))

	// Later polls update the rows in place, quickly, and the page answers.
	var renders int
	tab.execute(`window.firstRow = document.querySelector('#workers tr'); return dashboardStats.renders`, &renders)
	waitUntil(t, 15*time.Second, "two more polls", func() bool {
		var n int
		tab.execute(`return dashboardStats.renders`, &n)
		return n >= renders+2
	})
	var after struct {
		Kept   bool    `json:"kept"`
		Rows   int     `json:"rows"`
		Render float64 `json:"render_ms"`
	}
	callStart := time.Now()
	tab.execute(`return {kept: document.contains(window.firstRow), rows: document.querySelectorAll('#workers tr').length,
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
	if tab.execute(firstRow, &first); first != fmt.Sprintf("http://127.0.0.1:%d", slices.Min(ports)) {
		t.Fatalf("first row %s; want the lowest port, %d", first, slices.Min(ports))
	}
	tab.click("#columns th")
	if tab.execute(firstRow, &first); first != fmt.Sprintf("http://127.0.0.1:%d", slices.Max(ports)) {
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
	tab.sendKeys("#filter", target)
	var shown []string
	tab.execute(`return Array.from(document.querySelectorAll('#workers tr')).filter(tr => !tr.hidden).map(tr => tr.dataset.worker)`, &shown)
	if len(shown) != 1 || shown[0] != target {
		t.Fatalf("filter %q shows %v", target, shown)
	}
}

// completedJobs is the completed-jobs figure the page shows.
func completedJobs(tab *browserTab) int {
	tab.t.Helper()
	text := tab.text("#completed-jobs")
	n, err := strconv.Atoi(regexp.MustCompile(`[^0-9]`).ReplaceAllString(text, ""))
	if err != nil {
		return -1 // not shown yet
	}
	return n
}

// generateLoad sends image requests from up to ten clients for d, their
// number rising and falling, and returns when all have been answered.
func generateLoad(r *testrouter.Router, d time.Duration) {
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
				resp, err := testrouter.Client.Post(r.Base+"/v1/images/generations", "application/json", strings.NewReader(body))
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

// actionTimeout bounds each browser command, so that a browser that stops
// answering fails the test rather than hanging it.
const actionTimeout = 90 * time.Second

// browserTab is a tab of a headless Chromium of the test's own.
type browserTab struct {
	t   *testing.T
	ctx context.Context // chromedp's context of the tab
}

// findChromium finds Chromium, or skips the test without it, unless
// DIFFUSION_ROUTER_REQUIRE_BROWSER=1.
func findChromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "/usr/bin/chromium"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	msg := "the dashboard browser test needs chromium on PATH (Debian: apt-get install chromium)"
	if os.Getenv("DIFFUSION_ROUTER_REQUIRE_BROWSER") == "1" {
		t.Fatal(msg + "; DIFFUSION_ROUTER_REQUIRE_BROWSER=1 requires it")
	}
	t.Skip(msg)
	return ""
}

// browserOptions start Chromium as root on a machine without network:
// nothing is fetched in the background, and the window is large enough
// for the whole page. They name again what chromedp's defaults already
// have, as the tests rely on it. No user-data-dir is given, so chromedp
// makes a fresh one and, as it owns it, kills Chromium's leftover children
// and removes it when the browser stops.
func browserOptions(chromium string, output io.Writer) []chromedp.ExecAllocatorOption {
	return append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(chromium),
		chromedp.CombinedOutput(output),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.WindowSize(1400, 900),
	)
}

// startBrowser starts a headless Chromium with a blank tab; the browser
// stops, and its goroutines end, with the test.
func startBrowser(t *testing.T) *browserTab {
	t.Helper()
	chromium := findChromium(t)
	output := &lockedBuffer{}
	// Not t.Context(): it ends before the cleanups, and the one below still
	// reads the page.
	allocCtx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), browserOptions(chromium, output)...)
	ctx, cancel := chromedp.NewContext(allocCtx)
	tab := &browserTab{t: t, ctx: ctx}
	t.Cleanup(func() {
		if t.Failed() {
			tab.logStatus()
		}
		cancel()      // kills the browser and waits for it
		cancelAlloc() // waits for the copy of its output
		waitNoChromedpGoroutines(t)
	})
	// The first action starts the browser, whose life is then that of ctx:
	// with no timeout, unlike the actions after it.
	if err := chromedp.Do(ctx); err != nil {
		t.Fatalf("starting %s: %v; it printed: %s", chromium, err, output)
	}
	return tab
}

// logStatus logs the page's status line, for a failed test.
func (tab *browserTab) logStatus() {
	ctx, cancel := context.WithTimeout(tab.ctx, 10*time.Second)
	defer cancel()
	status, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.getElementById('status')?.textContent ?? ''`))
	if err == nil {
		tab.t.Logf("the page's status line: %q", status)
	}
}

// waitNoChromedpGoroutines fails the test if chromedp's goroutines outlive
// the browser: goroutines_test.go's checks would not see them, as none
// runs this package's code.
func waitNoChromedpGoroutines(t *testing.T) {
	t.Helper()
	var left []string
	testkit.WaitUntil(30*time.Second, func() bool {
		left = left[:0]
		for _, s := range testkit.Stacks() {
			if strings.Contains(s, "github.com/chromedp/") {
				left = append(left, s)
			}
		}
		return len(left) == 0
	})
	if len(left) > 0 {
		t.Errorf("%d goroutines of chromedp outlived the browser:\n\n%s", len(left), strings.Join(left, "\n\n"))
	}
}

// run runs one action in the tab, for at most actionTimeout.
func run[T any](tab *browserTab, action chromedp.Action[T]) T {
	tab.t.Helper()
	ctx, cancel := context.WithTimeout(tab.ctx, actionTimeout)
	defer cancel()
	v, err := chromedp.Run(ctx, action)
	if err != nil {
		tab.t.Fatal(err)
	}
	return v
}

func (tab *browserTab) navigate(url string) {
	tab.t.Helper()
	run(tab, chromedp.Navigate(url))
}

// count is the number of elements that match a CSS selector, at once: a
// query action would wait for at least one.
func (tab *browserTab) count(css string) int {
	tab.t.Helper()
	var n int
	tab.execute(`return document.querySelectorAll(`+jsString(css)+`).length`, &n)
	return n
}

// text is the rendered text of the first element that matches css, "" if
// none does.
func (tab *browserTab) text(css string) string {
	tab.t.Helper()
	var text string
	tab.execute(`return document.querySelector(`+jsString(css)+`)?.innerText ?? ''`, &text)
	return text
}

// click clicks, with the mouse, the first element that matches css.
func (tab *browserTab) click(css string) {
	tab.t.Helper()
	run(tab, chromedp.Click(chromedp.CSS(css)))
}

// sendKeys types text into the first element that matches css.
func (tab *browserTab) sendKeys(css, text string) {
	tab.t.Helper()
	run(tab, chromedp.SendKeys(chromedp.CSS(css), text))
}

// execute runs script in the page, as the body of a function, and decodes
// what it returns into out.
func (tab *browserTab) execute(script string, out any) {
	tab.t.Helper()
	raw := run(tab, chromedp.Evaluate[[]byte]("(() => {\n"+script+"\n})()"))
	if err := json.Unmarshal(raw, out); err != nil {
		tab.t.Fatalf("the script's result %s: %v", raw, err)
	}
}

// screenshot returns a PNG of the viewport.
func (tab *browserTab) screenshot() []byte {
	tab.t.Helper()
	return run(tab, chromedp.CaptureScreenshot())
}

// jsString is s as a JavaScript string literal: JSON's string syntax is
// JavaScript's.
func jsString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
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
