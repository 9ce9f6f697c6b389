package lease

import (
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
)

func limit(t *testing.T, burst, perPeriod int64, period time.Duration) bucket.Limit {
	t.Helper()
	l, err := bucket.NewLimit(bucket.Micro(burst)*bucket.PerToken, bucket.Micro(perPeriod)*bucket.PerToken, bucket.Millis(period/time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func TestTTL(t *testing.T) {
	for _, tc := range []struct {
		name  string
		limit bucket.Limit
		want  time.Duration
	}{
		// The card's example: 20 tokens refill in 12 s; a quarter of that is 3 s, and r·τ = 5 tokens.
		{"100/minute burst 20", limit(t, 20, 100, time.Minute), 3 * time.Second},
		{"fast rate, small burst: MinTTL", limit(t, 10, 10_000, time.Second), MinTTL},
		{"slow rate: MaxTTL", limit(t, 1000, 10, time.Hour), MaxTTL},
		{"one token a day, burst 1000: MaxTTL without overflow", limit(t, 1000, 1, 24*time.Hour), MaxTTL},
		{"no refill", limit(t, 100, 0, 0), MaxTTL},
	} {
		if got := TTL(tc.limit); got != tc.want {
			t.Errorf("%s: TTL(%s) = %v, want %v", tc.name, tc.limit, got, tc.want)
		}
	}
}

func TestTTLKeepsExcessWithinQuarterBurst(t *testing.T) {
	for _, l := range []bucket.Limit{limit(t, 20, 100, time.Minute), limit(t, 500, 600, time.Second), limit(t, 60, 3600, time.Hour)} {
		ttl := TTL(l)
		if ttl <= MinTTL {
			continue
		}
		num, den := l.Rate()
		excess := float64(num) / float64(den) * float64(ttl/time.Millisecond) // µ refilled in τ
		if excess > float64(l.Capacity())/Excess+float64(num) {
			t.Errorf("%s: r·τ = %.0f µ exceeds C/%d = %d µ", l, excess, Excess, l.Capacity()/Excess)
		}
	}
}

func TestSizeNoDemandTakesWhatWaits(t *testing.T) {
	const tok = bucket.PerToken
	l := limit(t, 20, 100, time.Minute)
	for _, a := range []Ask{{Needed: tok, Least: tok}, {Needed: 3 * tok, Least: tok}, {Needed: 0, Least: 2 * tok}} {
		p, err := Size(l, tok, false, a)
		if err != nil {
			t.Fatal(err)
		}
		if want := max(a.Needed, a.Least); p.Want != want || p.Least != a.Least || p.Unit != tok || p.TTL != TTL(l) {
			t.Errorf("Size(%+v) = %+v, want exactly %d µ", a, p, want)
		}
	}
}

func TestSizeGrowsWithDemand(t *testing.T) {
	const tok = bucket.PerToken
	l := limit(t, 1000, 100, time.Second) // τ = 2.5 s
	prev := bucket.Micro(0)
	for _, d := range []bucket.Micro{tok, 10 * tok, 100 * tok, 1000 * tok} {
		p, err := Size(l, tok, false, Ask{Least: tok, Demand: d})
		if err != nil {
			t.Fatal(err)
		}
		// demand over τ/2 = 1.25 s, whole requests, at most the capacity.
		want := min(l.Capacity(), max(tok, d*5/4/tok*tok))
		if p.Want != want || p.Want < prev {
			t.Errorf("Size(demand %d µ/s).Want = %d, want %d (and not below %d)", d, p.Want, want, prev)
		}
		prev = p.Want
	}
}

func TestDemand(t *testing.T) {
	const tok = bucket.PerToken
	var d Demand
	if d.Rate() != 0 {
		t.Fatalf("zero Demand: rate %d", d.Rate())
	}
	// The first sample is the estimate; later ones average with it.
	if got := d.Observe(10*tok, time.Second); got != 10*tok {
		t.Errorf("first sample 10 tokens in 1 s: %d µ/s", got)
	}
	if got := d.Observe(30*tok, time.Second); got != 20*tok {
		t.Errorf("then 30 tokens in 1 s: %d µ/s, want the average 20 tokens/s", got)
	}
	// A key idle for longer than IdleAfter starts afresh: its next lease is small at once.
	if got := d.Observe(tok, 10*time.Second); got != tok/10 {
		t.Errorf("after 10 s idle with one request: %d µ/s, want 0.1 token/s", got)
	}
	if got := d.Observe(0, time.Second); got != tok/20 {
		t.Errorf("then nothing for 1 s: %d µ/s, want half of it", got)
	}
}

func TestPerSecond(t *testing.T) {
	const tok = bucket.PerToken
	for _, tc := range []struct {
		used    bucket.Micro
		elapsed time.Duration
		want    bucket.Micro
	}{
		{0, time.Second, 0},
		{tok, 0, maxDemand},
		{tok, 500 * time.Millisecond, 2 * tok},
		{3, 2 * time.Second, 1},
		// used·10^9 passes 2^63: 10,000 tokens in 100 ms is 100,000 tokens/s.
		{10_000 * tok, 100 * time.Millisecond, 100_000 * tok},
		{bucket.MaxExact, time.Nanosecond, maxDemand},
	} {
		if got := PerSecond(tc.used, tc.elapsed); got != tc.want {
			t.Errorf("PerSecond(%d, %v) = %d, want %d", tc.used, tc.elapsed, got, tc.want)
		}
	}
}
