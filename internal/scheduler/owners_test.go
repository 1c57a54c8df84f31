package scheduler

import (
	"fmt"
	"testing"
	"time"
)

func TestJobOwnersRememberAndExpire(t *testing.T) {
	now := time.Unix(1000, 0)
	v := NewJobOwners(10, time.Hour)
	v.now = func() time.Time { return now }

	v.Remember("vid-1", "http://a:1", "")
	if w, ok := v.Worker("vid-1", ""); !ok || w != "http://a:1" {
		t.Fatalf("worker(vid-1) = %q, %v", w, ok)
	}
	if _, ok := v.Worker("vid-unknown", ""); ok {
		t.Fatal("unknown id found")
	}
	now = now.Add(time.Hour)
	if _, ok := v.Worker("vid-1", ""); ok {
		t.Fatal("expired job still mapped")
	}
}

func TestJobOwnersBounded(t *testing.T) {
	v := NewJobOwners(3, time.Hour)
	for i := range 5 {
		v.Remember(fmt.Sprintf("vid-%d", i), "http://a:1", "")
	}
	for i, want := range []bool{false, false, true, true, true} {
		if _, ok := v.Worker(fmt.Sprintf("vid-%d", i), ""); ok != want {
			t.Fatalf("vid-%d known=%v; want %v (the oldest go first)", i, ok, want)
		}
	}
	if v.next-v.oldest != 3 || len(v.byID) != 3 {
		t.Fatalf("holds %d/%d entries; limit is 3", v.next-v.oldest, len(v.byID))
	}
}

func TestJobOwnersForget(t *testing.T) {
	v := NewJobOwners(10, time.Hour)
	v.Remember("vid-a", "http://a:1", "")
	v.Remember("vid-b", "http://b:1", "")
	v.Remember("vid-c", "http://a:1", "")
	v.ForgetWorker("http://a:1")
	v.Forget("vid-b")
	for _, id := range []string{"vid-a", "vid-b", "vid-c"} {
		if _, ok := v.Worker(id, ""); ok {
			t.Fatalf("%s still mapped", id)
		}
	}
}

func TestJobOwnersRememberedAgainAndForgottenAcrossTheRing(t *testing.T) {
	v := NewJobOwners(3, time.Hour)
	// a again: its old place is the first dropped, then d pushes b out.
	for _, id := range []string{"a", "b", "c", "a", "d"} {
		v.Remember(id, "http://w-"+id+":1", "")
	}
	v.Forget("c")
	v.Remember("e", "http://w-e:1", "") // into c's place, now the oldest
	for id, want := range map[string]bool{"a": true, "b": false, "c": false, "d": true, "e": true} {
		w, ok := v.Worker(id, "")
		if ok != want || ok && w != "http://w-"+id+":1" {
			t.Errorf("worker(%s) = %q, %v; want known=%v", id, w, ok, want)
		}
	}
	if len(v.byID) != 3 {
		t.Fatalf("%d ids mapped, want 3", len(v.byID))
	}
}

func TestAJobIsKnownOnlyToItsTenant(t *testing.T) {
	v := NewJobOwners(10, time.Hour)
	v.Remember("vid-a", "http://a:1", "team-a")
	v.Remember("vid-none", "http://a:1", "")
	for _, c := range []struct {
		id, tenant string
		known      bool
	}{
		{"vid-a", "team-a", true},
		{"vid-a", "mallory", false},
		{"vid-a", "", false},
		{"vid-none", "", true},
		{"vid-none", OtherTenant, true}, // the tenant of jobs that name none
		{"vid-none", "team-a", false},
	} {
		w, ok := v.Worker(c.id, c.tenant)
		if ok != c.known || ok && w != "http://a:1" {
			t.Errorf("worker(%s) for tenant %q = %q, %v; want known=%v", c.id, c.tenant, w, ok, c.known)
		}
	}
}
