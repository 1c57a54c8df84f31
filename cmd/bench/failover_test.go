package main

import (
	"context"
	"strings"
	"testing"

	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/etcdtest"
)

func TestParseFailoverFlags(t *testing.T) {
	o, err := parseFlags([]string{"--mode", "failover"})
	if err != nil || o.kills != 10 || o.leaseTTL.Seconds() != 5 {
		t.Fatalf("defaults: kills %d, lease %s, %v; want 10 kills at 5s", o.kills, o.leaseTTL, err)
	}
	for _, bad := range [][]string{
		{"--mode", "failover", "--kills", "0"},
		{"--mode", "failover", "--lease-ttl", "1500ms"},
		{"--mode", "failover", "--lease-ttl", "0s"},
		{"--mode", "failover", "--router", "http://x:1"},
	} {
		if _, err := parseFlags(bad); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
}

// TestFailoverRound runs the failover mode for one kill: the standby
// takes over and the clients lose nothing. It builds Caddy and runs two
// routers and a proxy as processes, and a real etcd.
func TestFailoverRound(t *testing.T) {
	if testing.Short() {
		t.Skip("builds Caddy and runs three processes and etcd, about 10 s")
	}
	etcdtest.Require(t)
	o := testOptions(t, "--mode", "failover", "--kills", "1", "--lease-ttl", "2s", "--clients", "3", "--speeds", "1,1")
	var out strings.Builder
	if err := benchFailover(context.Background(), o, &out); err != nil {
		t.Fatal(err)
	}
	t.Log(out.String())
	if !strings.Contains(out.String(), " 0 lost") || !strings.Contains(out.String(), "time to take over") {
		t.Fatalf("the report says something was lost, or no takeover:\n%s", out.String())
	}
}
