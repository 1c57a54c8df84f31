// Package netns runs a test in a network namespace of its own, for tests
// that must dial addresses outside 127.0.0.0/8: those of workers a real
// Kubernetes API server names, which refuses loopback endpoints. The
// namespace has its loopback interface and nothing else, so nothing
// dialled there leaves the machine, and no process outside it ever
// reaches the addresses given to it.
package netns

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// insideEnv marks the test binary run inside the namespace.
const insideEnv = "DIFFUSION_ROUTER_IN_NETNS"

// Enter runs the calling test, a top-level one, in a network namespace of
// its own, with lo up and addrs (IPv4 addresses) on it. Outside the
// namespace it runs the test binary again, for this test alone, under
// `unshare -n` (as root) or `unshare -rn` (a user namespace where root is
// not at hand), reports what that run reports, and returns false: the
// caller returns. Inside it sets up lo and returns true: the caller runs
// the test. The run inside inherits the environment.
//
// Where neither unshare works, or ip is missing, the test is skipped,
// except under CI=true, where it fails.
func Enter(t *testing.T, addrs ...string) bool {
	t.Helper()
	if os.Getenv(insideEnv) != "" {
		setUp(t, addrs)
		return true
	}
	if strings.Contains(t.Name(), "/") {
		t.Fatalf("netns.Enter in subtest %s: only a top-level test runs again on its own", t.Name())
	}
	flags := unshareFlags(t)
	// -test.v, so that its output says when it skipped.
	args := append(flags, "--", os.Args[0], "-test.run", "^"+t.Name()+"$", "-test.count", "1", "-test.v")
	cmd := exec.CommandContext(t.Context(), "unshare", args...)
	cmd.Env = append(os.Environ(), insideEnv+"=1")
	out, err := cmd.CombinedOutput()
	switch {
	case err != nil:
		t.Fatalf("in the network namespace (unshare %s): %v\n%s", strings.Join(flags, " "), err, out)
	case strings.Contains(string(out), "--- SKIP: "+t.Name()):
		t.Skipf("skipped in the network namespace:\n%s", out)
	case testing.Verbose():
		t.Logf("in the network namespace (unshare %s):\n%s", strings.Join(flags, " "), out)
	}
	return false
}

// unshareFlags finds how this process may make a network namespace: as
// root, or in a user namespace of its own.
func unshareFlags(t *testing.T) []string {
	t.Helper()
	_, ipErr := exec.LookPath("ip")
	for _, flags := range [][]string{{"-n"}, {"-rn"}} {
		if ipErr == nil && exec.Command("unshare", append(flags, "true")...).Run() == nil {
			return flags
		}
	}
	why := "neither `unshare -n` nor `unshare -rn` works here (util-linux's unshare; as root, or with unprivileged user namespaces)"
	if ipErr != nil {
		why = "ip is not on the PATH (Debian: iproute2)"
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("no network namespace for the test: %s", why)
	}
	t.Skipf("no network namespace for the test: %s", why)
	return nil
}

// setUp brings lo up and gives it addrs, each as a /32.
func setUp(t *testing.T, addrs []string) {
	t.Helper()
	cmds := [][]string{{"link", "set", "lo", "up"}}
	for _, a := range addrs {
		cmds = append(cmds, []string{"addr", "add", a + "/32", "dev", "lo"})
	}
	for _, c := range cmds {
		if out, err := exec.Command("ip", c...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v\n%s", strings.Join(c, " "), err, out)
		}
	}
}
