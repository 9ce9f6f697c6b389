package lease

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
)

// TestGapsRegular: a key checked on a fixed period longer than τ (±5 % jitter) is regular after
// five gaps, and stays so over a pause (one gap of twice the period or more); a gap out of step,
// or two pauses in a row, end it; a key on a period within 30 % of τ or shorter, or checked at
// random, is regular at hardly any gap.
func TestGapsRegular(t *testing.T) {
	const ttl = 250 * time.Millisecond
	r := rand.New(rand.NewPCG(1, 2))
	jitter := func(d time.Duration) time.Duration { return time.Duration(float64(d) * (0.95 + 0.1*r.Float64())) }
	var g Gaps
	for i := range 5 {
		if g.Regular() {
			t.Fatalf("regular after %d gaps, want 5 first", i)
		}
		g.Observe(jitter(800*time.Millisecond), ttl)
	}
	for i := range 100 {
		if !g.Regular() {
			t.Fatalf("gap %d: a key checked every 0.8 s (±5 %%) is not regular over τ = %v: %+v", i+5, ttl, g)
		}
		g.Observe(jitter(800*time.Millisecond), ttl)
	}
	// A pause keeps it, whether the key resumes on its period, or on one up to 41 % off it (then
	// keeps that one).
	for i, gaps := range [][]time.Duration{
		{3 * time.Second, 800 * time.Millisecond},
		{1600 * time.Millisecond, 790 * time.Millisecond, 10 * time.Second, 810 * time.Millisecond},
		{5 * time.Second, 560 * time.Millisecond, 570 * time.Millisecond, 4 * time.Second, 790 * time.Millisecond, 800 * time.Millisecond},
	} {
		for _, d := range gaps {
			g.Observe(d, ttl)
			if !g.Regular() {
				t.Fatalf("pause %d: not regular after a gap of %v among gaps of 0.8 s: %+v", i, d, g)
			}
		}
	}
	// Two pauses in a row end it, as does one gap out of step.
	for _, tc := range []struct {
		name string
		gaps []time.Duration
	}{
		{"two gaps of 3 s", []time.Duration{3 * time.Second, 3 * time.Second}},
		{"a gap of 0.3 s", []time.Duration{300 * time.Millisecond}},
		{"a pause, then a gap of 0.3 s", []time.Duration{3 * time.Second, 300 * time.Millisecond}},
		{"a gap of 1.4 s, under twice the period", []time.Duration{1400 * time.Millisecond}},
		{"a pause, then a gap of 0.45 s", []time.Duration{3 * time.Second, 450 * time.Millisecond}},
		{"a pause, then a gap of 0.55 s and one of 0.8 s", []time.Duration{3 * time.Second, 550 * time.Millisecond, 800 * time.Millisecond}},
	} {
		g := g
		for _, d := range tc.gaps {
			g.Observe(d, ttl)
		}
		if g.Regular() {
			t.Errorf("still regular after %s among gaps of 0.8 s: %+v", tc.name, g)
		}
	}
	// A long gap before any two alike is no pause: the run starts after it.
	var h Gaps
	for _, d := range []time.Duration{800 * time.Millisecond, 5 * time.Second, 5 * time.Second, 5 * time.Second, 5 * time.Second} {
		h.Observe(d, ttl)
	}
	if h.Regular() {
		t.Errorf("regular after three gaps alike: %+v", h)
	}
	h.Observe(5*time.Second, ttl)
	if !h.Regular() {
		t.Errorf("not regular after four gaps of 5 s: %+v", h)
	}
	for _, tc := range []struct {
		name string
		gap  func() time.Duration
		most int // of 10,000 gaps called regular
	}{
		{"every 0.2 s", func() time.Duration { return jitter(200 * time.Millisecond) }, 0},
		{"every 0.3 s, within 30 % of τ", func() time.Duration { return jitter(300 * time.Millisecond) }, 0},
		{"at random, a mean of 0.8 s", func() time.Duration { return time.Duration(r.ExpFloat64() * float64(800*time.Millisecond)) }, 50},
		{"at random, a mean of 10 s", func() time.Duration { return time.Duration(r.ExpFloat64() * float64(10*time.Second)) }, 50},
	} {
		var g Gaps
		regular := 0
		for range 10_000 {
			g.Observe(tc.gap(), ttl)
			if g.Regular() {
				regular++
			}
		}
		t.Logf("%s: regular at %d of 10,000 gaps", tc.name, regular)
		if regular > tc.most {
			t.Errorf("%s: regular at %d of 10,000 gaps, want at most %d", tc.name, regular, tc.most)
		}
	}
}

// TestSizeRegular: a regular key's ample want holds its lifetime's demand rounded down to whole
// requests (nothing for a demand under a request per lifetime: its check alone), where any other
// thin key's holds it plus its spread, rounded up; its want is the same either way.
func TestSizeRegular(t *testing.T) {
	lim, err := bucket.NewLimit(100*bucket.PerToken, 100*bucket.PerToken, 1000) // 100/s, burst 100: τ = 250 ms
	if err != nil {
		t.Fatal(err)
	}
	const cost = bucket.PerToken
	for _, tc := range []struct {
		demand            bucket.Micro // µ/s
		ample, regularAmp bucket.Micro
	}{
		{demand: cost * 5 / 4, ample: 2 * cost, regularAmp: cost}, // 0.31 of a request per lifetime, + 0.56
		{demand: 6 * cost, ample: 4 * cost, regularAmp: 2 * cost}, // 1.5, + 1.22
		{demand: 4 * cost, ample: 3 * cost, regularAmp: 2 * cost}, // exactly 1, + 1
		{demand: 0, ample: cost, regularAmp: cost},                // none measured
	} {
		ask := Ask{Needed: cost, Least: cost, Demand: tc.demand}
		p, err := Size(lim, cost, false, ask)
		if err != nil {
			t.Fatal(err)
		}
		ask.Regular = true
		r, err := Size(lim, cost, false, ask)
		if err != nil {
			t.Fatal(err)
		}
		if p.AmpleWant != tc.ample || r.AmpleWant != tc.regularAmp || r.Want != p.Want || r.TTL != p.TTL {
			t.Errorf("demand %d µ/s: ample want %d, regular %d (want %d, %d); want %d and %d, TTL %v and %v",
				tc.demand, p.AmpleWant, r.AmpleWant, p.Want, r.Want, tc.ample, tc.regularAmp, p.TTL, r.TTL)
		}
	}
}

// FuzzGaps holds Gaps to its rules on any series of gaps: a gap within gapMargin of τ or shorter
// never leaves a key regular unless skipped as a pause (at least twice the gap before); a pause
// is skipped at most once in a row; and RegularGaps+2 equal gaps past τ's margin make any key
// regular, whatever it saw before (one may be skipped as a pause, the next start the run).
func FuzzGaps(f *testing.F) {
	f.Add([]byte{200, 200, 200, 200, 255, 200, 200}, uint16(250))
	f.Add([]byte{1, 255, 1, 255, 3, 3, 3, 3}, uint16(30000))
	f.Fuzz(func(t *testing.T, series []byte, ttlMs uint16) {
		ttl := time.Duration(max(1, ttlMs)) * time.Millisecond
		var g Gaps
		skipped := false
		for i, b := range series {
			gap := time.Duration(b) * time.Duration(b) * 50 * time.Millisecond / 255 // 0 to 12.75 s, finer when short
			before := g
			g.Observe(gap, ttl)
			pause := g.prev == before.prev && g.run == before.run|paused && before.run&paused == 0 && before.run > 0
			switch {
			case pause && skipped:
				t.Fatalf("gap %d (%v): two pauses skipped in a row: %+v → %+v", i, gap, before, g)
			case pause && gapCode(gap)-int(before.prev) < pauseCodes:
				t.Fatalf("gap %d (%v): skipped as a pause, under twice the gap before: %+v → %+v", i, gap, before, g)
			case !pause && g.Regular() && gapCode(gap) < gapCode(ttl)+gapMargin:
				t.Fatalf("gap %d (%v): regular after a gap within τ's margin (τ = %v): %+v", i, gap, ttl, g)
			}
			skipped = pause
		}
		d := max(2*ttl, time.Second)
		for range RegularGaps + 2 {
			g.Observe(d, ttl)
		}
		if !g.Regular() {
			t.Fatalf("not regular after %d gaps of %v (τ = %v): %+v", RegularGaps+2, d, ttl, g)
		}
	})
}
