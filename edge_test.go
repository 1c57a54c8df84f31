package diffusionrouter_test

import (
	"crypto/tls"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// startEdgeExample runs examples/edge/Caddyfile over ws, as its comment
// says to run it, with its public site on https://127.0.0.1:<port> under
// Caddy's internal CA (whose root the test does not install anywhere), and
// returns the public and the operators' base URLs.
func startEdgeExample(t *testing.T, ws []*fakeworker.Worker) (public, ops string) {
	t.Helper()
	port, opsPort := testrouter.Port(t), testrouter.Port(t)
	public, ops = fmt.Sprintf("https://127.0.0.1:%d", port), fmt.Sprintf("http://127.0.0.1:%d", opsPort)
	t.Setenv("WORKERS", testrouter.URLs(ws))
	t.Setenv("ROUTER_SITE", public)
	t.Setenv("OPS_PORT", fmt.Sprint(opsPort))
	t.Setenv("ROUTER_BIND", "127.0.0.1")
	t.Setenv("ROUTER_ADMIN", "off")
	t.Setenv("ROUTER_ADMIN_TOKEN", "edge-token")
	cfg := testrouter.LoadExample(t, "examples/edge/Caddyfile")
	apps := cfg["apps"].(map[string]any)
	apps["pki"] = map[string]any{"certificate_authorities": map[string]any{"local": map[string]any{"install_trust": false}}}
	testrouter.RunExample(t, cfg, ops)
	return public, ops
}

// edgeClient is a client of the public site, which trusts Caddy's
// internal CA without the test installing its root. It follows no
// redirect: one would be the site's answer.
var edgeClient = &http.Client{
	Timeout:       60 * time.Second,
	Transport:     &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}},
	CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
}

func edgeDo(t *testing.T, method, url, body string, header ...string) testrouter.Reply {
	t.Helper()
	saved := testrouter.Client
	testrouter.Client = edgeClient
	defer func() { testrouter.Client = saved }()
	return testrouter.Do(t, method, url, strings.NewReader(body), header...)
}

func TestTheEdgeExampleOpensOnlyGenerationAndHealth(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{})
	public, ops := startEdgeExample(t, ws)

	testrouter.WaitFor(t, func() bool { // the certificate is issued as the site starts
		resp, err := edgeClient.Get(public + "/readyz")
		if err == nil {
			resp.Body.Close()
		}
		return err == nil && resp.StatusCode == http.StatusOK
	})
	testrouter.ExpectStatus(t, "GET /health over TLS", edgeDo(t, "GET", public+"/health", ""), http.StatusOK)
	rp := edgeDo(t, "POST", public+"/v1/images/generations", `{"prompt":"a","size":"64x64","response_format":"b64_json"}`)
	testrouter.ExpectStatus(t, "an anonymous generation", rp, http.StatusOK)
	if rp.Header.Get("X-Weight-Version") == "" {
		t.Errorf("the generation came without the router's X-Weight-Version: %v", rp.Header)
	}
	if server, ok := rp.Header["Server"]; ok { // the worker's uvicorn names itself
		t.Errorf("the generation names its server: %v", server)
	}

	for _, c := range []struct{ method, path string }{
		{"GET", "/workers"}, {"GET", "/list_workers"}, {"GET", "/dashboard"}, {"GET", "/dashboard/data"},
		{"GET", "/v1/models"}, {"GET", "/engine_metrics"}, {"GET", "/fleet_operation"},
		{"POST", "/add_worker?url=http://10.0.0.9:30000"}, {"POST", "/workers"},
		{"POST", "/update_weights_from_disk"}, {"POST", "/v1/set_lora"}, {"POST", "/abort_request"},
		{"POST", "/release_memory_occupation"}, {"GET", "/get_weights_checksum"}, {"GET", "/server_info"},
		{"POST", "/pause_generation"}, {"POST", "/continue_generation"}, {"POST", "/pause_generation/"}, {"POST", "//continue_generation;x=1"},
		{"POST", "/update_weight_version"}, {"POST", "/update_weight_version/"}, {"POST", "//update_weight_version;x=1"}, {"GET", "/get_weight_version"},
		{"POST", "/v1%2Fset_lora"}, {"POST", "/v1/images/../../update_weights_from_disk"},
		{"POST", "/v1/set_lora/"}, {"POST", "//v1//set_lora"}, {"POST", "/v1/set_lora;x=1"}, {"POST", "/v1/images//..//..//update_weights_from_disk"},
	} {
		rp := edgeDo(t, c.method, public+c.path, "{}", "Authorization", "Bearer wrong")
		if rp.Status != http.StatusNotFound && rp.Status != http.StatusBadRequest {
			t.Errorf("anonymous %s %s: status %d, want 404 (or 400); body %.200s", c.method, c.path, rp.Status, rp.Body)
			continue
		}
		rp.ErrorText(t) // a JSON error
	}

	// The operators' site on loopback has the whole API of the same pool.
	var workers struct{ Workers []map[string]any }
	rp = edgeDo(t, "GET", ops+"/workers", "")
	testrouter.ExpectStatus(t, "GET /workers on the operators' site", rp, http.StatusOK)
	if err := json.Unmarshal(rp.Body, &workers); err != nil || len(workers.Workers) != 1 || workers.Workers[0]["requests_served"] != 1.0 {
		t.Fatalf("the operators' site shows %s; want the one worker, with the generation it served", rp.Body)
	}
	testrouter.ExpectStatus(t, "a registration on the operators' site, from loopback",
		edgeDo(t, "POST", ops+"/add_worker?url="+ws[0].URL(), ""), http.StatusOK)
}
