package request

import (
	"net/http"
	"net/url"
	"slices"
	"testing"
)

func match(t *testing.T, tbl Table, method, target string) Route {
	t.Helper()
	u, err := url.ParseRequestURI(target)
	if err != nil {
		t.Fatal(err)
	}
	return tbl.Match(method, u)
}

func TestEveryPathFindsItsRow(t *testing.T) {
	for _, tc := range []struct {
		method, target string
		kind           Kind
		class          string
		job, poll      bool
		jobID          string
	}{
		{"POST", "/v1/images/generations", Image, "images", true, false, ""},
		{"GET", "/v1/images/generations", Image, "images", false, false, ""},
		{"POST", "/v1/images/edits", Image, "image_edits", true, false, ""},
		{"POST", "/v1/images/generations/stream", ImageStream, "image_stream", true, false, ""},
		{"POST", "/v1/videos", Video, "videos", true, false, ""},
		{"GET", "/v1/videos", Video, "videos", false, false, ""},
		{"GET", "/v1/videos?video_id=v1", Video, "videos", false, true, "v1"},
		{"GET", "/v1/videos?video_id=", Video, "videos", false, true, ""},
		{"POST", "/v1/diffusion/generate", Rollout, "diffusion", true, false, ""},
		{"POST", "/rollout/generate", Rollout, "rollout", true, false, ""},
		{"GET", "/v1/videos/v1", VideoPoll, "video_job", false, true, "v1"},
		{"GET", "/v1/videos/v1/content", VideoPoll, "video_job", false, true, "v1"},
		{"DELETE", "/v1/videos/v1", VideoPoll, "video_job", false, true, "v1"},
		{"GET", "/v1/videos/v1/other", Forwarded, "other", false, false, ""},
		{"GET", "/v1/images/abc-1/content", ImagePoll, "image_job", false, true, "abc-1"},
		{"DELETE", "/v1/images/abc-1", ImagePoll, "image_job", false, true, "abc-1"},
		{"GET", "/v1/models", Forwarded, "other", false, false, ""},
		{"POST", "/health_generate", Forwarded, "other", false, false, ""},
	} {
		r := match(t, Endpoints, tc.method, tc.target)
		if r.Kind != tc.kind || r.Class != tc.class || r.Job(tc.method) != tc.job || r.Poll != tc.poll || r.JobID != tc.jobID || r.Err != nil {
			t.Errorf("%s %s: kind %d class %s job %v poll %v id %q err %v; want kind %d class %s job %v poll %v id %q",
				tc.method, tc.target, r.Kind, r.Class, r.Job(tc.method), r.Poll, r.JobID, r.Err, tc.kind, tc.class, tc.job, tc.poll, tc.jobID)
		}
	}
}

func TestBadImageJobPathsAreRefused(t *testing.T) {
	for _, target := range []string{"/v1/images/a%2Fb", "/v1/images/abc/other", "/v1/images/", "/v1/images/generations/stream/x"} {
		if r := match(t, Endpoints, "GET", target); r.Kind != ImagePoll || r.Err == nil {
			t.Errorf("GET %s: kind %d, err %v; want an image poll refused", target, r.Kind, r.Err)
		}
	}
}

func TestOnlyVideosRunAgainOnlyUnanswered(t *testing.T) {
	for _, e := range Endpoints {
		if want := e.Kind == Video; (e.Rerun == RerunUnsent) != want {
			t.Errorf("%s: rerun %d", e.Path, e.Rerun)
		}
		if e.Hedged && (e.Stream || e.Kind == Video) {
			t.Errorf("%s: a stream or a video is hedged", e.Path)
		}
	}
}

// A new generation endpoint is one row and its cost rule: the router then
// costs, queues, re-runs and labels it like the others.
func TestANewEndpointIsOneRow(t *testing.T) {
	audio := func(m Model, f Fields) (float64, error) {
		seconds, err := f.positiveInt("seconds", 10)
		return seconds / 10, err
	}
	tbl := append(Table{{Path: "/v1/audio/generations", Kind: Rollout, Class: "audio", Cost: audio, Serves: AnyTask, Hedged: true}}, Endpoints...)
	r := match(t, tbl, http.MethodPost, "/v1/audio/generations")
	if r.Class != "audio" || !r.Job(http.MethodPost) || !r.Hedged || r.Rerun != RerunUntilSent {
		t.Fatalf("new row matched as %+v", r.Endpoint)
	}
	f, err := ReadFields([]byte(`{"prompt":"rain","seconds":30}`), "application/json")
	if err != nil {
		t.Fatal(err)
	}
	if c, err := r.Cost(testCosts, f); err != nil || c != 3 {
		t.Fatalf("cost %v, %v; want 3", c, err)
	}
	if match(t, Endpoints, http.MethodPost, "/v1/audio/generations").Class != "other" {
		t.Fatal("the row is not the table's own")
	}
}

// forward_paths sglang is the table's paths: a worker path is one row, and
// a plain one is forwarded as a path without a row is.
func TestTheTableIsEveryPathOfTheWorker(t *testing.T) {
	paths := Endpoints.Paths()
	for _, want := range []string{"/v1/images/generations", "/v1/videos/*", "/v1/images/*", "/rollout/generate", "/v1/set_lora", "/health"} {
		if !slices.Contains(paths, want) {
			t.Errorf("Paths() lacks %s: %v", want, paths)
		}
	}
	if r := match(t, Endpoints, http.MethodPost, "/v1/set_lora"); r.Kind != Forwarded || r.Class != "other" || r.Job(http.MethodPost) {
		t.Errorf("/v1/set_lora matched as %+v; want forwarded, class other", r.Endpoint)
	}
}
