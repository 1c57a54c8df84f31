package attempt

import (
	"net/http"
	"testing"
)

// redirects is a worker that answers 307 to location, as uvicorn
// redirects a path to its twin with or without a trailing slash.
func redirects(location string) worker {
	return func(w http.ResponseWriter, _ *http.Request) error {
		w.Header().Set("Location", location)
		w.Header().Set("Server", "uvicorn")
		w.WriteHeader(http.StatusTemporaryRedirect)
		return nil
	}
}

// A worker's redirect that names a worker of the pool, the one that
// answered or another, reaches the client as a path on the router; any
// other Location, and the other headers, pass as they came.
func TestARedirectToAWorkerBecomesAPath(t *testing.T) {
	f := newFleet(t, 2)
	for _, c := range []struct{ location, want string }{
		{"http://10.0.0.1:30000/v1/set_lora", "/v1/set_lora"},
		{"http://10.0.0.2:30000/v1/images/generations?x=1", "/v1/images/generations?x=1"},
		{"https://10.0.0.2:30000", "/"},
		{"//10.0.0.1:30000/health", "/health"},
		{"http://10.0.0.9:30000/v1/set_lora", "http://10.0.0.9:30000/v1/set_lora"},
		{"https://auth.example.com/login", "https://auth.example.com/login"},
		{"/v1/set_lora", "/v1/set_lora"},
	} {
		j := f.job("redirect")
		f.serve(j.t.ServedBy(), redirects(c.location))
		if err := f.runJob(j); err != nil {
			t.Fatal(err)
		}
		got := j.client.Result()
		if got.StatusCode != http.StatusTemporaryRedirect || got.Header.Get("Location") != c.want || got.Header.Get("Server") != "uvicorn" {
			t.Errorf("Location %s: the client got %d, Location %q, Server %q; want 307, %q, uvicorn",
				c.location, got.StatusCode, got.Header.Get("Location"), got.Header.Get("Server"), c.want)
		}
	}
	f.expectIdle()
}
