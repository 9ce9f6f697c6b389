package coordinator

import (
	"errors"
	"fmt"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/lease"
)

// Plan is how one Acquire item is asked of the store: the store grants min(Want, Share‰ of what
// the bucket holds) if at least Min is there, and the lease lives TTL.
type Plan struct {
	Want  bucket.Micro
	Min   bucket.Micro
	Share int64
	TTL   time.Duration
}

// ErrCostAboveCapacity is PlanGrant's error when the minimum of a request exceeds the bucket's
// capacity: no wait can satisfy it (the service answers DENIED, retry never).
var ErrCostAboveCapacity = errors.New("coordinator: cost above the bucket's capacity")

// PlanGrant is the grant rule (docs/leases.md). It is a pure function of the bucket's limit and
// what the agent says:
//
//   - TTL is lease.TTL(limit): a quarter of the time the bucket takes to fill, within
//     [lease.MinTTL, lease.MaxTTL], so leases add at most a quarter burst (or r·MinTTL) to the
//     admission bound C + r·(w + τ).
//   - The lease size is what the agent asks for, at least one request's cost (min), at most the
//     capacity, and at most twice what its reported demand justifies (lease.Want): an agent may
//     grow its lease, not grab a bucket its demand does not explain.
//   - Share is lease.Share: one grant takes at most half of what the bucket holds, never less than
//     min, so when the bucket runs low grants shrink to one request's cost and the denials that
//     follow are accurate.
func PlanGrant(limit bucket.Limit, want, least, demand bucket.Micro) (Plan, error) {
	capacity := limit.Capacity()
	switch {
	case least < 1 || want < 0 || demand < 0:
		return Plan{}, fmt.Errorf("%w: want %d µ, min %d µ, demand %d µ/s", ErrInvalidRequest, want, least, demand)
	case least > capacity:
		return Plan{}, fmt.Errorf("%w: min %d µ, capacity %d µ", ErrCostAboveCapacity, least, capacity)
	}
	ttl := lease.TTL(limit)
	// lease.Want multiplies demand/1000 by up to 3·10^4 ms: clamp what an agent reports so the
	// product stays far below 2^63 (any demand this large justifies the whole capacity anyway).
	justified := lease.Want(min(demand, bucket.MaxExact), ttl, least, capacity)
	w := min(max(want, least), capacity)
	w = min(w, max(least, 2*justified))
	return Plan{Want: w, Min: least, Share: lease.Share, TTL: ttl}, nil
}

// Scarce reports whether a grant should tell the agent to ask for less: the grant was cut below
// what was planned, or the bucket is below a quarter of its capacity after it.
func Scarce(p Plan, limit bucket.Limit, granted, remaining bucket.Micro) bool {
	return granted < p.Want || remaining < limit.Capacity()/4
}
