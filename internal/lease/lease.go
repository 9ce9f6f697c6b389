// Package lease holds the rules both tiers agree on: how long a lease lives and how large one
// should be. The coordinator's grant rule and the agent's lease core both call it, so an agent
// can plan its refills with the lifetime the coordinator will grant.
//
// The numbers trade accuracy for load. A lease of τ adds r·τ to the admission bound
// C + r·(w + τ) (docs/leases.md), so τ is chosen as a fraction of the time the bucket takes to
// refill its burst; a lease sized to the agent's demand over half its lifetime makes Redis see one
// operation per lease instead of one per check.
package lease

import (
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

	// Refills is how many refills a lease should last for: an agent asks for its demand over
	// TTL/Refills, so it refills about Refills times per lease lifetime and a lease is normally spent
	// well before it expires (expired tokens come back decayed, see bucket.State.Return).
	Refills = 2

	// LowWater is the fraction (per mille) of a lease left at which the agent refills ahead of need,
	// so a refill round trip completes before the lease runs dry at the observed rate.
	LowWater = 250

	// InitialShare sizes the first lease of a key (no demand observed yet): 1/16 of the capacity,
	// at least one request's cost. Large enough that a burst does not cost a refill per request,
	// small enough that many agents starting together do not drain the bucket.
	InitialShare = 16
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

// Want is the lease an agent asks for: its demand (µ per second) over TTL/Refills, at least cost
// and at most the capacity. With no demand observed yet it is the capacity over InitialShare.
func Want(demand bucket.Micro, ttl time.Duration, cost, capacity bucket.Micro) bucket.Micro {
	var w bucket.Micro
	if demand <= 0 {
		w = capacity / InitialShare
	} else {
		// demand·ttl/Refills in µ: demand < 2^52 and ttl <= MaxTTL (3·10^4 ms), so demand/1000 * ms
		// stays far below 2^63.
		w = demand / 1000 * bucket.Micro(ttl/time.Millisecond) / Refills
	}
	return min(capacity, max(cost, w))
}
