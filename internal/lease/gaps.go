package lease

import (
	"math"
	"time"
)

// Gaps tells whether a key asks for tokens on a regular period longer than its leases live: the
// gaps between an agent's demand samples of the key, a key colder than its leases sampling once
// per check.
//
// It exists for one case of the grant rule. The ample want's request rounded up (Size) serves a
// key's next check if that comes within the lease's lifetime, which a key checked at random does
// with probability 1 − e^(−λτ): worth it, as a take saved costs some fifty times what a request
// that lapses does. A key checked on a fixed period longer than τ, a client polling, never finds
// it: the request lapses unspent every time (no store operation, but work in every tier). The
// agent says so in its Ask (Ask.Regular), and Size leaves such a key's ample want unrounded.
//
// A pause does not end a run: a gap at least twice the one before (pauseCodes), after at least
// one gap alike, is skipped once, the run and the gap before it kept, so a client polling on a
// period that stops for a while and resumes on the same period stays regular. A second such gap
// in a row counts as any gap (the period changed, or the key is not regular).
//
// It keeps two bytes (every key of an agent's table has them): the last gap, on a log scale of
// an eighth of a doubling (9 %) per step, and how many gaps in a row were longer than the lease
// lived and like the one before, with a bit for a pause just skipped.
type Gaps struct {
	prev uint8 // the last gap's code (gapCode); 0 before the first
	run  uint8 // gaps in a row, up to maxRun, over τ by gapMargin and within gapLike of the one before; | paused
}

const (
	// RegularGaps is how many such gaps in a row make a key regular: three pairs of gaps alike,
	// which exponential gaps (a key checked at random) show about once in a thousand.
	RegularGaps = 3
	// gapMargin is how far a gap must exceed τ to count, in codes (two: 19 %), so that the next,
	// alike within gapLike, still comes after the lease lapsed.
	gapMargin = 2
	// gapLike is how far a gap may be from the one before and count as alike, in codes (19 %).
	gapLike = 2
	// pauseCodes is how much longer than the one before a gap must be to be a pause, in codes: 8,
	// a doubling. Gaps drawn at random (exponential) are that much longer than the one before a
	// third of the time, so a skipped pause about doubles how often they look regular (still
	// under 0.5 % of gaps, TestGapsRegular).
	pauseCodes = 8

	paused = 0x80       // run's bit: the last gap was a pause, skipped
	maxRun = paused - 1 // the longest run counted
)

// gapCode is d on the log scale: 8·log2(d in ms), rounded, within 1..255 (1 ms to 49 days).
func gapCode(d time.Duration) int {
	ms := float64(d) / float64(time.Millisecond)
	if ms <= 1 {
		return 1
	}
	return int(min(255, math.Round(8*math.Log2(ms))))
}

// Observe adds one gap between samples of a key whose leases live ttl.
func (g *Gaps) Observe(gap, ttl time.Duration) {
	c := gapCode(gap)
	d := c - int(g.prev)
	run := g.run &^ paused
	if run > 0 && g.run&paused == 0 && d >= pauseCodes {
		g.run |= paused // a pause: skipped once
		return
	}
	if g.prev != 0 && c >= gapCode(ttl)+gapMargin && d >= -gapLike && d <= gapLike {
		run = min(run+1, maxRun)
	} else {
		run = 0
	}
	g.run, g.prev = run, uint8(c)
}

// Regular reports whether the key's last RegularGaps gaps, a pause aside, were alike and longer
// than its leases live.
func (g *Gaps) Regular() bool { return g.run&^paused >= RegularGaps }
