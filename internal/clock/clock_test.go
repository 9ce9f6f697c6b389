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

// TestCoarseNeverAhead: the coarse clock advances by publishing its source's readings, never a
// later one, and Fresh publishes the source's reading at once. The source is a manual clock, so
// "ahead" is exact.
func TestCoarseNeverAhead(t *testing.T) {
	src := NewManual(1000)
	c := newCoarse(src, time.Millisecond)
	defer c.Close()
	if now := c.Now(); now != 1000 {
		t.Fatalf("Now() = %d at the start, want the source's 1000", now)
	}
	src.Set(5000)
	deadline := time.Now().Add(5 * time.Second)
	for {
		now := c.Now()
		if now > 5000 {
			t.Fatalf("Now() = %d is ahead of the source's 5000", now)
		}
		if now == 5000 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Now() = %d: the coarse clock did not reach its source's 5000 within 5 s", now)
		}
		time.Sleep(time.Millisecond)
	}
	src.Set(7000)
	if f, now := c.Fresh(), c.Now(); f != 7000 || now != 7000 {
		t.Fatalf("Fresh() = %d, then Now() = %d; want both the source's 7000", f, now)
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
