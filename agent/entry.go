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
// prefetched next lease; the checks waiting for a refill; the lease to hand back; the deny cache;
// the failure state; the emergency bucket.
//
// Invariants: tokens >= 0 and no token is spent twice (spends are compare-and-swap decrements;
// retiring a lease swaps tokens to 0 before its unspent amount is handed back, so nothing is spent
// after it is returned). The current lease is used only while now < expires, and expires is the
// moment the Acquire was sent plus the lease's TTL minus the clock guard: network delay can only
// shorten a lease. A direct entry (lease: off) never holds a lease: every grant goes to the
// checks waiting for it.
type entry struct {
	// Hot: read and written by Check without a lock. tokens and expires share a cache line.
	tokens      atomic.Int64 // µ left in the current lease
	expires     atomic.Int64 // clock.Nanos: the current lease is usable while now < expires
	lowWater    atomic.Int64 // µ: below this, refill ahead of need
	deniedUntil atomic.Int64 // clock.Nanos: the coordinator denied; answer locally until then
	// remaining is what a response reports beyond the current lease: the prefetched lease plus the
	// global level the last answer reported, in µ (setRemainingLocked keeps it).
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
	unit   bucket.Micro // one request of the route: the unit leases are counted in

	// mu guards the rest.
	mu        sync.Mutex
	grantedAt bucket.Millis // store clock of the current lease's grant, echoed when it is handed back
	recvAt    clock.Nanos   // when the current lease's grant arrived
	level     bucket.Micro  // the global bucket's level in the last answer
	// slow holds what only a refill in play uses (a prefetched lease, unspent leases to hand back,
	// waiting checks); nil when there is none of it, as for most keys of a large table most of
	// the time (slowState).
	slow *slowState
	// Demand: acct is the level held at the last sample plus what was granted and minus what was
	// handed back since, so acct - level now is what was spent; refused is what the checks
	// refused over the limit (denied or paced) since asked for: the demand counts both, so a key
	// over its limit reports what its clients ask, not what it was given.
	demand    lease.Demand
	acct      bucket.Micro
	refused   bucket.Micro
	sampledAt clock.Nanos
	sampled   bool
	queued    bool // in the Limiter's refill queue
	inflight  bool // an Acquire for this entry is out
	backed    bool // in the Limiter's hand-back queue
	returning bool // a hand-back of this key is out in a call: the next waits for its answer (the store would find it stale if it overtook this one)
	armed     bool // in its shard's armed list: the expiry sweep visits it (unlock arms it)
	// gaps between the demand samples (two bytes, in the padding): a key checked on a regular
	// period longer than its leases live says so in its refills (AcquireItem.regular)
	gaps lease.Gaps
	fail *fails // nil until a refill of this key fails
	// links are the entries a check of this key's route charges besides it (charges.go), found
	// once and kept while they live; nil for most keys.
	links atomic.Pointer[chargeLinks]
}

// chargeLinks are the other entries of a check of several buckets, in the route's charge order.
type chargeLinks struct {
	n int
	e [policy.MaxCharges]*entry
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
	lostDebt   bucket.Micro // the debt that Acquire carried: its resend carries the same
}

// grant is a lease not yet installed as the current lease.
type grant struct {
	tokens    bucket.Micro
	expires   clock.Nanos
	grantedAt bucket.Millis
	recvAt    clock.Nanos
}

// slowState is the part of an entry's state that only a refill in play uses. It lives beside the
// entry, allocated when first needed and dropped once empty (trimLocked), so an entry of a key
// with nothing in play stays small: the lease table holds up to a million of them.
type slowState struct {
	next    grant     // a prefetched lease waiting for the current one to run out
	back    handBack  // unspent leases to hand back
	waiting []*Ticket // checks waiting for a refill, first come first served
	// debt is cost settled beyond an estimate that no lease held, µ, for the key's next call;
	// debtOut is the debt that call carries, until its answer (settle.go). The settles waiting
	// for their debt's debit go with it, in order.
	debt, debtOut        bucket.Micro
	debtWait, debtOutFor []*debtWaiter
	debtOnly             bool // queued for its debt alone (oweLocked), not for a refill
}

// noSlow is what s reads for an entry without slow state. It is never written.
var noSlow slowState

// s is the entry's slow state for reading: the empty one when it has none. e.mu is held.
func (e *entry) s() *slowState {
	if e.slow != nil {
		return e.slow
	}
	return &noSlow
}

// sw is the entry's slow state for writing, allocated if it has none. e.mu is held.
func (e *entry) sw() *slowState {
	if e.slow == nil {
		e.slow = &slowState{}
	}
	return e.slow
}

// trimLocked drops the slow state once it holds nothing. e.mu is held; unlock calls it, so every
// change under the lock ends with it.
func (e *entry) trimLocked() {
	if s := e.slow; s != nil && s.next.tokens == 0 && s.back.amount == 0 && len(s.waiting) == 0 && s.debt == 0 && s.debtOut == 0 &&
		len(s.debtWait) == 0 && len(s.debtOutFor) == 0 {
		e.slow = nil
	}
}

// unlock releases e.mu, first dropping the slow state if it holds nothing, and arming the entry
// for the expiry sweep if it now holds something (every change under the lock ends here).
func (e *entry) unlock() {
	e.trimLocked()
	if !e.armed && e.holdsLocked() && e.view != nil && !e.dead.Load() {
		e.armed = true
		e.view.table.arm(e)
	}
	e.mu.Unlock()
}

// holdsLocked reports whether the expiry sweep may have to act on e: it has a lease (expired
// or not) or slow state (a prefetched lease, a hand-back, waiting checks, a debt). e.mu is held.
func (e *entry) holdsLocked() bool { return e.slow != nil || e.expires.Load() != 0 }

// wait queues t for the entry's refill. e.mu is held.
func (e *entry) wait(t *Ticket) {
	s := e.sw()
	s.waiting = append(s.waiting, t)
}

// dropWaiting removes the first n waiting checks (decided). e.mu is held.
func (e *entry) dropWaiting(n int) {
	if s := e.slow; s != nil && n > 0 {
		s.waiting = dropFront(s.waiting, n)
	}
}

// unwait removes t from the waiting checks, if it is there. e.mu is held.
func (e *entry) unwait(t *Ticket) {
	s := e.slow
	if s == nil {
		return
	}
	for i, w := range s.waiting {
		if w == t {
			s.waiting = append(s.waiting[:i], s.waiting[i+1:]...)
			break
		}
	}
}

// clearBack forgets the unspent leases to hand back (sent, or not worth sending). e.mu is held.
func (e *entry) clearBack() {
	if e.slow != nil {
		e.slow.back = handBack{}
	}
}

// handBack is what an entry has to hand back: the unspent tokens of leases it retired, credited
// as the oldest of them (grantedAt; recvAt is when that one arrived).
type handBack struct {
	amount    bucket.Micro
	grantedAt bucket.Millis
	recvAt    clock.Nanos
}

// add merges the unspent tokens of a lease granted at grantedAt (arrived at recvAt). Two leases
// go back as one, credited as of the older grant: a + b less the refill since t1. That can be more
// than the two apart ((a less the refill since t1) + (b less the refill since t2)), and is still
// sound: had both sat in the bucket from their grants, the cap would have stopped at most the
// refill since t1 of them, so they would hold at least a + b less it (docs/leases.md, returns).
func (b *handBack) add(amount bucket.Micro, grantedAt bucket.Millis, recvAt clock.Nanos) {
	if amount <= 0 {
		return
	}
	if b.amount == 0 || grantedAt < b.grantedAt {
		b.grantedAt, b.recvAt = grantedAt, recvAt
	}
	b.amount += amount
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

// retireLocked ends the current lease: no token of it can be spent afterwards. Its unspent tokens
// are to be handed back (the caller decides whether they are worth it). e.mu is held.
func (e *entry) retireLocked() grant {
	g := grant{tokens: bucket.Micro(e.tokens.Swap(0)), expires: clock.Nanos(e.expires.Swap(0)), grantedAt: e.grantedAt, recvAt: e.recvAt}
	e.acct -= g.tokens
	return g
}

// installLocked makes l the current lease. The caller retired the previous one. e.mu is held.
func (e *entry) installLocked(l grant) {
	e.grantedAt, e.recvAt = l.grantedAt, l.recvAt
	// expires before tokens: a spender that sees the new tokens also sees the new expiry.
	e.expires.Store(int64(l.expires))
	e.tokens.Store(int64(l.tokens))
	e.lowWater.Store(int64(lease.LowMark(l.tokens, e.demand.Rate(), e.unit, lease.TTL(e.lim.Bucket), e.scarceLocked())))
}

// scarceLocked reports whether the global bucket's level at e's last answer was low
// (lease.Ask.Scarce): below 1/lease.Reserve of its capacity, as lease.Low reads it. A key that
// never asked yet (its first demand sample not begun) has no answer and is not scarce. e.mu is
// held.
func (e *entry) scarceLocked() bool {
	return e.sampled && lease.Low(e.lim.Bucket, e.level, 0)
}

// setNextLocked replaces the prefetched lease. e.mu is held.
func (e *entry) setNextLocked(n grant) {
	if n.tokens > 0 {
		e.sw().next = n
	} else if e.slow != nil {
		e.slow.next = grant{}
	}
	e.setRemainingLocked()
}

// setRemainingLocked computes what responses report beyond the current lease. e.mu is held.
func (e *entry) setRemainingLocked() {
	e.remaining.Store(int64(e.level + e.s().next.tokens))
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
