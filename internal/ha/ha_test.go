package ha_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/miles-rollout/miles-diffusion-router/internal/ha"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/etcdtest"
)

const leaseTTL = 2 * time.Second

// takeover is the bound the issue sets for a standby to lead, made
// generous for a loaded test machine.
const takeover = leaseTTL + 5*time.Second

func campaign(t *testing.T, etcd *etcdtest.Server, identity string) (*ha.Role, context.CancelFunc) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	role, err := ha.Campaign(ctx, ha.Config{
		Endpoints: []string{etcd.Endpoint},
		KeyPrefix: "/diffusion-router",
		Pool:      "images",
		LeaseTTL:  leaseTTL,
		Identity:  identity,
	})
	if err != nil {
		t.Fatal(err)
	}
	return role, cancel
}

// leaderOf waits until exactly one of the roles leads and both name it.
func leaderOf(t *testing.T, a, b *ha.Role) (leader, standby *ha.Role) {
	t.Helper()
	settled := func() bool {
		return a.Leading() != b.Leading() && a.Leader() != "" && a.Leader() == b.Leader()
	}
	if !testkit.WaitUntil(takeover, settled) {
		t.Fatalf("no single leader: a leading=%v names %q, b leading=%v names %q",
			a.Leading(), a.Leader(), b.Leading(), b.Leader())
	}
	if a.Leading() {
		return a, b
	}
	return b, a
}

func TestOneRouterLeadsAndTheOtherNamesIt(t *testing.T) {
	etcd := etcdtest.Start(t)
	a, _ := campaign(t, etcd, "http://router-a:8080")
	b, _ := campaign(t, etcd, "http://router-b:8080")
	leader, standby := leaderOf(t, a, b)
	want := "http://router-a:8080"
	if leader == b {
		want = "http://router-b:8080"
	}
	if standby.Leader() != want {
		t.Fatalf("standby names %q as leader, want %q", standby.Leader(), want)
	}
}

func TestStandbyLeadsWhenTheLeaderStops(t *testing.T) {
	etcd := etcdtest.Start(t)
	a, stopA := campaign(t, etcd, "a")
	b, stopB := campaign(t, etcd, "b")
	leader, standby := leaderOf(t, a, b)
	stop := map[*ha.Role]context.CancelFunc{a: stopA, b: stopB}[leader]
	stop()
	if !testkit.WaitUntil(takeover, standby.Leading) {
		t.Fatalf("standby did not lead within %v of the leader stopping", takeover)
	}
	if !testkit.WaitUntil(takeover, func() bool { return !leader.Leading() }) {
		t.Fatal("the stopped router still says it leads")
	}
}

func TestEndedClosesOnceTheCampaignIsOver(t *testing.T) {
	etcd := etcdtest.Start(t)
	role, stop := campaign(t, etcd, "a")
	if !testkit.WaitUntil(takeover, role.Leading) {
		t.Fatal("a lone router did not lead")
	}
	select {
	case <-role.Ended():
		t.Fatal("Ended closed while the campaign runs")
	default:
	}
	stop()
	select {
	case <-role.Ended():
	case <-time.After(takeover):
		t.Fatalf("Ended not closed %v after the campaign's context ended", takeover)
	}
	if role.Leading() {
		t.Fatal("the router still says it leads after its campaign ended")
	}
}

func TestLeaderCutOffFromEtcdStopsLeading(t *testing.T) {
	etcd := etcdtest.Start(t)
	role, _ := campaign(t, etcd, "a")
	if !testkit.WaitUntil(takeover, role.Leading) {
		t.Fatal("a lone router did not lead")
	}
	etcd.Stop()
	if !testkit.WaitUntil(takeover, func() bool { return !role.Leading() }) {
		t.Fatalf("leader still leads %v after etcd stopped", takeover)
	}
}

func TestChangedFiresWhenTheRouterLeads(t *testing.T) {
	etcd := etcdtest.Start(t)
	role, _ := campaign(t, etcd, "a")
	select {
	case <-role.Changed():
	case <-time.After(takeover):
		t.Fatal("no change reported")
	}
	if !testkit.WaitUntil(takeover, role.Leading) {
		t.Fatal("a lone router did not lead")
	}
}

// TestStandbyLeadsWithinTheLeaseWhenTheLeaderIsKilled kills a leader that
// runs in another process, so that it cannot resign: the standby leads
// once the dead leader's lease runs out.
func TestStandbyLeadsWithinTheLeaseWhenTheLeaderIsKilled(t *testing.T) {
	etcd := etcdtest.Start(t)
	leader := exec.Command(os.Args[0], "-test.run=^TestHelperLeader$")
	leader.Env = append(os.Environ(), "HA_HELPER_ETCD="+etcd.Endpoint)
	out, err := leader.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := leader.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = leader.Process.Kill(); _ = leader.Wait() })
	if line, err := bufio.NewReader(out).ReadString('\n'); line != "leading\n" {
		t.Fatalf("helper said %q, %v; want it to lead", line, err)
	}
	standby, _ := campaign(t, etcd, "standby")
	if !testkit.WaitUntil(takeover, func() bool { return standby.Leader() == "killed" }) {
		t.Fatalf("the helper did not lead; the standby names %q", standby.Leader())
	}
	if err := leader.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if !testkit.WaitUntil(takeover, standby.Leading) {
		t.Fatalf("standby did not lead within %v of the leader being killed", takeover)
	}
	t.Logf("standby led %v after the kill (lease_ttl %v)", time.Since(start).Round(time.Millisecond), leaseTTL)
	if standby.Leader() != "standby" {
		t.Fatalf("standby names %q as leader after taking over", standby.Leader())
	}
}

// TestHelperLeader is the leader TestStandbyLeadsWithinTheLeaseWhenTheLeaderIsKilled
// kills; run alone, it does nothing.
func TestHelperLeader(t *testing.T) {
	endpoint := os.Getenv("HA_HELPER_ETCD")
	if endpoint == "" {
		t.Skip("runs only as a helper process")
	}
	role, err := ha.Campaign(context.Background(), ha.Config{
		Endpoints: []string{endpoint}, KeyPrefix: "/diffusion-router", Pool: "images",
		LeaseTTL: leaseTTL, Identity: "killed",
	})
	if err != nil || !testkit.WaitUntil(takeover, role.Leading) {
		t.Fatalf("helper did not lead: %v", err)
	}
	fmt.Println("leading")
	select {}
}
