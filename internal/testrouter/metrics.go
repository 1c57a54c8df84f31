package testrouter

import (
	"bufio"
	"strconv"
	"strings"
	"testing"
)

// MetricsSite is a site that serves Caddy's metrics at /metrics beside
// router, the site's other handlers.
func MetricsSite(router string) string {
	return "handle /metrics {\n metrics\n}\nhandle {\n" + router + "\n}"
}

// Metric is one sample of the Prometheus text format.
type Metric struct {
	Labels map[string]string
	Value  float64
}

// Scrape reads the named series from r's /metrics.
func Scrape(t testing.TB, r *Router, name string) []Metric {
	t.Helper()
	return series(ScrapeAll(t, r), name)
}

// ScrapeAll reads r's /metrics whole.
func ScrapeAll(t testing.TB, r *Router) string {
	t.Helper()
	rp := Do(t, "GET", r.Base+"/metrics", nil)
	ExpectStatus(t, "metrics", rp, 200)
	return string(rp.Body)
}

// series reads the named series from a scrape.
func series(scraped, name string) []Metric {
	var out []Metric
	sc := bufio.NewScanner(strings.NewReader(scraped))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		m := Metric{Labels: map[string]string{}}
		labels, value, _ := strings.Cut(line[len(name):], " ")
		m.Value, _ = strconv.ParseFloat(value, 64)
		for _, pair := range strings.Split(strings.Trim(labels, "{}"), `",`) {
			if k, v, ok := strings.Cut(pair, `="`); ok {
				m.Labels[k] = strings.TrimSuffix(v, `"`)
			}
		}
		out = append(out, m)
	}
	return out
}

// Value is the sum of the series of name in r's /metrics whose labels
// include want.
func Value(t testing.TB, r *Router, name string, want map[string]string) float64 {
	t.Helper()
	return ValueIn(ScrapeAll(t, r), name, want)
}

// ValueIn is Value in a scrape.
func ValueIn(scraped, name string, want map[string]string) float64 {
	sum := 0.0
	for _, m := range series(scraped, name) {
		match := true
		for k, v := range want {
			match = match && m.Labels[k] == v
		}
		if match {
			sum += m.Value
		}
	}
	return sum
}
