package diffusionrouter_test

import (
	"encoding/json"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/fakeworker"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/memstore"
	"github.com/miles-rollout/miles-diffusion-router/internal/testrouter"
)

// fleetKey is where the default pool keeps its fleet record, as
// TestFleetKeyStaysInItsFolder pins it.
const fleetKey = "diffusion_router/default/fleet.json"

// A write that fails is retried in the background, with the state as it
// is by then; generations meanwhile are answered at once, whatever storage
// does, and a write that hangs holds up the others for storeTimeout at
// most.
func TestFleetRecordWriteRetriedWithoutBlockingRequests(t *testing.T) {
	store := memstore.New()
	storing, release := store.GateNextStore()
	ws := testrouter.StartWorkers(t, fakeworker.Config{Name: "a"}, fakeworker.Config{Name: "b"}, fakeworker.Config{Name: "c"})
	r := testrouter.StartWith(t, testrouter.UseStorage(store), "diffusion_router {\n workers "+ws[0].URL()+"\n}")
	// Registered after the router's, so it runs first: a test that fails
	// with the write held would otherwise wait for it when Caddy stops.
	t.Cleanup(release)

	select { // the first write of the pool hangs in storage
	case <-storing:
	case <-time.After(30 * time.Second):
		t.Fatal("the pool wrote nothing within 30 s of starting")
	}
	testrouter.ExpectStatus(t, "add_worker", r.Post("/add_worker?url="+ws[1].URL(), ""), 200)
	testrouter.ExpectStatus(t, "POST /workers", r.Post("/workers", `{"url":"`+ws[2].URL()+`"}`), 200)
	testrouter.ExpectStatus(t, "hold back", testrouter.Do(t, "PUT", r.Base+"/workers/"+url.QueryEscape(ws[2].URL()), strings.NewReader(`{"is_dead":true}`)), 200)
	testrouter.ExpectStatus(t, "generation", r.Post("/v1/images/generations", testrouter.SmallImage), 200)
	release() // the hung write fails

	want := []testrouter.StoredWorker{{URL: ws[0].URL()}, {URL: ws[1].URL(), Registered: true}, {URL: ws[2].URL(), Registered: true, IsDead: true}}
	var data []byte
	if !testkit.WaitUntil(30*time.Second, func() bool {
		var ok bool
		data, ok = store.Value(fleetKey)
		return ok
	}) {
		t.Fatal("the failed write was not retried within 30 s")
	}
	var rec struct{ Workers []testrouter.StoredWorker }
	if err := json.Unmarshal(data, &rec); err != nil {
		t.Fatalf("stored record is not JSON: %v", err)
	}
	for i := range rec.Workers {
		rec.Workers[i].WeightVersion = "" // the model id, known once a probe answered
	}
	if !slices.Equal(rec.Workers, want) {
		t.Fatalf("stored workers %+v; want %+v", rec.Workers, want)
	}
}
