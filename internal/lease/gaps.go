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
// period that stops for a while and resumes on about the same period stays regular. The gap
// after a pause is alike within gapLikeAfterPause of the one before it (a client comes back from
// a pause at a pace that load or its work moved, as the stack benchmark's keys do between their
// mode's turns). A second pause in a row counts as any gap (the period changed, or the key is
// not regular).
//
// It keeps two bytes (every key of an agent's table has them): the last gap, on a log scale of
// an eighth of a doubling (9 %) per step, and how many gaps in a row were longer than the lease
// lived and like the one before, with a bit for a pause just skipped.
type Gaps struct {
	prev uint8 // the last gap's code (gapCode); 0 before the first
	run  uint8 // gaps in a row, up to maxRun, over τ by gapMargin and within gapLike of the one before; | paused
}

const (
	// RegularGaps is how many such gaps in a row make a key regular: four gaps alike, each like
	// the one before, which exponential gaps (a key checked at random) show at about 0.2 % of
	// gaps, with pauses skipped (TestGapsRegular).
	RegularGaps = 4
	// gapLike is how far a gap may be from the one before and count as alike, in codes (three:
	// 30 %). A key polled on a fixed period repeats it to a few per cent; keys the stack
	// benchmark walks in turn come round at the pace the load runs, which moves by a fifth
	// within seconds.
	gapLike = 3
	// gapMargin is how far a gap must exceed τ to count, in codes (gapLike: 30 %), so that the
	// next, alike within gapLike, still comes after the lease lapsed.
	gapMargin = gapLike
	// pauseCodes is how much longer than the one before a gap must be to be a pause, in codes: 8,
	// a doubling. Gaps drawn at random (exponential) are that much longer than the one before a
	// third of the time.
	pauseCodes = 8
	// gapLikeAfterPause is how far the gap after a pause may be from the one before the pause and
	// count as alike, in codes (4: 41 %); it must also exceed τ by as much.
	gapLikeAfterPause = 4

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
	margin, like := gapMargin, gapLike
	if g.run&paused != 0 {
		margin, like = gapLikeAfterPause, gapLikeAfterPause
	}
	if g.prev != 0 && c >= gapCode(ttl)+margin && d >= -like && d <= like {
		run = min(run+1, maxRun)
	} else {
		run = 0
	}
	g.run, g.prev = run, uint8(c)
}

// Regular reports whether the key's last RegularGaps gaps, a pause aside, were alike and longer
// than its leases live.
func (g *Gaps) Regular() bool { return g.run&^paused >= RegularGaps }
