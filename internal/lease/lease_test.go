package lease

import (
	"math"
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
		if want := max(a.Needed, a.Least); p.Want != want || p.AmpleWant != want || p.Least != a.Least || p.Unit != tok || p.TTL != TTL(l) {
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
		// demand over τ/2 = 1.25 s, whole requests, at most the capacity; over τ rounded up for the
		// ample want, a thin key's (under ThinRequests a lifetime) with its spread added.
		want := min(l.Capacity(), max(tok, d*5/4/tok*tok))
		if p.Want != want || p.Want < prev {
			t.Errorf("Size(demand %d µ/s).Want = %d, want %d (and not below %d)", d, p.Want, want, prev)
		}
		lifetime := d * 5 / 2
		if lifetime < ThinRequests*tok {
			lifetime = min(ThinRequests*tok, lifetime+bucket.Micro(math.Sqrt(float64(lifetime)*float64(tok))))
		}
		if ample := min(l.Capacity(), max(tok, (lifetime+tok-1)/tok*tok)); p.AmpleWant != ample {
			t.Errorf("Size(demand %d µ/s).AmpleWant = %d, want %d", d, p.AmpleWant, ample)
		}
		prev = p.Want
	}
}

// TestSizeThinOnScarce: a key with under ThinRequests requests of demand per lifetime whose
// bucket was low at its last answer (Scarce) takes what its checks need, want and ample alike; at
// ThinRequests, or on a bucket that was not low, its demand sizes the lease as before.
func TestSizeThinOnScarce(t *testing.T) {
	const tok = bucket.PerToken
	l := limit(t, 100, 100, time.Second) // τ = 250 ms: sixteen requests a lifetime is 64 a second
	for _, tc := range []struct {
		name        string
		a           Ask
		want, ample bucket.Micro
	}{
		{"thin, scarce: what waits", Ask{Needed: 2 * tok, Least: tok, Demand: 60 * tok, Scarce: true}, 2 * tok, 2 * tok},
		{"thin, scarce, a prefetch: one request", Ask{Least: tok, Demand: 15 * tok, Scarce: true}, tok, tok},
		{"thin, not scarce: its demand", Ask{Needed: 2 * tok, Least: tok, Demand: 12 * tok}, 3 * tok, 7 * tok}, // 1.5 → 1; 3 + √3 rounded up
		{"sixteen a lifetime, scarce: its demand", Ask{Needed: tok, Least: tok, Demand: 64 * tok, Scarce: true}, 9 * tok, 17 * tok},
	} {
		p, err := Size(l, tok, false, tc.a)
		if err != nil {
			t.Fatal(err)
		}
		if p.Want != tc.want || p.AmpleWant != tc.ample {
			t.Errorf("%s: Size(%+v) wants %d µ, ample %d µ; want %d µ, %d µ", tc.name, tc.a, p.Want, p.AmpleWant, tc.want, tc.ample)
		}
	}
}

// TestAmple: a bucket is ample for a grant that leaves it at least 1 − 1/Reserve of its capacity,
// the mirror of Low.
func TestAmple(t *testing.T) {
	l := limit(t, 1000, 100, time.Second) // C = 1000 tokens: ample down to 750
	c := l.Capacity()
	for _, tc := range []struct {
		tokens, want bucket.Micro
		ample        bool
	}{
		{c, c / 4, true},
		{c, c/4 + 1, false},
		{c - 1, c / 4, false},
		{c * 3 / 4, 0, true},
		{-c, 0, false}, // a bucket in debt
	} {
		if got := Ample(l, tc.tokens, tc.want); got != tc.ample {
			t.Errorf("Ample(%d µ, want %d µ) = %t, want %t", tc.tokens, tc.want, got, tc.ample)
		}
		if Ample(l, tc.tokens, tc.want) && Low(l, tc.tokens, tc.want) {
			t.Errorf("Ample and Low both hold for %d µ, want %d µ", tc.tokens, tc.want)
		}
	}
}

func TestLowMark(t *testing.T) {
	const tok = bucket.PerToken
	tau := 250 * time.Millisecond
	for _, tc := range []struct {
		name                 string
		tokens, demand, unit bucket.Micro
		ttl                  time.Duration
		want                 bucket.Micro
		scarce               bool
	}{
		{"no demand measured", 16 * tok, 0, tok, tau, 0, false},
		{"a request every 2 lifetimes", 16 * tok, 2 * tok, tok, tau, 0, false},
		{"just under a request per lifetime", 16 * tok, 4*tok - 4, tok, tau, 0, false},
		{"a request per lifetime", 16 * tok, 4 * tok, tok, tau, 4 * tok, false},
		{"ten per lifetime", 16 * tok, 40 * tok, tok, tau, 4 * tok, false},
		{"requests of 5 tokens, 4 tokens per lifetime", 16 * tok, 16 * tok, 5 * tok, tau, 0, false},
		{"requests of 5 tokens, 5 tokens per lifetime", 16 * tok, 20 * tok, 5 * tok, tau, 4 * tok, false},
		{"a day's lifetime cap: a request a minute", 8 * tok, tok / 60, tok, MaxTTL, 0, false},
		{"demand beyond any bucket", 8 * tok, bucket.MaxExact, tok, MaxTTL, 2 * tok, false},
		// On a scarce bucket a thin key (under ThinRequests requests per lifetime) does not refill
		// ahead of need: the prefetched lease would lapse partly unspent a good part of the time.
		{"scarce: a request per lifetime", 16 * tok, 4 * tok, tok, tau, 0, true},
		{"scarce: just under sixteen per lifetime", 16 * tok, 64*tok - 4, tok, tau, 0, true},
		{"scarce: sixteen per lifetime", 16 * tok, 64 * tok, tok, tau, 4 * tok, true},
		{"scarce: forty per lifetime", 16 * tok, 160 * tok, tok, tau, 4 * tok, true},
		{"scarce: requests of 5 tokens, 79 tokens per lifetime", 16 * tok, 316 * tok, 5 * tok, tau, 0, true},
		{"scarce: requests of 5 tokens, 80 tokens per lifetime", 16 * tok, 320 * tok, 5 * tok, tau, 4 * tok, true},
	} {
		if got := LowMark(tc.tokens, tc.demand, tc.unit, tc.ttl, tc.scarce); got != tc.want {
			t.Errorf("%s: LowMark(%d µ, %d µ/s, %d µ, %v, scarce %t) = %d µ, want %d µ", tc.name, tc.tokens, tc.demand, tc.unit, tc.ttl, tc.scarce, got, tc.want)
		}
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

// TestContend: the cases of the contention rule on the hot-key numbers (20,000/s, burst 20,000,
// τ = 250 ms: a lifetime refills C/4).
func TestContend(t *testing.T) {
	const tok = bucket.PerToken
	l := limit(t, 20_000, 20_000, time.Second)
	ttl := bucket.Millis(TTL(l) / time.Millisecond)
	for _, tc := range []struct {
		name                        string
		tokens, want, demand, total bucket.Micro
		since                       bucket.Millis
		others, competing           bool
		cut                         bucket.Micro
		share                       int64
		contended                   bool
	}{
		{name: "full bucket: not low, nothing cut", tokens: 20_000 * tok, want: 500 * tok, demand: 1000 * tok, total: 40_000 * tok,
			cut: 500 * tok},
		{name: "low but refilling: demand below the rate", tokens: 4000 * tok, want: 500 * tok, demand: 1000 * tok, total: 10_000 * tok,
			cut: 500 * tok},
		{name: "low and overloaded: its share of a lifetime's refill and of what the bucket holds", tokens: 1000 * tok, want: 5000 * tok,
			demand: 1000 * tok, total: 40_000 * tok, since: ttl, cut: 150 * tok, share: 25, contended: true}, // (5000+1000)/40
		{name: "competing on a bucket above the low mark", tokens: 10_000 * tok, want: 100 * tok, demand: 1000 * tok, total: 80_000 * tok,
			since: ttl, competing: true, cut: 180 * tok, share: 12, contended: true}, // (5000+10000)·12‰ = 180: more than it asked
		{name: "competing, but the bucket holds more than the demand over a lifetime beyond its refill", tokens: 10_000 * tok, want: 100 * tok,
			demand: 1000 * tok, total: 40_000 * tok, since: ttl, competing: true, cut: 100 * tok}, // 10,000 over a lifetime < 5000 + 10,000
		{name: "the only demand reported, others took: at most the share cap of the pool", tokens: 1000 * tok, want: 5000 * tok,
			demand: 40_000 * tok, total: 40_000 * tok, others: true, since: ttl, cut: 3000 * tok, share: 1000, contended: true}, // (5000+1000)/2
		{name: "alone on the key: the whole pool", tokens: 1000 * tok, want: 7000 * tok,
			demand: 40_000 * tok, total: 40_000 * tok, since: ttl, cut: 6000 * tok, share: 1000, contended: true}, // 5000+1000
		{name: "never took: a lifetime's refill", tokens: 0, want: 5000 * tok, demand: 20_000 * tok, total: 40_000 * tok,
			cut: 2500 * tok, share: 500, contended: true},
		{name: "the share rounds below least: least", tokens: 0, want: 5000 * tok, demand: 1 * tok, total: 40_000 * tok,
			cut: 3 * tok, share: 0, contended: true},
		{name: "direct mode (no lifetime): never contended", tokens: 0, want: 5 * tok, demand: 1000 * tok, total: 40_000 * tok,
			cut: 5 * tok},
	} {
		ttl := ttl
		if tc.name == "direct mode (no lifetime): never contended" {
			ttl = 0
		}
		cut, share, contended, _ := Contend(l, tc.tokens, tc.want, 3*tok, tok, tc.demand, tc.total, tc.others, ttl, tc.since, tc.competing)
		if cut != tc.cut || share != tc.share || contended != tc.contended {
			t.Errorf("%s: Contend = %d µ, %d‰, %v; want %d µ, %d‰, %v", tc.name, cut, share, contended, tc.cut, tc.share, tc.contended)
		}
	}
}

// TestContendThin: on an overloaded bucket (a key of 100 a second, burst 100: leases of 250 ms,
// a pool of 25 tokens of refill per lifetime), an agent whose demand over a lifetime (m requests)
// would exceed its cut by less than √m takes per check: its cut is least, and its grant is not
// paced. One with more demand beyond its share, or with ThinRequests requests a lifetime or more,
// keeps its share.
func TestContendThin(t *testing.T) {
	const tok = bucket.PerToken
	l := limit(t, 100, 100, time.Second)
	ttl := bucket.Millis(TTL(l) / time.Millisecond)
	for _, tc := range []struct {
		name          string
		demand, total bucket.Micro
		unit          bucket.Micro
		cut           bucket.Micro
		share         int64
		perCheck      bool
	}{
		// 5.5 a second of 110: m = 1, its share of 25 tokens 1.25, at most its demand over
		// three quarters of a lifetime (1.03): 1 token, and 1 − 1 < √1.
		{"5.5 of 110 a second", 5500 * tok / 1000, 110 * tok, tok, tok, 50, true},
		// 15 of 110: m = 3, its share 3.4 tokens, at most 2.8: 2, and 3 − 2 < √3.
		{"15 of 110 a second", 15 * tok, 110 * tok, tok, tok, 136, true},
		// 15 of 300: m = 3, its share 1.25 tokens: 1, and 3 − 1 ≥ √3: a lease of one, paced.
		{"15 of 300 a second", 15 * tok, 300 * tok, tok, tok, 50, false},
		// 64 of 150: m = 16, its share 10.6 tokens, at most 12: 10 (ThinRequests or more: never
		// per check).
		{"64 of 150 a second", 64 * tok, 150 * tok, tok, 10 * tok, 426, false},
		// Requests of 5 tokens: m counts requests. 60 tokens a second of 110 is 3 requests a
		// lifetime, its share of 25 tokens 13.6, at most 11.25: two requests, 3 − 2 < √3.
		{"requests of 5 tokens", 60 * tok, 110 * tok, 5 * tok, 5 * tok, 545, true},
	} {
		cut, share, contended, perCheck := Contend(l, 0, 20*tok, tc.unit, tc.unit, tc.demand, tc.total, true, ttl, ttl, false)
		if cut != tc.cut || share != tc.share || !contended || perCheck != tc.perCheck {
			t.Errorf("%s: Contend = %d µ, %d‰, contended %v, per check %v; want %d µ, %d‰, contended, per check %v",
				tc.name, cut, share, contended, perCheck, tc.cut, tc.share, tc.perCheck)
		}
	}
}

// TestContendDayBudget: a bucket that refills a token a day is overloaded by any demand if only
// its refill counts; it is not while what it holds covers its agents' demand over a lifetime, so
// an agent with a few tokens of demand takes them without a pace while the budget lasts.
func TestContendDayBudget(t *testing.T) {
	const tok = bucket.PerToken
	l := limit(t, 100, 1, 24*time.Hour)
	ttl := bucket.Millis(TTL(l) / time.Millisecond) // MaxTTL: 30 s
	// 20 tokens left (below the low mark), a tenth of a token a second: 3 over a lifetime.
	if cut, share, contended, _ := Contend(l, 20*tok, 2*tok, tok, tok, tok/10, tok/10, false, ttl, 0, true); contended || cut != 2*tok || share != 0 {
		t.Errorf("3 tokens of demand over a lifetime on 20 held: Contend = %d µ, %d‰, %v; want 2 tokens, uncontended", cut, share, contended)
	}
	// A token a second: 30 over a lifetime, more than the 20 held: its share of them, paced.
	cut, share, contended, _ := Contend(l, 20*tok, 2*tok, tok, tok, tok, tok, false, ttl, 0, true)
	if !contended || share != bucket.WholeShare || cut != 20*tok {
		t.Errorf("30 tokens of demand over a lifetime on 20 held: Contend = %d µ, %d‰, %v; want all 20, contended", cut, share, contended)
	}
}

// TestPace: a competing agent waits until its share of the refill covers what it got, at least
// the others' share of a lifetime and half a lifetime, at most until its lease is down to its
// low water (three quarters of a lifetime).
func TestPace(t *testing.T) {
	const tok = bucket.PerToken
	l := limit(t, 20_000, 20_000, time.Second) // 20 tokens a ms
	const ttl, longest = 250, 188
	for _, tc := range []struct {
		amount bucket.Micro
		share  int64
		want   bucket.Millis
	}{
		{125 * tok, 25, longest}, // own: 7 ms of refill (rounded up) at 25‰ = 280 ms
		{25 * tok, 25, longest},  // own: 2 ms at 25‰ = 80 ms; the others' share of a lifetime: 243.75 ms
		{100 * tok, 500, 125},    // own: 5 ms / 0.5 = 10 ms; the others' half of a lifetime: 125 ms
		{1000 * tok, 1000, 125},  // alone: the whole refill covers it in 50 ms, but it asks at most twice a lifetime
		{6000 * tok, 1000, 188},  // alone: 300 ms of refill, at most the longest pace
		{100 * tok, 800, 125},    // most of the key: 7 ms at 800‰; the others' 200‰ of a lifetime is 50 ms; half a lifetime
		{10_000 * tok, 1000, longest},
		{1 * tok, 0, longest}, // no share
	} {
		if got := Pace(l, tc.amount, tc.share, ttl); got != tc.want {
			t.Errorf("Pace(%d µ, %d‰) = %d ms, want %d", tc.amount, tc.share, got, tc.want)
		}
	}
}

// fuzzLimit is the limit of burst tokens refilled per tokens each periodMs, if the fuzzers' inputs
// make a valid one of a sane size.
func fuzzLimit(burst, per, periodMs int64) (bucket.Limit, bool) {
	if burst < 1 || burst > 1<<30 || per < 0 || per > 1<<30 || periodMs < 1 || periodMs > 1<<40 {
		return bucket.Limit{}, false
	}
	l, err := bucket.NewLimit(bucket.Micro(burst)*bucket.PerToken, bucket.Micro(per)*bucket.PerToken, bucket.Millis(periodMs))
	return l, err == nil
}

// FuzzContend: whatever the inputs, a contended take is cut to no more than the agent's demand
// over a lifetime or its share of the refill and the bucket, is never cut below least, and is whole
// units above least; an uncontended take is unchanged; a pace is within [0, τ].
func FuzzContend(f *testing.F) {
	f.Add(int64(20_000), int64(20_000), int64(1000), uint64(1000), uint64(5000), uint64(3), uint64(1000), uint64(40_000), int64(250), int64(250), false, false)
	f.Add(int64(10), int64(1), int64(60_000), uint64(0), uint64(10), uint64(1), uint64(1), uint64(1), int64(30_000), int64(0), true, true)
	f.Fuzz(func(t *testing.T, burst, per, periodMs int64, tokens, want, least, demand, total uint64, ttl, since int64, others, competing bool) {
		const tok = bucket.PerToken
		l, ok := fuzzLimit(burst, per, periodMs)
		if !ok {
			return
		}
		c := l.Capacity()
		tk, w, le := bucket.Micro(tokens%uint64(c+1)), bucket.Micro(want%uint64(c+1)), bucket.Micro(least%uint64(c)+1)
		d, tot := bucket.Micro(demand%uint64(maxDemand)), bucket.Micro(total%uint64(maxDemand))
		ttl %= int64(MaxTTL/time.Millisecond) + 1
		cut, share, contended, perCheck := Contend(l, tk, w, le, tok, d, tot, others, bucket.Millis(ttl), bucket.Millis(since), competing)
		if perCheck && (!contended || cut != le || min(d, MaxShareDemand)/bucket.WholeShare*bucket.Micro(ttl) >= ThinRequests*tok) {
			t.Fatalf("per check: contended %v, cut %d µ (least %d), demand %d µ/s over %d ms: want contended, least, a thin agent",
				contended, cut, le, d, ttl)
		}
		if !contended {
			if cut != w || share != 0 {
				t.Fatalf("uncontended: cut %d (want %d), share %d", cut, w, share)
			}
			return
		}
		if share < 0 || share > bucket.WholeShare || ttl <= 0 || d <= 0 {
			t.Fatalf("contended with share %d, ttl %d, demand %d", share, ttl, d)
		}
		if cut < le || cut > le && (cut > c || cut%tok != 0 || cut > min(d, MaxShareDemand)/bucket.WholeShare*bucket.Micro(longestPace(bucket.Millis(ttl)))) {
			t.Fatalf("cut %d µ: least %d, capacity %d, demand %d µ/s over %d ms", cut, le, c, d, ttl)
		}
		if others && cut > le && cut > bucket.Permille(c, Share) {
			t.Fatalf("cut %d µ with other agents on the key: above the share cap of the capacity %d µ", cut, c)
		}
		if p := Pace(l, max(cut, 1), share, bucket.Millis(ttl)); p < 0 || p > bucket.Millis(ttl) {
			t.Fatalf("Pace = %d ms, outside [0, %d]", p, ttl)
		}
	})
}

// FuzzSize holds the grant rule to its invariants on any limit and ask: a valid ask is sized
// between its least grant and the capacity, the ample want at least the want; a key with no
// demand takes what waits; direct mode takes what waits without a lease; a regular key's ample
// want is at most any other's; and on a bucket that is not scarce, more demand never sizes a
// smaller lease.
func FuzzSize(f *testing.F) {
	f.Add(int64(100), int64(100), int64(1000), uint64(1_000_000), uint64(1_000_000), uint64(1_000_000), uint64(6_000_000), uint64(1_000_000), false, false)
	// τ = 2.5 s: 15 requests a lifetime is thin, 17.5 is not; the ample want must not fall between
	f.Add(int64(1000), int64(100), int64(1000), uint64(0), uint64(1_000_000), uint64(999_999), uint64(6_000_000), uint64(1_000_000), false, false)
	f.Add(int64(20), int64(100), int64(60_000), uint64(0), uint64(2_000_000), uint64(3_000_000), uint64(15_999_999), uint64(7), false, true)
	f.Fuzz(func(t *testing.T, burst, per, periodMs int64, needed, least, cost, demand, more uint64, regular, scarce bool) {
		l, ok := fuzzLimit(burst, per, periodMs)
		if !ok {
			return
		}
		c := l.Capacity()
		u := bucket.Micro(cost%uint64(c)) + 1
		a := Ask{
			Needed: bucket.Micro(needed % uint64(bucket.MaxExact/2+1)), Least: bucket.Micro(least%uint64(c)) + 1,
			Demand: bucket.Micro(demand % uint64(maxDemand+1)), Regular: regular, Scarce: scarce,
		}
		p, err := Size(l, u, false, a)
		if err != nil {
			t.Fatalf("Size(%+v, cost %d µ, capacity %d µ): %v", a, u, c, err)
		}
		if p.Want < min(c, a.Least) || p.Want > c || p.AmpleWant < p.Want || p.AmpleWant > c || p.TTL != TTL(l) {
			t.Fatalf("Size(%+v, cost %d µ, capacity %d µ) = %+v: out of [least, capacity] or ample below want", a, u, c, p)
		}
		if waits := min(c, max(a.Needed, a.Least)); p.Want < waits {
			t.Fatalf("Size(%+v) = %+v: want below what waits (%d µ)", a, p, waits)
		}
		if a.Demand == 0 && (p.Want != min(c, max(a.Needed, a.Least)) || p.AmpleWant != p.Want) {
			t.Fatalf("no demand: Size(%+v) = %+v, want what waits", a, p)
		}
		d, err := Size(l, u, true, a)
		if err != nil || d.Want != min(c, max(a.Needed, a.Least)) || d.AmpleWant != 0 || d.TTL != 0 {
			t.Fatalf("direct: Size(%+v) = %+v, %v", a, d, err)
		}
		r := a
		r.Regular = true
		if pr, err := Size(l, u, false, r); err != nil || pr.AmpleWant > p.AmpleWant || pr.Want != p.Want {
			t.Fatalf("regular: Size(%+v) = %+v, %v; not regular %+v", r, pr, err, p)
		}
		if !a.Scarce {
			m := a
			m.Demand = min(maxDemand, a.Demand+bucket.Micro(more%uint64(maxDemand+1)))
			pm, err := Size(l, u, false, m)
			if err != nil || pm.Want < p.Want || pm.AmpleWant < p.AmpleWant {
				t.Fatalf("demand %d → %d µ/s: %+v → %+v, %v", a.Demand, m.Demand, p, pm, err)
			}
		}
	})
}
