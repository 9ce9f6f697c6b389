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
// Deadline checks therefore use Now only while Now() < deadline - Guard, and Fresh (the real clock)
// within Guard of the deadline.
type Coarse struct {
	now    atomic.Int64
	real   Clock // Real, but for the package's tests
	tick   time.Duration
	stop   chan struct{}
	closed sync.Once
	done   chan struct{}
}

// NewCoarse starts a coarse clock advancing every tick on its own goroutine. Close stops it.
func NewCoarse(tick time.Duration) *Coarse { return newCoarse(NewReal(), tick) }

// newCoarse is NewCoarse reading real.
func newCoarse(real Clock, tick time.Duration) *Coarse {
	c := &Coarse{real: real, tick: tick, stop: make(chan struct{}), done: make(chan struct{})}
	c.now.Store(int64(c.real.Now()))
	go c.run()
	return c
}

func (c *Coarse) run() {
	defer close(c.done)
	t := time.NewTicker(c.tick)
	defer t.Stop()
	for {
		select {
		case <-c.stop:
			return
		case <-t.C:
			c.Fresh() // not a plain store: a reading taken before a concurrent Fresh must not undo it
		}
	}
}

// Now implements Clock.
func (c *Coarse) Now() Nanos { return Nanos(c.now.Load()) }

// Guard is the lag Coarse plans for: a deadline farther than Guard from Now has certainly not passed.
const Guard Nanos = Nanos(25 * time.Millisecond)

// Fresh reads the real clock and publishes it, for the rare callers that need an exact reading
// (a lease being granted) rather than a cheap one.
func (c *Coarse) Fresh() Nanos {
	n := int64(c.real.Now())
	for {
		old := c.now.Load()
		if old >= n || c.now.CompareAndSwap(old, n) {
			return Nanos(max(old, n))
		}
	}
}

// Close stops the ticking goroutine and waits for it.
func (c *Coarse) Close() {
	c.closed.Do(func() { close(c.stop) })
	<-c.done
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
