// Package lease holds the lease rules both tiers agree on: how long a lease lives (TTL), how large
// one is (Size) and how an agent measures the demand that sizes it (Demand). The coordinator's
// grant rule applies Size to what an agent reports; the agent plans its refills with TTL and
// reports its Demand. Nothing else decides how many tokens a lease holds.
//
// The numbers trade accuracy for load. A lease of τ adds r·τ to the admission bound
// C + r·(w + τ) (docs/leases.md), so τ is chosen as a fraction of the time the bucket takes to
// refill its burst; a lease sized to the agent's demand over half its lifetime makes Redis see one
// operation per lease instead of one per check. A key with no measured demand gets what its
// waiting checks need and nothing more, so a key checked less often than a lease lives costs one
// store operation per check, as a limiter without leases would, and leaves nothing to hand back.
// Where the bucket has plenty to spare (Ample), a lease holds the demand over its whole lifetime
// instead of half of it: a key well within its limit asks about once per lifetime rather than
// twice, and a bucket that runs short goes back to the smaller leases.
package lease

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
)

const (
	// Excess bounds what leases add to the admission bound, as a fraction of the burst: τ is at most
	// C/(Excess·r), so r·τ <= C/Excess — a quarter of the burst — unless MinTTL applies.
	Excess = 4

	// MinTTL is the shortest lease: several refill round trips (a few ms each within a region) must
	// fit in one lease, or every check would wait for the coordinator. For a fast rate with a small
	// burst, MinTTL rather than Excess sets the bound's margin: r·MinTTL.
	MinTTL = 200 * time.Millisecond

	// MaxTTL is the longest lease: an agent that dies strands its leases until they expire and the
	// coordinator can no longer count on their return; 30 s bounds that window (and how long a
	// policy change takes to reach every lease).
	MaxTTL = 30 * time.Second

	// Share is the most of what a bucket holds that one grant may take (per mille): one agent cannot
	// drain a bucket other agents need, and grants shrink toward one request's cost as it empties.
	Share = 500

	// Refills is how many refills a lease should last for: a lease holds the agent's demand over
	// TTL/Refills (over TTL where the bucket is ample: Plan.AmpleWant, one refill per lifetime), so
	// the agent refills about Refills times per lease lifetime and a lease is normally spent well
	// before it expires (expired tokens come back decayed, see bucket.State.Return, or not at all).
	Refills = 2

	// LowWater is the fraction (per mille) of a lease left at which the agent refills ahead of need,
	// so a refill round trip completes before the lease runs dry at the observed rate.
	LowWater = 250

	// ThinRequests is the demand below which a key is thin on an agent: fewer than this many
	// requests per lease lifetime. A thin key's checks come a few per lifetime, at random, and a
	// lease sized to them lapses with part of it unspent a good part of the time: at four requests
	// a lifetime a lease of three is not used up in one lifetime out of four. On a bucket with
	// tokens to spare that costs nothing (the refill covers what lapsed); where the bucket is short
	// of tokens (Ask.Scarce, a contended take), every lapsed token is a check refused elsewhere,
	// and the simulator measures it: agents sharing a key at 1.1 times its rate admitted 95.5 % (5
	// agents) and 91.8 % (20 agents) of what the exact limiter admits. There a thin key asks for
	// what its checks need (Size, LowMark), and on a contended bucket takes per check where its
	// share would leave it less than one standard deviation of its arrivals to spare (Contend);
	// the agents admit 99.3 % or more: docs/leases.md, "Thin keys on a scarce bucket".
	ThinRequests = 16
)

// TTL is the lifetime of leases on a bucket of limit l: C/(Excess·r), clamped to
// [MinTTL, MaxTTL]; MaxTTL for a bucket that never refills (nothing to add to any bound).
func TTL(l bucket.Limit) time.Duration {
	if !l.Refills() {
		return MaxTTL
	}
	// C/(Excess·r) is the bucket's fill time over Excess (compared in ms: a fill time of up to
	// 2^45 ms would overflow a Duration).
	ms := int64(l.FillTime()) / Excess
	if ms >= int64(MaxTTL/time.Millisecond) {
		return MaxTTL
	}
	return max(MinTTL, time.Duration(ms)*time.Millisecond)
}

// LowMark is the level below which a lease of tokens refills ahead of need (LowWater of it), or 0,
// never, when its key's demand (µ per second) fills less than one request (unit) per lease
// lifetime ttl, or when the key is thin (Thin) and its bucket scarce (Ask.Scarce). A refill ahead
// of need costs a store operation to spare the next check a round trip; a key that colder would
// seldom see its next check before the refilled lease expired, so the operation would mostly buy
// a lease that lapses unspent, where its next check takes its own (docs/leases.md, "What leases
// cannot save on a long tail"); on a scarce bucket, the tokens of a thin key's lease that lapse
// are tokens other agents' checks were refused.
func LowMark(tokens, demand, unit bucket.Micro, ttl time.Duration, scarce bool) bucket.Micro {
	if overLifetime(demand, ttl) < unit || scarce && Thin(demand, unit, ttl) {
		return 0
	}
	return tokens * LowWater / 1000
}

// Thin reports whether a key's demand on an agent (µ per second) fills fewer than ThinRequests
// requests (unit) per lease lifetime ttl.
func Thin(demand, unit bucket.Micro, ttl time.Duration) bool {
	return thin(overLifetime(demand, ttl), unit)
}

// thin reports whether a demand over a lease's lifetime (µ) is fewer than ThinRequests requests
// (unit): x/n < u ⟺ x < n·u, with no product to overflow (a route's cost may be any positive
// number).
func thin(lifetime, unit bucket.Micro) bool {
	return lifetime/ThinRequests < unit
}

// overLifetime is demand (µ per second) over a lifetime ttl (at most MaxTTL), in µ: below
// 2^52/1000 · 3·10^4 ms < 2^63.
func overLifetime(demand bucket.Micro, ttl time.Duration) bucket.Micro {
	return min(demand, maxDemand) / 1000 * bucket.Micro(ttl/time.Millisecond)
}

// Ask is what an agent tells about one key when it asks for tokens: facts, not a size.
type Ask struct {
	// Needed is the sum of the costs of the checks waiting for this refill; 0 for a refill ahead
	// of need (a prefetch).
	Needed bucket.Micro
	// Least is the smallest grant worth having: the cost of the first waiting check, or one
	// request's cost for a prefetch.
	Least bucket.Micro
	// Demand is the key's rate of use on this agent, µ per second (Demand.Rate); 0 if none was
	// observed yet.
	Demand bucket.Micro
	// Regular: the key's refills come on a regular period longer than its leases live (Gaps), so
	// its next check comes after the lease has lapsed.
	Regular bool
	// Scarce: the bucket's level at the key's last answer was low (Low: below 1/Reserve of its
	// capacity), so tokens a lease leaves unspent are tokens other agents need.
	Scarce bool
}

// Plan is how one Ask is asked of the global bucket: grant min(Want, Share‰ of what the bucket
// holds) if at least Least is there, rounded down to whole Units when it is cut; the lease lives
// TTL (0 in direct mode: the grant is spent on the waiting checks at once and nothing is kept).
// Where the bucket would still be ample after granting AmpleWant (Ample), AmpleWant replaces Want
// (before the contention rule, Contend, which may still cut it).
type Plan struct {
	Want bucket.Micro
	// AmpleWant is Want with the demand over a whole lifetime instead of TTL/Refills, rounded up
	// to whole requests: at least Want; 0 in direct mode.
	AmpleWant bucket.Micro
	Least     bucket.Micro
	Unit      bucket.Micro
	Share     int64
	TTL       time.Duration
}

// Errors of Size.
var (
	// ErrInvalidAsk: amounts out of range.
	ErrInvalidAsk = errors.New("lease: invalid ask")
	// ErrCostAboveCapacity: the least grant exceeds the bucket's capacity; no wait can satisfy it.
	ErrCostAboveCapacity = errors.New("lease: cost above the bucket's capacity")
)

// maxDemand bounds a reported demand (µ per second): Size multiplies demand/1000 by up to 3·10^4
// ms, which must stay far below 2^63; any demand this large justifies the whole capacity anyway.
const maxDemand = bucket.MaxExact / 2

// Size is the grant rule (docs/leases.md, "The grant rule"), the one place a lease's size is
// decided. cost is one request of the route (the unit a lease is counted in); direct is the rule's
// lease: off.
//
//   - Direct mode: exactly what the waiting checks need, at least the first one's cost, without
//     the share cap (the waiting checks are the whole demand): each check is one atomic take.
//   - Leases: what the waiting checks need plus the key's demand over TTL/Refills, in whole
//     requests rounded down — a key whose demand does not fill one request per half lifetime
//     gets no lease beyond its waiting checks, so it has nothing to hand back — at most the
//     capacity. The store caps the grant at Share‰ of what it holds (never below Least), so one
//     agent cannot drain a bucket others need, and grants shrink toward one request's cost as it
//     runs low.
//   - AmpleWant: the same with the demand over the whole lifetime rounded up to whole requests
//     (a key with any demand gets at least one request besides its waiting checks), granted
//     instead of Want where the bucket stays ample (Ample). A lease of a lifetime's demand
//     strands twice the tokens when its agent dies or its key goes quiet, which matters only on
//     a bucket short of them; on one with plenty to spare it halves a steady key's store
//     operations, and the request rounded up serves a key checked about once a lifetime without
//     a take of its own (unspent, it is dropped once the refill since its grant covers it, within
//     the lifetime unless τ is cut to MaxTTL; only then is it handed back). A thin key's (Thin)
//     lifetime demand also gets its spread (one standard deviation of a Poisson count of it,
//     spread), up to ThinRequests: checks at random bunch, and with a lease of the mean alone
//     a lifetime with more checks than the mean ends in a take for each extra one, where the
//     tokens a larger lease leaves unspent cost nothing on a bucket this full (the simulator's
//     overload scenario: 8 % fewer store operations). Not for a Regular key: its next check
//     always comes after the lease lapsed, so its lifetime's demand is rounded down, as in Want.
//   - A thin key (Thin) whose bucket is scarce (Ask.Scarce): Want and AmpleWant are what its
//     waiting checks need and nothing more, as for a key with no measured demand. A lease of its
//     demand would be a request or two that lapse unspent a good part of the time, and on a
//     scarce bucket each lapsed token is a check refused elsewhere.
func Size(limit bucket.Limit, cost bucket.Micro, direct bool, a Ask) (Plan, error) {
	capacity := limit.Capacity()
	switch {
	case a.Least < 1 || a.Needed < 0 || a.Demand < 0 || cost < 1 || a.Needed > bucket.MaxExact/2:
		return Plan{}, fmt.Errorf("%w: needed %d µ, least %d µ, demand %d µ/s, cost %d µ", ErrInvalidAsk, a.Needed, a.Least, a.Demand, cost)
	case a.Least > capacity:
		return Plan{}, fmt.Errorf("%w: least %d µ, capacity %d µ", ErrCostAboveCapacity, a.Least, capacity)
	}
	p := Plan{Least: a.Least, Unit: cost, Share: bucket.WholeShare}
	if direct {
		p.Want = min(capacity, max(a.Needed, a.Least))
		return p, nil
	}
	p.TTL, p.Share = TTL(limit), Share
	lifetime := overLifetime(a.Demand, p.TTL)
	if a.Scarce && thin(lifetime, cost) {
		lifetime = 0
	}
	p.Want = grow(capacity, cost, a, lifetime/Refills)
	ample := min(lifetime, capacity)
	if !a.Regular {
		if thin(lifetime, cost) {
			ample = min(ample+spread(lifetime, cost), thinLease(capacity, cost))
		}
		ample = roundUp(ample, cost, capacity)
	}
	p.AmpleWant = grow(capacity, cost, a, ample) // grow rounds a Regular key's down
	return p, nil
}

// spread is one standard deviation of the checks a thin key's lease meets in its lifetime, in µ:
// for a key checked at random (Poisson) at lifetime/cost requests per lifetime, cost·√(lifetime/cost)
// = √(lifetime·cost), formed in floating point (the product may pass 2^63) and rounded down; below
// 2^58 for a lifetime under 2^53 and any cost.
func spread(lifetime, cost bucket.Micro) bucket.Micro {
	return bucket.Micro(math.Sqrt(float64(lifetime)) * math.Sqrt(float64(cost)))
}

// thinLease is ThinRequests requests of cost, at most capacity (without forming a product past it).
func thinLease(capacity, cost bucket.Micro) bucket.Micro {
	if cost > capacity/ThinRequests {
		return capacity
	}
	return ThinRequests * cost
}

// roundUp is size (0..capacity) rounded up to a multiple of cost, at most capacity (without
// forming a sum past it: a route's cost may be any positive number).
func roundUp(size, cost, capacity bucket.Micro) bucket.Micro {
	r := size % cost
	switch {
	case r == 0:
		return size
	case cost-r > capacity-size:
		return capacity
	default:
		return size + cost - r
	}
}

// grow is what a's waiting checks need plus size in whole requests (rounded down), at least a's
// least grant and at most the capacity.
func grow(capacity, cost bucket.Micro, a Ask, size bucket.Micro) bucket.Micro {
	size = min(size, capacity)
	size -= size % cost
	return min(capacity, max(a.Least, a.Needed+size))
}

// Ample reports whether a bucket of limit l holding tokens would still hold at least
// 1 − 1/Reserve of its capacity after a grant of want: plenty to spare, so a larger lease takes
// nothing another agent needs (the mirror of Low). The store grants Plan.AmpleWant then.
func Ample(l bucket.Limit, tokens, want bucket.Micro) bool {
	return tokens-want >= l.Capacity()-l.Capacity()/Reserve // tokens, want < 2^53: no overflow
}

// Demand estimates a key's rate of use on one agent from samples taken at its refills. A sample
// spans at least MinSample, so a burst of a few requests in a millisecond does not read as a rate
// of thousands per second; a key idle for longer than IdleAfter starts afresh, so a lease shrinks
// as soon as its key goes quiet. The zero value has observed nothing.
type Demand struct {
	rate bucket.Micro // µ per second; 0 until a sample closed
}

const (
	// MinSample is the shortest window a demand sample is measured over.
	MinSample = 100 * time.Millisecond
	// IdleAfter is how long a sample may span and still average with the estimate: a longer one
	// replaces it.
	// Two seconds is longer than the leases of most buckets (τ is a quarter of the fill time) and
	// short enough that a key that went quiet gets small leases at its next check.
	IdleAfter = 2 * time.Second
)

// Rate is the estimate, µ per second.
func (d *Demand) Rate() bucket.Micro { return d.rate }

// Observe closes a sample of used µ over elapsed and returns the new estimate. The caller keeps
// the sample open (and does not call Observe) while elapsed < MinSample.
func (d *Demand) Observe(used bucket.Micro, elapsed time.Duration) bucket.Micro {
	s := PerSecond(used, elapsed)
	if d.rate == 0 || elapsed >= IdleAfter {
		d.rate = s
	} else {
		d.rate = (d.rate + s) / 2
	}
	return d.rate
}

// PerSecond is used µ over elapsed as µ per second, at most maxDemand. The product used·10^9
// passes 2^63 once a key spends 9,223 tokens between two samples (a hot key does), hence 128 bits.
func PerSecond(used bucket.Micro, elapsed time.Duration) bucket.Micro {
	if used <= 0 {
		return 0
	}
	if elapsed <= 0 {
		return maxDemand
	}
	hi, lo := bits.Mul64(uint64(used), uint64(time.Second))
	if hi >= uint64(elapsed) {
		return maxDemand
	}
	q, _ := bits.Div64(hi, lo, uint64(elapsed))
	return bucket.Micro(min(q, uint64(maxDemand)))
}

// Contention: when a bucket runs low (a take would leave it below a quarter of its capacity,
// Reserve) and its agents' demand is at least what it refills and holds (the key is overloaded),
// the agents compete for what it refills (and keep competing while it stays overloaded). What it
// holds counts because of buckets that refill slowly: on a day's budget, whose lease lifetime is
// cut to MaxTTL, any demand is more than a lifetime's refill, yet what it holds covers its agents'
// demand for a long while, and pacing them would refuse checks it could serve. A contended take is
// cut to the agent's share of the key's demand (its reported demand over the sum of the demands
// the bucket's agents reported within FreshLeases lifetimes) of what the bucket refilled since
// the agent last took (about a lifetime) plus what it holds, and the agent is told to wait (the
// pace) until its share of the refill has covered what it got, and at least the
// others' share of a lifetime, before it asks again: each competing agent asks about once per
// lifetime and gets its share, so the bucket's refill goes where the demand is, store operations
// stay at one per agent and lifetime, and no agent retries a bucket others have just emptied. A
// low bucket whose demand is below its rate is refilling: nothing is cut or paced, and its agents
// keep their leases sized to their demand. The store applies the rule (it alone sees every
// agent's demand) with the arithmetic below; the share cap (Share) bounds the agent's share.
const (
	// FreshLeases is how long, in lease lifetimes, an agent's reported demand counts in a
	// contended bucket's total: a competing agent asks about once per lifetime.
	FreshLeases = 2

	// MaxShareDemand bounds a demand in the share arithmetic, so that demand·1000 stays below
	// 2^53 (in Redis' Lua doubles too): 8.8·10^12 µ/s, 8.8 million tokens a second.
	MaxShareDemand = bucket.Micro(1) << 43

	// Reserve: a take that would leave the bucket below 1/Reserve of its capacity finds it low
	// (Low), and the store looks at the key's demand. A bucket whose agents' demand is below its
	// rate stays above it (their leases are a small part of it).
	Reserve = 4
)

// Low reports whether a take of want would leave a bucket of limit l holding tokens below
// 1/Reserve of its capacity: the condition under which the store looks at the key's demand.
func Low(l bucket.Limit, tokens, want bucket.Micro) bool {
	return tokens-want < l.Capacity()/Reserve // tokens, want < 2^53: no overflow
}

// Contend is the contention rule for a take of want (at least least, whole units of unit) by an
// agent reporting demand, on a bucket holding tokens, whose agents' fresh demands sum to total
// (this agent's included; each clamped to MaxShareDemand); others says another agent took from
// the bucket within FreshLeases lifetimes (whether or not it reported demand); ttl is the lease
// lifetime; since is the time since this agent last took (0 if it never did); competing says a
// take of the key was contended within the last FreshLeases lifetimes. It returns the want to
// take and the agent's share in permille; contended is false (want unchanged) when the bucket is
// not low (Low) and its agents are not competing, the key is not overloaded (its demand over a
// lifetime is below what the bucket refills in it plus what it holds), the plan keeps no lease
// (ttl 0: direct mode) or the agent reported no demand. Once its agents compete, a key stays
// under the rule while it is overloaded, above the low mark too: a bucket that drifted above it
// but holds less than its agents' demand over a lifetime (beyond the refill) would otherwise hand
// whole leases to some while the others wait their turn.
//
// A contended agent whose demand over a lifetime, m requests, would exceed its cut by less than
// √m takes per check instead (perCheck): the cut is least, what its first waiting check needs,
// and the grant does not pace it (Pace). Its checks arrive at random, m a lifetime on average and
// √m either way, so a lease of nearly m lapses partly unspent in a good part of its lifetimes,
// and on a contended bucket each token it lets lapse is a check refused on another agent; a pace
// would refuse its own checks while the bucket holds their tokens. Taking per check, the agents'
// checks take from the bucket first come, first served, as the exact limiter admits them. Only a
// thin agent (fewer than ThinRequests requests a lifetime) ever does: the cut is at most three
// quarters of m, which leaves √m or more once m is 16. A denial paces it like any other agent, so
// agents taking per check do not all ask an empty bucket again each time it refills a request.
func Contend(l bucket.Limit, tokens, want, least, unit, demand, total bucket.Micro, others bool, ttl, since bucket.Millis, competing bool) (cut bucket.Micro, share int64, contended, perCheck bool) {
	if ttl <= 0 || demand <= 0 || want <= 0 || !(competing || Low(l, tokens, want)) {
		return want, 0, false, false
	}
	d := min(demand, MaxShareDemand)
	total = max(d, min(total, MaxShareDemand))
	// total/1000 < 2^34, ttl <= 3·10^4 ms: the demand over a lifetime stays below 2^49.
	if total/bucket.WholeShare*bucket.Micro(ttl) < l.Refilled(ttl)+max(0, tokens) {
		return want, 0, false, false // not overloaded: what it refills and holds covers a lifetime's demand
	}
	share = int64(d) * bucket.WholeShare / int64(total) // d·1000 < 2^53
	// Its share of what refilled since it last took (a lifetime if it never did or long ago, at
	// most FreshLeases lifetimes): an agent that asks a little later than its pace gets that much
	// more, so the competing agents together take what the bucket refills.
	if since <= 0 || since > FreshLeases*ttl {
		since = ttl
	}
	// And its share of what the bucket holds: the competing agents also share out what the bucket
	// held when they began to compete (a bucket that runs low holds up to a lifetime's refill,
	// C/Reserve = r·τ), rather than keep it there while their demand is refused — each take
	// hands out a share of it, so it drains within a few lifetimes, as a bucket that admitted
	// every check would. The sum is capped at the capacity (both terms are at most it).
	refill := l.Refilled(since)
	pool := l.Capacity()
	if refill <= pool-tokens {
		pool = max(0, refill+tokens) // a bucket in debt (tokens < 0) may have nothing to share
	}
	// Where other agents took too, a share above the share cap (Share) counts as the cap: an agent
	// whose share reads as more than half may be the only one whose demand was measured yet (an
	// agent reports its demand from its first closed sample, MinSample after its first check), and
	// a take of the whole stock would leave the others' next checks nothing to draw on — on a
	// bucket that refills slowly, for as long as it takes to refill. It is still paced with its
	// whole share. An agent alone on the key gets its whole share: half would leave it paced while
	// the bucket holds the other half.
	most := share
	if others {
		most = min(share, Share)
	}
	fair := bucket.Permille(pool, most)
	// The lease is that share, whatever the agent asked for (it asked for its demand over half a
	// lifetime, as an uncontended agent refills twice a lifetime; a competing one asks about once),
	// but never more than its demand until it asks again (at most the longest pace, three quarters
	// of a lifetime): what it has not spent by then goes back with its next take, credited less
	// the refill since it was granted (bucket.State.Return) — on a bucket that refills a lifetime's
	// worth in a lifetime, about nothing. d/1000 < 2^34, ttl <= 3·10^4 ms.
	fair = min(fair, d/bucket.WholeShare*bucket.Micro(longestPace(ttl)))
	u := max(1, unit)
	fair -= fair % u
	// Per check where m − cut < √m, in whole requests (m < ThinRequests, so the square is small).
	if m := d / bucket.WholeShare * bucket.Micro(ttl) / u; m < ThinRequests {
		if left := m - fair/u; left*left < m {
			return least, share, true, true
		}
	}
	return max(least, fair), share, true, false
}

// longestPace is the longest an agent is paced: until a lease sized to its demand over its
// lifetime is down to its low water (LowWater), three quarters of the lifetime; the agent's grant
// is at most its demand over it.
func longestPace(ttl bucket.Millis) bucket.Millis {
	return ttl - bucket.Millis(int64(ttl)*LowWater/bucket.WholeShare)
}

// Pace is how long an agent whose share is share‰ waits after a contended take that got
// amount (or, denied, would need amount) before it asks again: until its share of the bucket's
// refill has covered amount, and at least the others' share of a lifetime ttl (that spaces the
// competing agents' asks about a lifetime apart: asked sooner, a bucket the others share holds
// less than any one's share of a lifetime, and the agents would settle on asking often for
// little) and half a lifetime (ttl/Refills: an agent whose share is most of the key asks no more
// often than an uncontended one; without it, an agent alone on a key over its rate would keep
// the cadence of its first contended take, whose refill may be a few milliseconds', and ask that
// often for that little), at most until what it got is down to its low water (LowWater) at its
// demand: three quarters of ttl.
func Pace(l bucket.Limit, amount bucket.Micro, share int64, ttl bucket.Millis) bucket.Millis {
	longest := longestPace(ttl)
	tf := l.TimeFor(amount)
	if share <= 0 || tf >= ttl {
		return longest
	}
	// tf < ttl <= MaxTTL in ms, so tf·1000 and ttl·1000 are far below 2^53.
	own := bucket.Millis((int64(tf)*bucket.WholeShare + share - 1) / share)
	floor := max(bucket.Millis(int64(ttl)*(bucket.WholeShare-share)/bucket.WholeShare), ttl/Refills)
	return min(longest, max(own, floor))
}
