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
// which runs Caddy. It also keeps etcd inside internal/ha, and the
// Kubernetes client inside internal/kubediscovery (and the stand-in API
// server tests use), which only the root package imports, so that the
// scheduler and a router without `ha etcd` or `workers_kubernetes` carry
// no code path of theirs.
func TestCoreIsFreeOfCaddy(t *testing.T) {
	// One go list for every package, its tests and their dependencies:
	// a line per package, test package and test binary.
	out, err := goList("-test", "-f", `{{.ImportPath}}: {{join .Deps " "}}`, "./internal/...")
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	checked := 0
	for line := range strings.Lines(string(out)) {
		name, deps, _ := strings.Cut(line, ": ")
		pkg := corePackage(name)
		if strings.HasSuffix(pkg, "/internal/testrouter") {
			continue
		}
		for dep := range strings.FieldsSeq(deps) {
			if strings.HasPrefix(dep, "github.com/caddyserver/") || !isHA(pkg) && reachesEtcd(dep) || !isKube(pkg) && reachesKube(dep) {
				t.Errorf("%s depends on %s", name, dep)
				break
			}
		}
		checked++
	}
	if checked == 0 {
		t.Fatal("no package under internal/ was checked")
	}
}

// corePackage is the package a line of go list -test names: itself, or
// the package whose test package or test binary it is.
func corePackage(name string) string {
	pkg, _, _ := strings.Cut(name, " ") // "p [p.test]": p as its tests build it
	pkg = strings.TrimSuffix(pkg, ".test")
	return strings.TrimSuffix(pkg, "_test")
}

// startEnv is the environment the test binary started with, before its
// TestMain moved HOME, through which the go command finds its module cache.
var startEnv = os.Environ()

// goList runs go list with args.
func goList(args ...string) ([]byte, error) {
	cmd := exec.Command("go", append([]string{"list"}, args...)...)
	cmd.Env = startEnv
	return cmd.Output()
}

const haPkg = "github.com/miles-rollout/miles-diffusion-router/internal/ha"

func isHA(pkg string) bool { return pkg == haPkg }

const kubePkg = "github.com/miles-rollout/miles-diffusion-router/internal/kubediscovery"

func isKube(pkg string) bool {
	return pkg == kubePkg || strings.HasSuffix(pkg, "/internal/testkit/kubeapi")
}

func reachesKube(dep string) bool {
	return strings.HasPrefix(dep, "k8s.io/") || dep == kubePkg
}

func reachesEtcd(dep string) bool {
	return strings.HasPrefix(dep, "go.etcd.io/etcd/") || dep == haPkg
}

// TestNothingImportsTheExamples keeps examples/ what a user copies: code
// the router, its tests or its tools need lives under internal/ or cmd/.
func TestNothingImportsTheExamples(t *testing.T) {
	out, err := goList("-f", `{{.ImportPath}}: {{join .Imports " "}} {{join .TestImports " "}} {{join .XTestImports " "}}`, "./...")
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
