package agent

import (
	"sync"
	"sync/atomic"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/policy"
)

// entry is one bucket key as this agent sees it: the current lease, spent without a lock; a
// prefetched next lease; the deny cache; the failure state; the emergency bucket.
//
// Invariants: tokens >= 0 and no token is spent twice (spends are compare-and-swap decrements;
// retiring a lease swaps tokens to 0 before its unspent amount is returned, so nothing is spent
// after it is returned). The current lease is used only while now < expires, and expires is the
// moment the Acquire was sent plus the lease's TTL minus the clock guard: network delay can only
// shorten a lease.
type entry struct {
	// Hot: read and written by Check without a lock. tokens and expires share a cache line.
	tokens      atomic.Int64 // µ left in the current lease
	expires     atomic.Int64 // clock.Nanos: the current lease is usable while now < expires
	lowWater    atomic.Int64 // µ: below this, refill ahead of need
	deniedUntil atomic.Int64 // clock.Nanos: the coordinator denied; answer locally until then
	// remaining is the global bucket's level after this agent's last grant plus the prefetched
	// lease, in µ (for the remaining count a response carries, with the current lease's tokens).
	remaining atomic.Int64
	// refilling is set while a refill is queued (queued), in flight (inflight), or put off because
	// a prefetched lease waits in next; it keeps checks below the low water from queueing another.
	refilling atomic.Bool
	touched   atomic.Bool // used since the eviction hand last passed (CLOCK)
	dead      atomic.Bool // removed from the table
	route     uint32

	// Identity, immutable after insert.
	hash   uint64
	tenant string
	lim    *policy.Limits
	rule   *policy.Rule
	view   *view

	// mu guards the rest.
	mu        sync.Mutex
	grantedAt bucket.Millis // store clock of the current lease's grant, echoed by Return
	next      grant         // a prefetched lease waiting for the current one to run out
	wantMin   bucket.Micro  // the largest cost waiting for this refill
	done      chan struct{} // closed when the in-flight refill completes; nil if nobody waits
	// Demand: µ per second, a moving average of samples taken at each refill. acct is the level
	// held at the last sample plus what was installed and minus what was retired since, so
	// acct - level now is what was spent.
	demand    bucket.Micro
	acct      bucket.Micro
	sampledAt clock.Nanos
	sampled   bool
	scarce    bool   // the coordinator said the bucket is low: ask for less
	queued    bool   // in the Limiter's refill queue
	inflight  bool   // an Acquire for this entry is out
	fail      *fails // nil until a refill of this key fails
}

// fails is the failure state of an entry, allocated when a refill first fails (most keys never
// need it, and every byte of an entry counts a million times).
type fails struct {
	until       clock.Nanos // the global state was unreachable; failure mode until then
	count       int         // consecutive refill failures (backoff)
	emergency   bucket.State
	emergencyOn bool
	// An Acquire of this key failed after it may have been applied (a timeout, a connection
	// lost, the store timing out): its seq and send time. The key's next refill sends that seq
	// again (resendable), so the coordinator answers from its record what Redis granted.
	lostSeq    uint64
	lostSentAt clock.Nanos
}

// grant is a lease not yet installed as the current lease.
type grant struct {
	tokens    bucket.Micro
	expires   clock.Nanos
	grantedAt bucket.Millis
}

// spend takes cost from the current lease if it is live and holds enough.
func (e *entry) spend(now clock.Nanos, cost int64) (left int64, ok bool) {
	if int64(now) >= e.expires.Load() {
		return 0, false
	}
	for {
		t := e.tokens.Load()
		if t < cost {
			return t, false
		}
		if e.tokens.CompareAndSwap(t, t-cost) {
			return t - cost, true
		}
	}
}

// retireLocked ends the current lease: no token of it can be spent afterwards. It returns the
// unspent amount and its grant time. e.mu is held.
func (e *entry) retireLocked() (unspent bucket.Micro, grantedAt bucket.Millis) {
	unspent = bucket.Micro(e.tokens.Swap(0))
	e.expires.Store(0)
	e.acct -= unspent
	return unspent, e.grantedAt
}

// installLocked makes l the current lease. The caller retired the previous one. e.mu is held.
func (e *entry) installLocked(l grant) {
	e.grantedAt = l.grantedAt
	// expires before tokens: a spender that sees the new tokens also sees the new expiry.
	e.expires.Store(int64(l.expires))
	e.tokens.Store(int64(l.tokens))
	e.lowWater.Store(int64(l.tokens) * lease.LowWater / 1000)
}

// setNextLocked replaces the prefetched lease. remaining counts the prefetched lease (it is this
// agent's until it is installed or returned), so it changes by the difference. e.mu is held.
func (e *entry) setNextLocked(n grant) {
	e.remaining.Add(int64(n.tokens - e.next.tokens))
	e.next = n
}

// cost is one request of the entry's route, in µ (the rule's cost for the route's operation).
func (e *entry) cost() bucket.Micro {
	return bucket.Micro(e.view.set.Cost(e.view.set.RouteByID(e.route))) * bucket.PerToken
}

// usableLocked reports whether the current lease can serve cost at now.
func (e *entry) usableLocked(now clock.Nanos, cost int64) bool {
	return int64(now) < e.expires.Load() && e.tokens.Load() >= cost
}

// prefetchDoneLocked ends a prefetch whose lease has left the next slot (installed or dropped): the
// next low water may queue another one, unless an Acquire for this entry is still out.
func (e *entry) prefetchDoneLocked() {
	if !e.inflight && !e.queued {
		e.refilling.Store(false)
	}
}

// wakeLocked releases the checks waiting for this entry's refill.
func (e *entry) wakeLocked() {
	if e.done != nil {
		close(e.done)
		e.done = nil
	}
}
