package diffusionrouter

import (
	"os"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
)

// TestMilesExampleAdapts keeps examples/miles/Caddyfile a config Caddy
// takes: it adapts and provisions.
func TestMilesExampleAdapts(t *testing.T) {
	cf, err := os.ReadFile("examples/miles/Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	raw, _, err := caddyconfig.GetAdapter("caddyfile").Adapt(cf, map[string]any{"filename": "examples/miles/Caddyfile"})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"trusted_proxies":{"ranges":["192.168.0.0/16"`, `"admin":{"allow":["private_ranges"]}`, `"forward_paths":["sglang"]`} {
		if !strings.Contains(string(raw), want) {
			t.Errorf("adapted example lacks %s:\n%s", want, raw)
		}
	}
	if err := caddy.Validate(mustConfig(t, raw)); err != nil {
		t.Fatalf("the example does not provision: %v", err)
	}
}

func TestTensorUpdateIsRefused(t *testing.T) {
	r := startRouter(t, "diffusion_router\n")
	rp := r.post("/update_weights_from_tensor", `{"serialized_named_tensors":["x"]}`)
	expectStatus(t, "update_weights_from_tensor through the router", rp, 400)
	if !strings.Contains(rp.errorText(t), "each engine") {
		t.Fatalf("error %q does not say where to send it", rp.errorText(t))
	}
}
