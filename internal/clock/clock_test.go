package clock

import (
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestManual(t *testing.T) {
	m := NewManual(5)
	if got := m.Now(); got != 5 {
		t.Fatalf("Now() = %d, want 5", got)
	}
	if got := m.Advance(time.Millisecond); got != 5+Nanos(time.Millisecond) {
		t.Fatalf("Advance(1ms) = %d", got)
	}
	m.Set(1) // backwards: tests of clock jumps need it
	if got := m.Now(); got != 1 {
		t.Fatalf("after Set(1): Now() = %d", got)
	}
}

// TestCoarseNeverAhead: a coarse reading is never later than the real clock's, advances, and
// Fresh publishes the real reading.
func TestCoarseNeverAhead(t *testing.T) {
	c := NewCoarse(time.Millisecond)
	defer c.Close()
	start := c.Now()
	deadline := time.Now().Add(5 * time.Second)
	for c.Now() == start {
		if time.Now().After(deadline) {
			t.Fatal("the coarse clock did not advance within 5 s")
		}
		time.Sleep(time.Millisecond)
	}
	for range 1000 {
		before := c.real.Now()
		coarse := c.Now()
		if coarse > c.real.Now() {
			t.Fatalf("coarse reading %d is ahead of the real clock (read %d before it)", coarse, before)
		}
	}
	f := c.Fresh()
	if now := c.Now(); now < f {
		t.Fatalf("after Fresh() = %d, Now() = %d went back", f, now)
	}
}

func TestCoarseCloseStops(t *testing.T) {
	c := NewCoarse(time.Millisecond)
	c.Close()
	c.Close() // idempotent
	n := c.Now()
	time.Sleep(5 * time.Millisecond)
	if c.Now() != n {
		t.Fatal("the coarse clock advanced after Close")
	}
}

func TestReal(t *testing.T) {
	r := NewReal()
	a := r.Now()
	time.Sleep(time.Millisecond)
	if b := r.Now(); b-a < Nanos(time.Millisecond) {
		t.Fatalf("Real advanced %v over a 1 ms sleep", (b - a).Duration())
	}
	if Of(time.Second).Duration() != time.Second {
		t.Fatal("Of and Duration do not round-trip")
	}
}
