package diffusionrouter_test

import (
	"encoding/base64"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// The users of examples/tenants/Caddyfile in this test, with their
// passwords' bcrypt hashes (of the lowest cost, so that checking one is
// quick; `caddy hash-password` makes costlier ones).
var exampleUsers = map[string][2]string{
	"TEAM_A_HASH": {"team-a", "$2a$04$TvPOjahfx5X2pR9fmDPzieuh3S5OxeYv50vkgUI1hwhKvSng.JT0O"},
	"TEAM_B_HASH": {"team-b", "$2a$04$nqbzn6ondU0kLI/8g4W2/uTTjHj1lwKunjZb.VTQGwacWzwTXnV3e"},
}

// startTenantsExample runs examples/tenants/Caddyfile itself over ws, as
// its comment says to run it, with a storage folder of the test's own.
func startTenantsExample(t *testing.T, ws []*fakeworker.Worker) *testrouter.Router {
	t.Helper()
	port := testrouter.Port(t)
	t.Setenv("WORKERS", testrouter.URLs(ws))
	t.Setenv("ROUTER_PORT", fmt.Sprint(port))
	t.Setenv("ROUTER_BIND", "127.0.0.1")
	t.Setenv("ROUTER_ADMIN", "off")
	for env, user := range exampleUsers {
		t.Setenv(env, user[1])
	}
	cfg := testrouter.LoadExample(t, "examples/tenants/Caddyfile")
	testrouter.RunExample(t, cfg, fmt.Sprintf("http://127.0.0.1:%d", port)) // its /health answers without credentials, or this fails
	return testrouter.Attach(t, port)
}

// as sends a request to r as user with password, and the header pairs.
func as(t *testing.T, r *testrouter.Router, user, password, method, path, body string, header ...string) testrouter.Reply {
	t.Helper()
	if user != "" {
		header = append(header, "Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte(user+":"+password)))
	}
	return testrouter.Do(t, method, r.Base+path, strings.NewReader(body), header...)
}

func TestTenantsExampleTakesTheTenantFromTheAuthenticatedUser(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{UnitMs: 20})
	r := startTenantsExample(t, ws)
	teamA := func(method, path, body string, header ...string) testrouter.Reply {
		return as(t, r, "team-a", "team-a password", method, path, body, header...)
	}
	teamB := func(method, path, body string, header ...string) testrouter.Reply {
		return as(t, r, "team-b", "team-b password", method, path, body, header...)
	}

	for what, rp := range map[string]testrouter.Reply{
		"no credentials":           as(t, r, "", "", "POST", "/v1/images/generations", testrouter.SmallImage, "X-Tenant", "team-a"),
		"a wrong password":         as(t, r, "team-a", "guess", "POST", "/v1/images/generations", testrouter.SmallImage),
		"the worker list, no user": as(t, r, "", "", "GET", "/workers", ""),
	} {
		testrouter.ExpectStatus(t, what, rp, 401)
	}
	if n := ws[0].Stats().Jobs; n != 0 {
		t.Fatalf("the worker ran %d jobs of clients that were refused", n)
	}

	made := teamA("POST", "/v1/images/generations", testrouter.SmallImage, "X-Tenant", "team-b")
	testrouter.ExpectStatus(t, "team-a's image, claiming team-b", made, 200)
	id := made.JSON(t)["id"].(string)
	testrouter.ExpectStatus(t, "team-b's image, claiming team-a", teamB("POST", "/v1/images/generations", testrouter.SmallImage, "X-Tenant", "team-a"), 200)
	var names []string
	for _, tn := range teamA("GET", "/workers", "").JSON(t)["tenants"].([]any) {
		if tn := tn.(map[string]any); tn["cost_served"].(float64) > 0 {
			names = append(names, tn["name"].(string))
		}
	}
	slices.Sort(names)
	if !slices.Equal(names, []string{"team-a", "team-b"}) {
		t.Errorf("tenants served: %v; want team-a and team-b, whatever X-Tenant said", names)
	}
	rp := teamB("GET", "/v1/images/"+id+"/content", "", "X-Tenant", "team-a")
	testrouter.ExpectStatus(t, "team-b fetching team-a's image, claiming team-a", rp, 404)
	testrouter.ExpectStatus(t, "team-a fetching its image", teamA("GET", "/v1/images/"+id+"/content", ""), 200)

	// Priorities come from the user too: team-a's 5, anyone else's 0.
	held := make(chan int, 3)
	send := func(do func(string, string, string, ...string) testrouter.Reply, steps int, header ...string) {
		body := fmt.Sprintf(`{"response_format":"b64_json","prompt":"x","size":"1024x1024","num_inference_steps":%d}`, steps)
		held <- do("POST", "/v1/images/generations", body, header...).Status
	}
	release := ws[0].Hold()
	t.Cleanup(release)
	// Held until the others are seen waiting, and of so many steps that the
	// router, which learned the worker's speed from the images above,
	// predicts it to run long and sends the worker no second job meanwhile.
	go send(teamB, 1000)
	testrouter.WaitFor(t, func() bool {
		return teamA("GET", "/workers", "").JSON(t)["workers"].([]any)[0].(map[string]any)["active_requests"] == 1.0
	})
	go send(teamA, 1)
	go send(teamB, 1, "X-Priority", "10")
	var queued map[string]any
	testrouter.WaitFor(t, func() bool {
		queued = teamA("GET", "/workers", "").JSON(t)["queued_by_priority"].(map[string]any)
		return queued["0"] == 1.0 && queued["5"] == 1.0 || queued["10"] != nil
	})
	if queued["10"] != nil {
		t.Errorf("jobs waiting by priority: %v; want one at 5 (team-a's) and one at 0 (team-b's X-Priority: 10 is ignored)", queued)
	}
	release()
	for range 3 {
		if status := <-held; status != 200 {
			t.Fatalf("a job got %d", status)
		}
	}
}
