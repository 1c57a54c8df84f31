package jobkinds

import (
	"bytes"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/scheduler"
)

// passList sends a worker's answer, status and body, through a TenantList
// of team-a, which made the job "mine", and returns what the client got.
func passList(t *testing.T, status int, body string, attemptErr error) *httptest.ResponseRecorder {
	t.Helper()
	owners := scheduler.NewJobOwners(10, scheduler.DefaultOwnerTTL)
	owners.Remember("mine", "http://w:1", "team-a")
	owners.Remember("theirs", "http://w:1", "team-b")
	client := httptest.NewRecorder()
	l := &TenantList{ResponseWriter: client, owners: owners, tenant: "team-a"}
	l.Header().Set("Content-Length", "999")
	l.WriteHeader(status)
	if _, err := l.Write([]byte(body)); err != nil {
		t.Fatal(err)
	}
	if err := l.Finish(attemptErr); err != nil && attemptErr == nil {
		t.Fatal(err)
	}
	return client
}

func TestAVideoListKeepsTheTenantsJobsAndItsEnds(t *testing.T) {
	got := passList(t, 200, `{"object":"list","data":[{"id":"theirs"},{"id":"mine","status":"completed"},{"id":"unknown"}],"has_more":true,"first_id":"theirs","last_id":"unknown"}`, nil)
	want := `{"data":[{"id":"mine","status":"completed"}],"first_id":"mine","has_more":true,"last_id":"mine","object":"list"}`
	if got.Code != 200 || got.Body.String() != want || got.Header().Get("Content-Length") != strconv.Itoa(len(want)) {
		t.Fatalf("client got %d %s (Content-Length %s); want 200 %s", got.Code, got.Body, got.Header().Get("Content-Length"), want)
	}
	got = passList(t, 200, `{"data":[{"id":"theirs"}],"first_id":"theirs","last_id":"theirs"}`, nil)
	if want := `{"data":[],"first_id":null,"last_id":null}`; got.Body.String() != want {
		t.Fatalf("a list of none of the tenant's jobs: %s; want %s", got.Body, want)
	}
}

func TestAVideoListTheRouterCannotReadIsABadGateway(t *testing.T) {
	for name, c := range map[string]struct {
		body string
		err  error
		want string
	}{
		"not JSON":      {body: `<html>`, want: `no JSON object with a \"data\" list`},
		"no data":       {body: `{"object":"list"}`, want: `no JSON object with a \"data\" list`},
		"data no list":  {body: `{"data":{"id":"theirs"}}`, want: `no JSON object with a \"data\" list`},
		"broken off":    {body: `{"data":[{"id":"mi`, err: errors.New("unexpected EOF"), want: "unexpected EOF"},
		"over its size": {body: strings.Repeat(" ", maxVideoList+1), want: "longer than the 16777216 bytes"},
	} {
		got := passList(t, 200, c.body, c.err)
		if got.Code != http.StatusBadGateway || !strings.Contains(got.Body.String(), c.want) || bytes.Contains(got.Body.Bytes(), []byte("theirs")) {
			t.Errorf("%s: client got %d %s; want 502 with an error saying %s", name, got.Code, got.Body, c.want)
		}
	}
}

func TestAVideoListRefusedByTheWorkerPassesAsItCame(t *testing.T) {
	body := `{"detail":[{"type":"greater_than_equal","loc":["query","limit"]}]}`
	got := passList(t, 422, body, nil)
	if got.Code != 422 || got.Body.String() != body {
		t.Fatalf("client got %d %s; want the worker's 422 unchanged", got.Code, got.Body)
	}
}
