package diffusionrouter

import "testing"

func TestPoolSharedAcrossLoadsAndReleased(t *testing.T) {
	a, err := loadPool("shared-test")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := loadPool("shared-test")
	if a != b {
		t.Fatal("two loads of one pool name gave different pools")
	}
	a.sched.Register("http://a:1", 10)
	releasePool("shared-test")
	c, _ := loadPool("shared-test")
	if c != a || len(c.Snapshot()) != 1 {
		t.Fatal("pool did not survive while still referenced")
	}
	releasePool("shared-test")
	releasePool("shared-test")
	d, _ := loadPool("shared-test")
	defer releasePool("shared-test")
	if d == a || len(d.Snapshot()) != 0 {
		t.Fatal("a pool no config uses was not released")
	}
}
