package clock

import (
	"slices"
	"testing"
	"time"
)

var epoch = time.Unix(1_000_000, 0)

// Timers fire in the order they are due, those due at one instant in the
// order they were set, each with the clock reading its time.
func TestVirtualFiresInOrder(t *testing.T) {
	v := NewVirtual(epoch)
	var fired []string
	at := func(name string) func() {
		return func() { fired = append(fired, name+"@"+v.Now().Sub(epoch).String()) }
	}
	v.AfterFunc(2*time.Second, at("b"))
	v.AfterFunc(time.Second, at("a"))
	v.AfterFunc(2*time.Second, at("c"))
	for v.Step() {
	}
	if want := []string{"a@1s", "b@2s", "c@2s"}; !slices.Equal(fired, want) {
		t.Fatalf("fired %v; want %v", fired, want)
	}
}

// A stopped timer never fires; a reset one fires at its new time, once;
// a timer's function may set another, which fires in the same run.
func TestVirtualStopResetAndChains(t *testing.T) {
	v := NewVirtual(epoch)
	var fired []string
	stopped := v.AfterFunc(time.Second, func() { fired = append(fired, "stopped") })
	moved := v.AfterFunc(time.Second, func() { fired = append(fired, "moved@"+v.Now().Sub(epoch).String()) })
	v.AfterFunc(2*time.Second, func() {
		v.AfterFunc(time.Second, func() { fired = append(fired, "chained@"+v.Now().Sub(epoch).String()) })
	})
	if !stopped.Stop() || stopped.Stop() {
		t.Fatal("Stop reports pending only the first time")
	}
	if !moved.Reset(5 * time.Second) {
		t.Fatal("Reset of a pending timer reports it pending")
	}
	for v.Step() {
	}
	if want := []string{"chained@3s", "moved@5s"}; !slices.Equal(fired, want) {
		t.Fatalf("fired %v; want %v", fired, want)
	}
	if moved.Reset(time.Second) {
		t.Fatal("Reset of a fired timer reports it pending")
	}
	if v.Pending() != 1 {
		t.Fatalf("%d timers pending after a fired one was reset; want 1", v.Pending())
	}
}

// Advance runs the timers due within it and leaves the clock at its end.
func TestVirtualAdvance(t *testing.T) {
	v := NewVirtual(epoch)
	n := 0
	v.AfterFunc(time.Second, func() { n++ })
	v.AfterFunc(3*time.Second, func() { n++ })
	v.Advance(2 * time.Second)
	if n != 1 || !v.Now().Equal(epoch.Add(2*time.Second)) || v.Pending() != 1 {
		t.Fatalf("after Advance(2s): %d fired, clock at %s, %d pending; want 1, 2s, 1", n, v.Now().Sub(epoch), v.Pending())
	}
}
