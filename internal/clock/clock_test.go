package clock

import (
	"fmt"
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

// TestCoarseSleeps: a coarse clock nobody reads stops ticking after sleepAfter ticks (its reading
// stays as it was, marked stale, while the source moves on); the next Now reads the source
// exactly and wakes it, and it ticks on from there.
func TestCoarseSleeps(t *testing.T) {
	src := NewManual(1000)
	c := newCoarse(src, time.Millisecond)
	defer c.Close()
	waitFor(t, "the clock to sleep", func() bool { return c.now.Load()&stale != 0 })
	asleep := c.now.Load()
	src.Set(9000)
	time.Sleep(30 * time.Millisecond) // thirty ticks, were it ticking
	if n := c.now.Load(); n != asleep {
		t.Fatalf("the sleeping clock moved from %d to %d: it ticked", asleep, n)
	}
	if now := c.Now(); now != 9000 {
		t.Fatalf("Now() = %d on waking, want the source's 9000", now)
	}
	if n := c.now.Load(); n != 9000 {
		t.Fatalf("after waking the reading is %d, want 9000 unmarked", n)
	}
	src.Set(11000)
	waitFor(t, "the woken clock to tick to 11000", func() bool { return c.now.Load()&^stale == 11000 })
	if now := c.Now(); now != 11000 {
		t.Fatalf("Now() = %d, want 11000", now)
	}
}

// TestCoarseReaders: readers of a clock that sleeps and wakes all the time (they read in bursts)
// see readings that never go back and are never ahead of the source.
func TestCoarseReaders(t *testing.T) {
	src := NewManual(0)
	c := newCoarse(src, 100*time.Microsecond)
	defer c.Close()
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; i < 20000; i++ {
			src.Advance(2 * time.Microsecond)
			if i%1000 == 0 {
				time.Sleep(5 * time.Millisecond) // long enough for the clock to fall asleep
			}
		}
	}()
	errs := make(chan error, 4)
	for range 4 {
		go func() {
			var last Nanos
			for i := 0; ; i++ {
				select {
				case <-done:
					errs <- nil
					return
				default:
				}
				now := c.Now()
				if ahead := src.Now(); now > ahead {
					errs <- fmt.Errorf("Now() = %d is ahead of the source's %d", now, ahead)
					return
				}
				if now < last {
					errs <- fmt.Errorf("Now() = %d after %d: the reading went back", now, last)
					return
				}
				last = now
				if i%500 == 0 {
					time.Sleep(3 * time.Millisecond)
				}
			}
		}()
	}
	for range 4 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
}

// waitFor polls cond every millisecond for at most 5 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited 5 s for %s", what)
		}
		time.Sleep(time.Millisecond)
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
