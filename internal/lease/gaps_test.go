package lease

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
)

// TestGapsRegular: a key checked on a fixed period longer than τ (±5 % jitter) is regular after
// four gaps and reports no demand while its demand over a lifetime is under a request; a key on
// a period within 19 % of τ or shorter, or checked at random, is regular at hardly any gap.
func TestGapsRegular(t *testing.T) {
	const ttl = 250 * time.Millisecond
	r := rand.New(rand.NewPCG(1, 2))
	jitter := func(d time.Duration) time.Duration { return time.Duration(float64(d) * (0.95 + 0.1*r.Float64())) }
	demand := bucket.PerToken * 5 / 4 // 1.25 a second: under a request (1 token) per lifetime
	var g Gaps
	for i := range 4 {
		if g.Regular() || Servable(demand, bucket.PerToken, &g, ttl) != demand {
			t.Fatalf("regular after %d gaps, want 4 first", i)
		}
		g.Observe(jitter(800*time.Millisecond), ttl)
	}
	for i := range 100 {
		if !g.Regular() || Servable(demand, bucket.PerToken, &g, ttl) != 0 {
			t.Fatalf("gap %d: a key checked every 0.8 s (±5 %%) is not regular over τ = %v: %+v", i+4, ttl, g)
		}
		g.Observe(jitter(800*time.Millisecond), ttl)
	}
	// A demand that fills a request per lifetime is reported whatever the gaps.
	if got := Servable(4*bucket.PerToken, bucket.PerToken, &g, ttl); got != 4*bucket.PerToken {
		t.Errorf("a regular key of 4 a second reports %d µ/s, want its demand", got)
	}
	// One gap out of step ends it.
	g.Observe(300*time.Millisecond, ttl)
	if g.Regular() {
		t.Error("still regular after a gap of 0.3 s among gaps of 0.8 s")
	}
	for _, tc := range []struct {
		name string
		gap  func() time.Duration
		most int // of 10,000 gaps called regular
	}{
		{"every 0.2 s", func() time.Duration { return jitter(200 * time.Millisecond) }, 0},
		{"every 0.27 s, within 19 % of τ", func() time.Duration { return jitter(270 * time.Millisecond) }, 0},
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
		if regular > tc.most {
			t.Errorf("%s: regular at %d of 10,000 gaps, want at most %d", tc.name, regular, tc.most)
		}
	}
}
