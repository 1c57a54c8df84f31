package ha_test

import (
	"context"
	"errors"
	"io/fs"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/miles-rollout/miles-diffusion-router/internal/ha"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit"
	"github.com/miles-rollout/miles-diffusion-router/internal/testkit/etcdtest"
)

const recordName = "diffusion_router/images/fleet.json"

// termOf waits until role leads and returns its term.
func termOf(t *testing.T, role *ha.Role) ha.Term {
	t.Helper()
	if !testkit.WaitUntil(takeover, role.Leading) {
		t.Fatal("the router did not lead")
	}
	term, ok := role.Term()
	if !ok {
		t.Fatal("a leading router has no term")
	}
	return term
}

func TestLeaderWritesTheRecordAndReadsItBack(t *testing.T) {
	etcd := etcdtest.Start(t)
	role, _ := campaign(t, etcd, "a")
	term := termOf(t, role)
	ctx := context.Background()
	if _, err := role.Load(ctx, recordName); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("loading a record never written: %v, want fs.ErrNotExist", err)
	}
	if err := role.Store(ctx, term, recordName, []byte(`{"workers":[]}`)); err != nil {
		t.Fatal(err)
	}
	got, err := role.Load(ctx, recordName)
	if err != nil || string(got) != `{"workers":[]}` {
		t.Fatalf("read back %q, %v", got, err)
	}
	if err := role.Store(ctx, ha.Term{}, recordName, []byte(`{}`)); !errors.Is(err, ha.ErrDeposed) {
		t.Fatalf("a write outside any term: %v, want ErrDeposed", err)
	}
}

// A leader whose key is gone (its lease lost while it still runs, here
// deleted from outside) is deposed: its writes fail even before it
// notices, and its successor's stand.
func TestDeposedLeaderWritesNothing(t *testing.T) {
	etcd := etcdtest.Start(t)
	a, _ := campaign(t, etcd, "a")
	oldTerm := termOf(t, a)
	ctx := context.Background()
	if err := a.Store(ctx, oldTerm, recordName, []byte("from a")); err != nil {
		t.Fatal(err)
	}
	b, _ := campaign(t, etcd, "b")
	if !testkit.WaitUntil(takeover, func() bool { return b.Leader() == "a" }) {
		t.Fatalf("b names %q as leader, want a", b.Leader())
	}
	client, err := clientv3.New(clientv3.Config{Endpoints: []string{etcd.Endpoint}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	resp, err := client.Get(ctx, "/diffusion-router/election/", clientv3.WithFirstCreate()...)
	if err != nil || len(resp.Kvs) == 0 {
		t.Fatalf("no election key: %v", err)
	}
	if _, err := client.Delete(ctx, string(resp.Kvs[0].Key)); err != nil {
		t.Fatal(err)
	}
	newTerm := termOf(t, b)
	if err := a.Store(ctx, oldTerm, recordName, []byte("from deposed a")); !errors.Is(err, ha.ErrDeposed) {
		t.Fatalf("the deposed leader's write: %v, want ErrDeposed", err)
	}
	if err := b.Store(ctx, newTerm, recordName, []byte("from b")); err != nil {
		t.Fatalf("the new leader's write: %v", err)
	}
	if got, _ := a.Load(ctx, recordName); string(got) != "from b" {
		t.Fatalf("record reads %q, want the new leader's", got)
	}
}

func TestStandbyWatchesTheLeadersWrites(t *testing.T) {
	etcd := etcdtest.Start(t)
	a, _ := campaign(t, etcd, "a")
	b, _ := campaign(t, etcd, "b")
	leader, standby := leaderOf(t, a, b)
	term := termOf(t, leader)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := leader.Store(ctx, term, recordName, []byte("1")); err != nil {
		t.Fatal(err)
	}
	seen := standby.Watch(ctx, recordName)
	next := func() string {
		select {
		case v := <-seen:
			return string(v)
		case <-time.After(takeover):
			t.Fatal("the standby saw no record")
			return ""
		}
	}
	if got := next(); got != "1" {
		t.Fatalf("the watch began with %q, want the record as it was, 1", got)
	}
	for _, v := range []string{"2", "3"} {
		if err := leader.Store(ctx, term, recordName, []byte(v)); err != nil {
			t.Fatal(err)
		}
		if got := next(); got != v {
			t.Fatalf("the standby saw %q, want %q", got, v)
		}
	}
}
