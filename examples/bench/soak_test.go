package main

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/examples/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

func TestParseSoakFlags(t *testing.T) {
	o, err := parseFlags([]string{"--mode", "soak", "--n", "100000"})
	if err != nil {
		t.Fatal(err)
	}
	if o.warmup != 1000 || o.durationSet || o.faultEvery != 2*time.Second {
		t.Errorf("parsed %+v", o)
	}
	if o, err = parseFlags([]string{"--mode", "soak", "--duration", "5m"}); err != nil || !o.durationSet {
		t.Errorf("--duration 5m: durationSet %v, %v", o.durationSet, err)
	}
	for _, bad := range [][]string{{"--mode", "soak", "--router", "http://x:1"}, {"--mode", "soak", "--fault-every", "0s"}} {
		if _, err := parseFlags(bad); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
}

// TestSoakConfig checks the router config the soak loads, and that the
// reload with a changed option changes only that option.
func TestSoakConfig(t *testing.T) {
	f, err := testrouter.StartFleet([]float64{1, 2}, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	video, err := fakeworker.Start(fakeworker.Config{TaskType: "T2V"})
	if err != nil {
		t.Fatal(err)
	}
	defer video.Close()
	s := &soak{images: f, video: video, order: "fifo"}
	s.ports.images, s.ports.videos, s.ports.admin = 10001, 10002, 10003

	first, err := s.config()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"soak-images"`, `"soak-videos"`, `"retry_on":[500]`, `"order":"fifo"`, `"listen":"127.0.0.1:10003"`, f[1].URL(), video.URL()} {
		if !strings.Contains(string(first), want) {
			t.Errorf("config lacks %s:\n%s", want, first)
		}
	}
	s.order = otherOrder(s.order)
	changed, err := s.config()
	if err != nil {
		t.Fatal(err)
	}
	if want := strings.Replace(string(first), `"order":"fifo"`, `"order":"largest_first"`, 1); string(changed) != want {
		t.Errorf("changed config:\n%s\nwant:\n%s", changed, want)
	}
}

func TestParseMetrics(t *testing.T) {
	m := parseMetrics([]byte(`# HELP x_total X.
# TYPE x_total counter
x_total{pool="a",cause="status"} 3
x_total{pool="b",cause="status"} 2
x_total{pool="a",cause="connection"} 1
go_goroutines 42
process_resident_memory_bytes 6.5e+07
`))
	if got := m.sum("x_total", `cause="status"`); got != 5 {
		t.Errorf("status re-runs %g, want 5", got)
	}
	if got := m.sum("x_total", ""); got != 6 {
		t.Errorf("all re-runs %g, want 6", got)
	}
	if m.sum("go_goroutines", "") != 42 || m.sum("process_resident_memory_bytes", "") != 6.5e7 {
		t.Errorf("parsed %v", m)
	}
}

func TestTallyFates(t *testing.T) {
	tl := newTally()
	tl.add(kindImage, 1, nil)
	tl.add(kindImage, 2, &statusError{status: 429, body: "queue full"})
	tl.add(kindRollout, 3, &statusError{status: 502, body: "Worker request failed"})
	tl.add(kindVideo, 4, errors.New("create POST: EOF"))
	if tl.total(answered) != 1 || tl.total(refused) != 1 || tl.total(lost) != 2 {
		t.Errorf("counts %v", tl.counts)
	}
	if tl.counts[kindVideo][lost] != 1 || tl.reasons["video lost: create POST: EOF"] != 1 {
		t.Errorf("video counts %v, reasons %v", tl.counts[kindVideo], tl.reasons)
	}
}
