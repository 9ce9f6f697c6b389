package sim

import (
	"fmt"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/lease"
)

// identity is one limited identity — a (rule, route, operation, tenant) — and its oracle: one
// exact bucket that sees every request with no delay, what a perfect limiter would admit. For a
// regional rule the oracle's bucket is the whole quota, the sum of the region slices: the cost of
// slicing shows as allowed below ideal.
type identity struct {
	name   string // rule route operation tenant
	tenant string
	rule   string
	limit  bucket.Limit
	ideal  bucket.State
	rule32 int32    // index in world.rules
	counts []Counts // by the region the checks arrived in
}

// admit runs the ideal limiter on one request of cost µ at ms and reports whether it admits it.
func (id *identity) admit(ms bucket.Millis, cost bucket.Micro) bool {
	return id.ideal.Take(id.limit, ms, cost, cost).Granted > 0
}

// key is one bucket key of the global state: where it lives, its limit and the bound checks.
type key struct {
	idx   int32
	name  string
	store int // index in world.stores
	limit bucket.Limit
	ttl   time.Duration // the lease lifetime τ; 0 for a rule with lease: off
	// lag is the longest a spend can come after the take it spends: τ for a lease; in direct mode
	// (lease: off) the longest a check waits (agent.max_wait), as a direct grant serves only
	// checks that were waiting when its Acquire was sent and its answer comes before their wait
	// ends.
	lag time.Duration
	// Bounds of DESIGN §5 as excesses over what the bucket refills in the window (window excess,
	// see drawup): admission ≤ C + r·(lag + 1 ms), budget ≤ C + r·1 ms + max_debt (grants and
	// debts less credits). The 1 ms is the key clock's resolution (the store clock is in ms, the
	// agents' in ns).
	admitBound  float64
	budgetBound float64
	rate        float64 // µ per ns
	admitted    drawup  // µ spent from leases of this key, by all agents
	budget      drawup  // µ granted minus µ credited
	// Where the key's tokens are, for false denies: level mirrors the bucket as of the store's
	// last answer on the key (refilled to now with the same arithmetic), leased is what live
	// agents hold of it (granted and applied, less spent, returned and taken down by a crash).
	level  bucket.State
	leased int64 // µ
	// The key's 429s and the tokens it wasted, matched into false denies at the end of the run
	// (falsedeny.go).
	denials  []denial
	wastes   []waste
	ops      int64 // store operations (Take and Return items) on the key
	opsWarm  int64 // ops when the warm-up ended
	grants   int64
	granted  int64 // µ
	returned int64 // µ sent back
	spent    int64 // µ
	// Costs settled after the response (settle.go): charged is what leases spent (net of
	// estimates given back) plus what the store debited as debt, whose window excess is at most
	// debtBound = admitBound + max_debt; lowest is the lowest level the store answered (µ).
	settled      bool // checks of settled traffic use the key
	maxDebt      int64
	debtBound    float64
	charged      drawup
	chargedTotal int64
	debited      int64
	lowest       int64
}

// newKey is a bucket key of a leased rule (see direct for lease: off).
func newKey(name string, store int, l bucket.Limit, maxDebt bucket.Micro) *key {
	k := &key{name: name, store: store, limit: l, ttl: lease.TTL(l), level: bucket.Full(l, 0), maxDebt: int64(maxDebt)}
	k.lag = k.ttl
	num, den := l.Rate()
	k.rate = float64(num) / float64(den) / 1e6
	k.bounds()
	return k
}

// direct makes k a key of a rule with lease: off: no lease lives, and a spend comes at most
// maxWait after its take, so the admission bound is C + r·(w + maxWait + 1 ms).
func (k *key) direct(maxWait time.Duration) {
	k.ttl, k.lag = 0, maxWait
	k.bounds()
}

// lagText names the lag in a violation: τ, or the wait of a rule with lease: off.
func (k *key) lagText() string {
	if k.ttl == 0 {
		return fmt.Sprintf("lease: off, τ = the longest wait %s", k.lag)
	}
	return fmt.Sprintf("τ = %s", k.ttl)
}

// bounds sets the bounds from the limit, the lag and max_debt.
func (k *key) bounds() {
	maxDebt := k.maxDebt
	c := float64(k.limit.Capacity())
	k.admitBound = c + k.rate*float64(k.lag+time.Millisecond)
	k.budgetBound = c + k.rate*float64(time.Millisecond) + float64(maxDebt)
	k.debtBound = k.admitBound + float64(maxDebt)
}

// available reports whether cost µ of the key sat somewhere at ms: in the bucket or in a live
// agent's lease (a denial then was answered while tokens were held elsewhere).
func (k *key) available(ms bucket.Millis, cost int64) bool {
	s := k.level
	s.Refill(k.limit, ms)
	return int64(s.Tokens)+k.leased >= cost
}

// drawup is the largest excess of a series of amounts over what the bucket refills: over all
// windows [a, b], the amount in the window minus r·(b − a). A token bucket's bounds "at most
// C + r·w in any window of length w" say exactly that this excess is at most C; it is kept in
// O(1) per event by d = max(0, d − r·Δt) + x (the excess of the best window ending now), so the
// checks cover every window, after every event. Times that run backwards (two agents' batches
// of one tick interleave) refill nothing, which only makes the check stricter.
type drawup struct {
	last  int64   // ns of the last event
	d     float64 // the excess of the best window ending at last
	start int64   // where that window starts
	max   float64 // the largest excess seen
}

// add records amount x (µ, negative for a credit) at t and returns the excess now.
func (u *drawup) add(t int64, x, rate float64) float64 {
	if t > u.last {
		u.d -= rate * float64(t-u.last)
		u.last = t
	}
	if u.d <= 0 {
		u.d, u.start = 0, t
	}
	u.d += x
	if u.d < 0 {
		u.d = 0
	}
	u.max = max(u.max, u.d)
	return u.d
}

// tolerance absorbs float rounding of the excess (µ; the bounds are millions of µ).
const tolerance = 1
