package diffusionrouter

import (
	"os/exec"
	"strings"
	"testing"
)

// TestCoreIsFreeOfCaddy keeps the core under internal/ testable and
// buildable without Caddy: no package there may depend on Caddy, directly
// or through another, in its code or its tests, but the test harness,
// which runs Caddy.
func TestCoreIsFreeOfCaddy(t *testing.T) {
	pkgs, err := exec.Command("go", "list", "./internal/...").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	checked := 0
	for _, pkg := range strings.Fields(string(pkgs)) {
		if strings.Contains(pkg+"/", "/internal/testrouter/") {
			continue
		}
		deps, err := exec.Command("go", "list", "-deps", "-test", "-f", "{{.ImportPath}}", pkg).Output()
		if err != nil {
			t.Fatalf("go list %s: %v", pkg, err)
		}
		for _, dep := range strings.Fields(string(deps)) {
			if strings.HasPrefix(dep, "github.com/caddyserver/") {
				t.Errorf("%s depends on %s", pkg, dep)
				break
			}
		}
		checked++
	}
	if checked == 0 {
		t.Fatal("no package under internal/ was checked")
	}
}
