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

func TestWant(t *testing.T) {
	const tok = bucket.PerToken
	for _, tc := range []struct {
		name                   string
		demand, cost, capacity bucket.Micro
		ttl                    time.Duration
		want                   bucket.Micro
	}{
		{"no demand yet: capacity/16", 0, tok, 20 * tok, 3 * time.Second, 20 * tok / 16},
		{"no demand, tiny bucket: one cost", 0, tok, 4 * tok, 3 * time.Second, tok},
		{"demand over half the lifetime", 10 * tok, tok, 100 * tok, 4 * time.Second, 20 * tok},
		{"capped at capacity", 1000 * tok, tok, 100 * tok, 4 * time.Second, 100 * tok},
		{"at least the cost", tok / 100, 5 * tok, 100 * tok, time.Second, 5 * tok},
	} {
		if got := Want(tc.demand, tc.ttl, tc.cost, tc.capacity); got != tc.want {
			t.Errorf("%s: Want(%d, %v, %d, %d) = %d, want %d", tc.name, tc.demand, tc.ttl, tc.cost, tc.capacity, got, tc.want)
		}
	}
}
