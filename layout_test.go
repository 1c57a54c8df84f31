package diffusionrouter

import (
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestCoreIsFreeOfCaddy keeps the core under internal/ testable and
// buildable without Caddy: no package there may depend on Caddy, directly
// or through another, in its code or its tests, but the test harness,
// which runs Caddy. It also keeps etcd inside internal/ha, which only the
// root package imports, so that the scheduler and a router without
// `ha etcd` carry no etcd code path.
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
			if strings.HasPrefix(dep, "github.com/caddyserver/") || !isHA(pkg) && reachesEtcd(dep) {
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

const haPkg = "github.com/miles-rollout/miles-diffusion-router/internal/ha"

func isHA(pkg string) bool { return pkg == haPkg }

func reachesEtcd(dep string) bool {
	return strings.HasPrefix(dep, "go.etcd.io/etcd/") || dep == haPkg
}

// TestNothingImportsTheExamples keeps examples/ what a user copies: code
// the router, its tests or its tools need lives under internal/ or cmd/.
func TestNothingImportsTheExamples(t *testing.T) {
	out, err := exec.Command("go", "list", "-f", `{{.ImportPath}}: {{join .Imports " "}} {{join .TestImports " "}} {{join .XTestImports " "}}`, "./...").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	for line := range strings.Lines(string(out)) {
		pkg, imports, _ := strings.Cut(line, ": ")
		if !strings.Contains(pkg, "/examples/") && strings.Contains(imports, "miles-diffusion-router/examples/") {
			t.Errorf("%s imports from examples/: %s", pkg, strings.TrimSpace(imports))
		}
	}
}

// TestOnlyThePoolsMakerNamesIt keeps the packages around the scheduler on
// the narrow views of the pool they declare (control.Pool, fleet.Operated,
// fleet.Recorded), which a test can fake: outside internal/scheduler, only
// poolref.go, where the pool is made and handed out, names its type.
func TestOnlyThePoolsMakerNamesIt(t *testing.T) {
	named := regexp.MustCompile(`\bscheduler\.Pool\b`)
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		switch {
		case err != nil:
			return err
		case d.IsDir() && (path == filepath.Join("internal", "scheduler") || strings.HasPrefix(d.Name(), ".")) && path != ".":
			return filepath.SkipDir
		case d.IsDir(), !strings.HasSuffix(path, ".go"), strings.HasSuffix(path, "_test.go"), path == "poolref.go":
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if loc := named.FindIndex(src); loc != nil {
			t.Errorf("%s names scheduler.Pool (line %d); take the view of the pool it needs", path, 1+strings.Count(string(src[:loc[0]]), "\n"))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
