package diffusionrouter_test

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// tenantClient sends requests to r as tenant ("" sends no X-Tenant).
type tenantClient struct {
	t      *testing.T
	r      *testrouter.Router
	tenant string
}

func (c tenantClient) do(method, path, body string) testrouter.Reply {
	c.t.Helper()
	var header []string
	if c.tenant != "" {
		header = []string{"X-Tenant", c.tenant}
	}
	if body == "" {
		return testrouter.Do(c.t, method, c.r.Base+path, nil, header...)
	}
	return testrouter.Do(c.t, method, c.r.Base+path, strings.NewReader(body), header...)
}

// makeVideo makes a video job as c's tenant and waits until it completed.
func (c tenantClient) makeVideo() string {
	c.t.Helper()
	rp := c.do("POST", "/v1/videos", `{"prompt":"a dog","size":"64x64","num_frames":2,"num_inference_steps":2}`)
	testrouter.ExpectStatus(c.t, c.tenant+" makes a video", rp, 200)
	id := rp.JSON(c.t)["id"].(string)
	deadline := time.Now().Add(30 * time.Second)
	for c.do("GET", "/v1/videos/"+id, "").JSON(c.t)["status"] != "completed" {
		if time.Now().After(deadline) {
			c.t.Fatalf("%s's video %s never completed", c.tenant, id)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return id
}

// listed is the ids of the video list c's tenant gets at path.
func (c tenantClient) listed(path string) []string {
	c.t.Helper()
	rp := c.do("GET", path, "")
	testrouter.ExpectStatus(c.t, c.tenant+" lists videos", rp, 200)
	var ids []string
	for _, job := range rp.JSON(c.t)["data"].([]any) {
		ids = append(ids, job.(map[string]any)["id"].(string))
	}
	slices.Sort(ids)
	return ids
}

// expectUnknown checks that c's tenant gets the 404 of an unknown id.
func (c tenantClient) expectUnknown(method, path, msg string) {
	c.t.Helper()
	rp := c.do(method, path, "")
	testrouter.ExpectStatus(c.t, c.tenant+": "+method+" "+path, rp, 404)
	if got := rp.ErrorText(c.t); got != msg {
		c.t.Fatalf("%s: %s %s answered %q; want %q, as for an id never made", c.tenant, method, path, got, msg)
	}
}

func TestAVideoJobIsItsTenantsOnly(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "vid", TaskType: "T2V"})
	r := testrouter.Start(t, tenantSite(ws, ""))
	teamA, teamB, mallory, anonymous := tenantClient{t, r, "team-a"}, tenantClient{t, r, "team-b"}, tenantClient{t, r, "mallory"}, tenantClient{t, r, ""}
	a, b, none := teamA.makeVideo(), teamB.makeVideo(), anonymous.makeVideo()

	for _, path := range []string{"/v1/videos", "/v1/videos?order=asc", "/v1/videos?video_id=" + a} {
		if ids := teamA.listed(path); !slices.Equal(ids, []string{a}) {
			t.Errorf("team-a's list at %s: %v; want its own video %s only", path, ids, a)
		}
	}
	if ids := mallory.listed("/v1/videos"); len(ids) != 0 {
		t.Errorf("mallory's list: %v; want none of the others' videos", ids)
	}
	if ids := anonymous.listed("/v1/videos"); !slices.Equal(ids, []string{none}) {
		t.Errorf("the list of a client naming no tenant: %v; want the one video made without a tenant, %s", ids, none)
	}
	for _, c := range []tenantClient{mallory, teamB, anonymous} {
		c.expectUnknown("GET", "/v1/videos/"+a, "Unknown video_id")
		c.expectUnknown("GET", "/v1/videos/"+a+"/content", "Unknown video_id")
		c.expectUnknown("GET", "/v1/videos?video_id="+a, "Unknown video_id")
		c.expectUnknown("DELETE", "/v1/videos/"+a, "Unknown video_id")
	}
	rp := mallory.do("GET", "/v1/videos?limit=0", "")
	testrouter.ExpectStatus(t, "a list the worker refuses", rp, 422) // passes through as the worker wrote it

	testrouter.ExpectStatus(t, "team-a's video content", teamA.do("GET", "/v1/videos/"+a+"/content", ""), 200)
	testrouter.ExpectStatus(t, "team-a deletes its video", teamA.do("DELETE", "/v1/videos/"+a, ""), 200)
	if ids := teamB.listed("/v1/videos"); !slices.Equal(ids, []string{b}) {
		t.Errorf("team-b's list: %v; want its video %s, which nobody else could delete", ids, b)
	}
	onWorker := testrouter.Do(t, "GET", ws[0].URL()+"/v1/videos", nil).JSON(t)["data"].([]any)
	if len(onWorker) != 2 {
		t.Errorf("the worker holds %d videos; want team-b's and the anonymous one", len(onWorker))
	}
}

func TestAnImageJobIsItsTenantsOnly(t *testing.T) {
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "img"})
	r := testrouter.Start(t, tenantSite(ws, ""))
	teamA, mallory := tenantClient{t, r, "team-a"}, tenantClient{t, r, "mallory"}
	rp := teamA.do("POST", "/v1/images/generations", testrouter.SmallImage)
	testrouter.ExpectStatus(t, "team-a makes an image", rp, 200)
	id := rp.JSON(t)["id"].(string)

	mallory.expectUnknown("GET", "/v1/images/"+id+"/content", "Unknown image_id")
	mallory.expectUnknown("DELETE", "/v1/images/"+id, "Unknown image_id")
	testrouter.ExpectStatus(t, "team-a's image content", teamA.do("GET", "/v1/images/"+id+"/content", ""), 200)
	testrouter.ExpectStatus(t, "team-a deletes its image", teamA.do("DELETE", "/v1/images/"+id, ""), 200)
}
