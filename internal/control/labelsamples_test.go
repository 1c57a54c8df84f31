package control

import (
	"bytes"
	"testing"
)

func TestLabelSamples(t *testing.T) {
	var out bytes.Buffer
	seen := map[string]bool{}
	text := "# HELP x_total Xs.\n# TYPE x_total counter\nx_total 3\ny{a=\"{}\"} 1.5\nz{} 2\n"
	labelSamples(&out, []byte(text), "10.0.0.1:30000", seen)
	labelSamples(&out, []byte(text), "10.0.0.2:30000", seen)
	want := "# HELP x_total Xs.\n# TYPE x_total counter\n" +
		"x_total{worker_addr=\"10.0.0.1:30000\"} 3\ny{worker_addr=\"10.0.0.1:30000\",a=\"{}\"} 1.5\nz{worker_addr=\"10.0.0.1:30000\"} 2\n" +
		"x_total{worker_addr=\"10.0.0.2:30000\"} 3\ny{worker_addr=\"10.0.0.2:30000\",a=\"{}\"} 1.5\nz{worker_addr=\"10.0.0.2:30000\"} 2\n"
	if out.String() != want {
		t.Fatalf("labelled:\n%s\nwant:\n%s", out.String(), want)
	}
}
