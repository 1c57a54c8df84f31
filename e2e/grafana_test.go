package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/etcdtest"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// grafanaDashboard is the dashboard examples/grafana holds for users to
// import.
const grafanaDashboard = "../examples/grafana/diffusion-router.json"

// promDatasource is the data source every panel, query and variable of the
// dashboard names: the input Grafana asks for when it imports it.
const promDatasource = "${DS_PROMETHEUS}"

// dashboard is what the tests read of a Grafana dashboard's JSON.
type dashboard struct {
	Inputs        []input `json:"__inputs"`
	SchemaVersion int     `json:"schemaVersion"`
	Panels        []panel `json:"panels"`
	Templating    struct {
		List []struct {
			Name       string          `json:"name"`
			Datasource *datasourceRef  `json:"datasource"`
			Definition string          `json:"definition"`
			Query      json.RawMessage `json:"query"` // a string or, as Grafana writes it now, an object
		} `json:"list"`
	} `json:"templating"`
}

// input is what Grafana asks for when it imports the dashboard.
type input struct {
	Name     string `json:"name"`
	Type     string `json:"type"`
	PluginID string `json:"pluginId"`
}

type panel struct {
	ID         int            `json:"id"`
	Title      string         `json:"title"`
	Type       string         `json:"type"`
	Datasource *datasourceRef `json:"datasource"`
	Targets    []struct {
		RefID      string         `json:"refId"`
		Expr       string         `json:"expr"`
		Datasource *datasourceRef `json:"datasource"`
	} `json:"targets"`
	Panels []panel `json:"panels"` // a collapsed row's
}

type datasourceRef struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

func (d *datasourceRef) isInput() bool {
	return d != nil && d.Type == "prometheus" && d.UID == promDatasource
}

func readDashboard(t *testing.T) dashboard {
	t.Helper()
	raw, err := os.ReadFile(grafanaDashboard)
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("%s: %v", grafanaDashboard, err)
	}
	return d
}

// allPanels are the dashboard's panels, those inside rows included.
func (d dashboard) allPanels() []panel {
	var out []panel
	var walk func([]panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			out = append(out, p)
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	return out
}

// queries are the PromQL of every panel and of every variable.
func (d dashboard) queries() []string {
	var out []string
	for _, p := range d.allPanels() {
		for _, tg := range p.Targets {
			out = append(out, tg.Expr)
		}
	}
	for _, v := range d.Templating.List {
		out = append(out, v.Definition, string(v.Query))
	}
	return out
}

var metricName = regexp.MustCompile(`\bcaddy_diffusion_[A-Za-z0-9_:]+`)

// metricNames are the caddy_diffusion_* names the queries use, sorted.
func (d dashboard) metricNames() []string {
	var out []string
	for _, q := range d.queries() {
		out = append(out, metricName.FindAllString(q, -1)...)
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// The dashboard imports as Grafana exports one for sharing: a schema
// version, the Prometheus data source as an input, and every panel,
// query and variable on that input, so none points at a data source of
// the exporter's Grafana; panel ids are unique, as Grafana needs them to
// be.
func TestGrafanaDashboardImports(t *testing.T) {
	d := readDashboard(t)
	// From version 36 on, a data source is a {type, uid} reference, which
	// Grafana keeps as it is; before it, Grafana migrates them.
	if d.SchemaVersion < 36 {
		t.Errorf("schemaVersion %d; want a current one (36 or later)", d.SchemaVersion)
	}
	if !slices.Contains(d.Inputs, input{Name: "DS_PROMETHEUS", Type: "datasource", PluginID: "prometheus"}) {
		t.Errorf("__inputs %+v declare no Prometheus data source DS_PROMETHEUS", d.Inputs)
	}
	seen := map[int]string{}
	for _, p := range d.allPanels() {
		switch other, dup := seen[p.ID]; {
		case p.ID <= 0:
			t.Errorf("panel %q has no id", p.Title)
		case dup:
			t.Errorf("panels %q and %q share the id %d", other, p.Title, p.ID)
		}
		seen[p.ID] = p.Title
		if !p.Datasource.isInput() {
			t.Errorf("panel %q has data source %+v; want prometheus %s", p.Title, p.Datasource, promDatasource)
		}
		if p.Type != "row" && len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			if !tg.Datasource.isInput() || strings.TrimSpace(tg.Expr) == "" {
				t.Errorf("panel %q, query %s: data source %+v, expr %q; want an expr on prometheus %s", p.Title, tg.RefID, tg.Datasource, tg.Expr, promDatasource)
			}
		}
	}
	for _, v := range d.Templating.List {
		if !v.Datasource.isInput() {
			t.Errorf("variable %s has data source %+v; want prometheus %s", v.Name, v.Datasource, promDatasource)
		}
	}
}

// Every metric a query of the dashboard names is one the router serves: a
// scrape of a router that ran one job, one weight update and one LoRA
// call, and won one HA election, has a # HELP line for each (a histogram's
// _bucket, _sum and _count by its own name). And the dashboard shows each
// thing it is for: the series below must be among them. The last two are
// the request-body budget's: with no exception for them, the test fails
// if that budget leaves them without a series.
func TestGrafanaDashboardNamesOnlyServedMetrics(t *testing.T) {
	names := readDashboard(t).metricNames()
	for _, want := range []string{
		"caddy_diffusion_worker_state",              // fleet and states
		"caddy_diffusion_queue_wait_seconds_bucket", // queue and waits
		"caddy_diffusion_requests_total",            // jobs by outcome
		"caddy_diffusion_weight_updates_total",      // weight updates
		"caddy_diffusion_adapter_workers",           // adapters
		"caddy_diffusion_ha_leader",                 // the HA leader
		"caddy_diffusion_request_body_bytes_held",
		"caddy_diffusion_request_bodies_refused_total",
	} {
		if !slices.Contains(names, want) {
			t.Errorf("no query of the dashboard shows %s", want)
		}
	}

	etcd := etcdtest.Start(t)
	workers := testrouter.StartWorkers(t, fakeworker.Config{Name: "w1"})
	r := testrouter.Start(t, testrouter.MetricsSite(fmt.Sprintf(`diffusion_router ha-pool {
 workers %s
 weights_path_prefix /ckpt
 adapter a /ckpt/lora/a
 ha etcd %s {
  lease_ttl %s
 }
}`, testrouter.URLs(workers), etcd.Endpoint, haLeaseTTL)))
	testrouter.WaitFor(t, func() bool { return leads(t, r) })
	testrouter.ExpectStatus(t, "a job on adapter a", r.Post("/v1/images/generations",
		`{"model":"a","response_format":"b64_json","prompt":"a cat","size":"64x64","num_inference_steps":1}`), http.StatusOK)
	testrouter.ExpectStatus(t, "a weight update", r.Post("/update_weights_from_disk", `{"model_path":"/ckpt/step-1"}`), http.StatusOK)
	testrouter.ExpectStatus(t, "a LoRA call", r.Post("/v1/set_lora", `{"lora_nickname":"a","lora_path":"/ckpt/lora/a-2"}`), http.StatusOK)

	help, types := described(testrouter.ScrapeAll(t, r))
	for _, name := range names {
		if !help[name] && !help[histogramOf(name, types)] {
			t.Errorf("the dashboard queries %s, which the router's scrape has no # HELP for", name)
		}
	}
}

// described reads a scrape's # HELP and # TYPE lines: the metrics it
// describes, and their types.
func described(scrape string) (help map[string]bool, types map[string]string) {
	help, types = map[string]bool{}, map[string]string{}
	sc := bufio.NewScanner(strings.NewReader(scrape))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		switch f := strings.Fields(sc.Text()); {
		case len(f) >= 3 && f[0] == "#" && f[1] == "HELP":
			help[f[2]] = true
		case len(f) == 4 && f[0] == "#" && f[1] == "TYPE":
			types[f[2]] = f[3]
		}
	}
	return help, types
}

// histogramOf is the histogram whose series name is, or "".
func histogramOf(name string, types map[string]string) string {
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(name, suffix); ok && types[base] == "histogram" {
			return base
		}
	}
	return ""
}
