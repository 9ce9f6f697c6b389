// Package clock is the injected time source of leasebucket. Cores take time as a parameter; the
// shells around them read it from a Clock: Real in servers, Coarse on the agent's hot path,
// Manual in tests and the simulator.
package clock

import (
	"sync"
	"sync/atomic"
	"time"
)

// Nanos is a monotonic time in nanoseconds since the clock's origin (or a duration).
// It is not wall time and is never compared across processes.
type Nanos int64

// Duration converts to a time.Duration.
func (n Nanos) Duration() time.Duration { return time.Duration(n) }

// Of converts a time.Duration.
func Of(d time.Duration) Nanos { return Nanos(d) }

// Clock reads monotonic time.
type Clock interface {
	Now() Nanos
}

// Real reads the process's monotonic clock.
type Real struct{ origin time.Time }

// NewReal returns a clock whose origin is now.
func NewReal() *Real { return &Real{origin: time.Now()} }

// Now implements Clock.
func (r *Real) Now() Nanos { return Nanos(time.Since(r.origin)) }

// Coarse is a clock read from an atomic that a goroutine advances every tick. Reading it costs an
// atomic load instead of a clock call (time.Now is about 60 ns on the virtual machines we measured,
// time.Since about 30 ns), for the agent's hot path. Its reading is never later than the real time.
// It lags by about one tick, and by more only while its goroutine waits for a processor: the Go
// scheduler preempts a running goroutine after 10 ms, so Guard (25 ms) is the lag it plans for.
//
// A ticking goroutine wakes the process every tick, busy or idle: about three thousand context
// switches and 3 % of a core a second on our virtual machines, for an agent that answers nothing.
// So the goroutine sleeps after sleepAfter ticks: it marks the reading stale (its lowest bit, as
// readings are kept even) and waits. The next Now sees the mark, publishes the real time itself and
// wakes the goroutine; readings in between are exact. A clock read all the time pays one such wake
// every sleepAfter ticks; one read by nothing costs nothing.
type Coarse struct {
	now    atomic.Int64 // the reading, even; | stale while the goroutine sleeps
	real   Clock        // Real, but for the package's tests
	tick   time.Duration
	wake   chan struct{} // the sleeping goroutine is woken
	stop   chan struct{}
	closed sync.Once
	done   chan struct{}
}

const (
	// stale marks a reading the goroutine no longer advances: Now reads the real clock instead.
	stale = 1
	// sleepAfter is how many ticks the goroutine makes before it sleeps until the next Now.
	sleepAfter = 20
)

// NewCoarse starts a coarse clock advancing every tick on its own goroutine. Close stops it.
func NewCoarse(tick time.Duration) *Coarse { return newCoarse(NewReal(), tick) }

// newCoarse is NewCoarse reading real.
func newCoarse(real Clock, tick time.Duration) *Coarse {
	c := &Coarse{real: real, tick: tick, wake: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	c.now.Store(int64(c.real.Now()) &^ stale)
	go c.run()
	return c
}

func (c *Coarse) run() {
	defer close(c.done)
	t := time.NewTicker(c.tick)
	defer t.Stop()
	for ticks := 1; ; ticks++ {
		select {
		case <-c.stop:
			return
		case <-t.C:
		}
		c.Fresh() // not a plain store: a reading taken before a concurrent Fresh must not undo it
		if ticks < sleepAfter {
			continue
		}
		ticks = 0
		if !c.markStale() {
			continue
		}
		t.Stop()
		select {
		case <-c.stop:
			return
		case <-c.wake:
		}
		c.Fresh()
		t.Reset(c.tick)
	}
}

// markStale marks the reading stale, unless a Fresh moved it meanwhile (the clock is being read:
// it ticks on).
func (c *Coarse) markStale() bool {
	old := c.now.Load()
	return c.now.CompareAndSwap(old, old|stale)
}

// Now implements Clock.
func (c *Coarse) Now() Nanos {
	if n := c.now.Load(); n&stale == 0 {
		return Nanos(n)
	}
	return c.woken()
}

// woken is Now of a stale reading: the real time, published, and the goroutine woken (by the
// reader that clears the mark).
func (c *Coarse) woken() Nanos {
	n := int64(c.real.Now()) &^ stale
	for {
		old := c.now.Load()
		if old&stale == 0 {
			return Nanos(old) // another reader woke it, with a reading as fresh
		}
		v := max(old&^stale, n)
		if c.now.CompareAndSwap(old, v) {
			select {
			case c.wake <- struct{}{}:
			default:
			}
			return Nanos(v)
		}
	}
}

// Guard is the lag Coarse plans for: a deadline farther than Guard from Now has certainly not passed.
const Guard Nanos = Nanos(25 * time.Millisecond)

// Fresh reads the real clock and publishes it, for the rare callers that need an exact reading
// (a lease being granted) rather than a cheap one. It leaves a stale mark where it is: the next
// Now wakes the goroutine.
func (c *Coarse) Fresh() Nanos {
	n := int64(c.real.Now()) &^ stale
	for {
		old := c.now.Load()
		if old&^stale >= n {
			return Nanos(old &^ stale)
		}
		if c.now.CompareAndSwap(old, n|old&stale) {
			return Nanos(n)
		}
	}
}

// Close stops the goroutine and waits for it; the clock reads its last reading from then on.
func (c *Coarse) Close() {
	c.closed.Do(func() { close(c.stop) })
	<-c.done
	for {
		old := c.now.Load()
		if old&stale == 0 || c.now.CompareAndSwap(old, old&^stale) {
			return
		}
	}
}

// Manual is a clock that moves only when told: tests and the simulator drive it.
type Manual struct{ now atomic.Int64 }

// NewManual returns a manual clock reading start.
func NewManual(start Nanos) *Manual {
	m := &Manual{}
	m.now.Store(int64(start))
	return m
}

// Now implements Clock.
func (m *Manual) Now() Nanos { return Nanos(m.now.Load()) }

// Set moves the clock to t (backwards too: tests of clock jumps need it).
func (m *Manual) Set(t Nanos) { m.now.Store(int64(t)) }

// Advance moves the clock forward by d and returns the new reading.
func (m *Manual) Advance(d time.Duration) Nanos { return Nanos(m.now.Add(int64(d))) }
