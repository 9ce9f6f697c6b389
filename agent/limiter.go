// Package agent is the node-local limiter: it answers checks from leases of the global buckets
// and refills them from coordinators.
//
// Limiter is the synchronous, I/O-free core. Its inputs are checks (Check, at a given now), the
// answers to its coordinator calls (Apply, with the shell's reading of how the call ended) and
// the passage of time (Expire). Its outputs are explicit: a check's Verdict (a Wait verdict
// carries the Ticket the check waits on), and the calls to send, which the shell pulls with
// NextCall whenever Wake signals that one may be due. Refresher (the goroutine shell), Server
// (gRPC) and the simulator drive the same core.
package agent

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/policy"
)

// Config shapes a Limiter.
type Config struct {
	// AgentID names this agent process to coordinators (idempotency records); it must differ
	// between processes, including restarts of one node's agent.
	AgentID string
	// Region is the agent's region, for rules with regional scope.
	Region string
	// MaxKeys bounds the lease table; the least recently used keys are evicted (and their leases
	// handed back) beyond it.
	MaxKeys int
	// Guard is subtracted from every lease's lifetime: the most the caller's clock may lag real
	// time (clock.Guard for a clock.Coarse; 0 for an exact clock).
	Guard clock.Nanos
	// Exact reads the time without that lag (clock.Coarse.Fresh for a clock.Coarse), for a lease
	// in its last Guard: a check that finds its key's lease past its deadline by the caller's
	// clock, with no lease to replace it, is served from it while Exact reads, before and after
	// the spend, within the lease's whole lifetime. nil: every lease ends Guard early.
	Exact func() clock.Nanos
	// RecordForfeits keeps a record of every lease given up instead of handed back, for Forfeits
	// (the simulator's ledgers); off, they are only counted.
	RecordForfeits bool
	// SettleWindow is how long a check with Query.Settle can be settled (DefaultSettleWindow if
	// zero); MaxHolds bounds the checks waiting to be settled (DefaultMaxHolds if zero).
	SettleWindow time.Duration
	MaxHolds     int
}

// DefaultMaxKeys bounds the lease table when Config.MaxKeys is 0: a million keys stay within a
// few hundred megabytes (docs/agent.md measures the bytes per key).
const DefaultMaxKeys = 1 << 20

// Limiter is the lease core. Its methods are safe for concurrent use; Check takes no lock when a
// live lease covers the request.
type Limiter struct {
	cfg  Config
	view atomic.Pointer[view]
	seq  atomic.Uint64

	parked *parking      // emergency buckets of evicted entries
	wake   chan struct{} // a call may be due (Wake)
	sweep  atomic.Int64  // the shard the next Expire starts from

	qmu   sync.Mutex
	queue []*entry // entries waiting for a refill
	backs []*entry // entries with a lease to hand back
	// oldestBack is when the oldest lease waiting in backs was retired (0: none waits).
	oldestBack clock.Nanos

	fmu      sync.Mutex
	forfeits []Forfeit

	holds *holds // checks waiting for Settle

	stats Stats
}

// view is one policy Set and the lease table keyed by its route ids. A policy change makes a new
// view; the old one is closed and its leases are handed back.
type view struct {
	lim    *Limiter
	set    *policy.Set
	table  *table
	closed atomic.Bool
}

// New returns a Limiter deciding with set.
func New(cfg Config, set *policy.Set) *Limiter {
	if cfg.MaxKeys <= 0 {
		cfg.MaxKeys = DefaultMaxKeys
	}
	l := &Limiter{cfg: cfg, parked: newParking(cfg.MaxKeys), wake: make(chan struct{}, 1), holds: newHolds(cfg.SettleWindow, cfg.MaxHolds)}
	l.view.Store(l.newView(set))
	return l
}

func (l *Limiter) newView(set *policy.Set) *view {
	v := &view{lim: l, set: set}
	v.table = newTable(l.cfg.MaxKeys, func(e *entry) { l.evicted(e) })
	return v
}

// Policy is the Set the Limiter decides with.
func (l *Limiter) Policy() *policy.Set { return l.view.Load().set }

// SetPolicy switches to set. Leases of the previous Set are retired and handed back (the bucket
// keys of unchanged rules are the same, so the global state carries over; only this agent's
// leases are handed back and acquired again).
func (l *Limiter) SetPolicy(set *policy.Set) {
	old := l.view.Swap(l.newView(set))
	if old == nil || old.set == set {
		return
	}
	old.closed.Store(true)
	old.table.each(func(e *entry) { l.retireEntry(e) })
	l.parked.purge()
}

// Wake is signalled (never blocking, coalesced) when a call may be due: a refill was queued or a
// lease is waiting to be handed back. The shell then calls NextCall.
func (l *Limiter) Wake() <-chan struct{} { return l.wake }

func (l *Limiter) signal() {
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// Outcome of a check.
type Outcome uint8

const (
	// Allow means go ahead.
	Allow Outcome = iota + 1
	// Deny means over the limit (429).
	Deny
	// Unavailable means the global state is unreachable and the rule fails closed (503).
	Unavailable
	// Wait means no usable lease; the check waits for a refill on Verdict.Ticket.
	Wait
)

func (o Outcome) String() string {
	switch o {
	case Allow:
		return "allow"
	case Deny:
		return "deny"
	case Unavailable:
		return "unavailable"
	case Wait:
		return "wait"
	}
	return "unknown"
}

// Verdict is the answer to a check.
type Verdict struct {
	Outcome    Outcome
	Degraded   bool          // decided by the emergency bucket while the global state is unreachable
	ShadowDeny bool          // a shadow rule would have denied; Outcome is Allow
	RetryAfter time.Duration // Deny and Unavailable
	Remaining  bucket.Micro  // this agent's view of what is left: its leases plus the global level at its last answer
	Rule       *policy.Rule
	Limits     *policy.Limits
	// Ticket is the refill a Wait verdict waits for.
	Ticket *Ticket
	// SettleID names an allowed check of Query.Settle for Settle (settle.go); 0 otherwise.
	SettleID uint64
}

// Ticket is a check waiting for a refill of its key. Ready is closed when it is decided; Verdict
// then holds the decision, or Wait when the check must be asked again (its key was retired
// meanwhile: evicted, or its policy replaced). A caller that stops waiting calls
// Limiter.Fallback with it.
type Ticket struct {
	e     *entry
	cost  int64
	ready chan struct{}
	v     Verdict
	from  grant       // the lease an allowed ticket's tokens came from (a reservation's expiry: reserve.go)
	at    clock.Nanos // when the check began to wait: a direct grant serves only checks waiting before its Acquire was sent
	// recheck: a check of several buckets waits for this entry's refill; it takes no tokens and is
	// answered Wait (check again) once the refill is in (charges.go).
	recheck bool
}

// Ready is closed when the ticket is decided.
func (t *Ticket) Ready() <-chan struct{} { return t.ready }

// Verdict is the decision, once Ready is closed.
func (t *Ticket) Verdict() Verdict { return t.v }

// decideLocked settles the ticket with v. Its entry's mu is held.
func (t *Ticket) decideLocked(v Verdict) {
	t.v = v
	close(t.ready)
}

// retryTicket is the decision of a ticket whose entry was retired: check again.
var retryTicket = func() *Ticket {
	t := &Ticket{ready: make(chan struct{})}
	t.decideLocked(Verdict{Outcome: Wait})
	return t
}()

// Check decides q at now. It does not block: without a usable lease it answers Wait with a Ticket
// and queues a refill (or joins the one queued or in flight). Errors are malformed queries, never
// decisions.
func (l *Limiter) Check(now clock.Nanos, q Query) (Verdict, error) {
	v := l.view.Load()
	if v.closed.Load() {
		return Verdict{}, ErrClosed
	}
	var res resolved
	if err := l.resolveInto(v, q, &res); err != nil {
		return Verdict{}, err
	}
	// The common case in this frame: a known key of one bucket whose lease serves the check, or
	// of several buckets whose leases all serve it (spendLinked; otherwise check decides, all or
	// nothing). The first is serve written out, since the compiler does not inline it (cost 170,
	// budget 80), and the call and the copy of its verdict were a fifth of an in-process check
	// (BenchmarkCheck 59 → 49 ns); the second saves the same frames (callgrind: 1138 → 1030
	// instructions per check of two limits, against 915 for one).
	if e := res.e; e != nil && !res.settle && e.touched.Load() {
		if !res.charges {
			if left, ok := e.spend(now, res.cost); ok {
				if left < e.lowWater.Load() && !e.refilling.Load() {
					l.prefetch(e)
				}
				return Verdict{Outcome: Allow, Remaining: bucket.Micro(left + e.remaining.Load()), Rule: e.rule, Limits: e.lim}, nil
			}
		} else if ln := e.links.Load(); ln != nil && !e.rule.Direct {
			// A check of several buckets whose leases all serve, in this frame too (a direct
			// route's keep no lease: check takes them all at once).
			if least, left, ok := l.spendLinked(now, e, ln, res.cost); ok {
				return Verdict{Outcome: Allow, Remaining: bucket.Micro(left), Rule: least.rule, Limits: least.lim}, nil
			}
			return l.checkChargesAll(now, &res, q.Tenant), nil
		}
	}
	return l.check(now, &res, q.Tenant), nil
}

// serve spends c from e's live lease and queues a refill when the lease ran below its low water
// (unless one is already on its way); ok is false when the lease cannot serve c.
func (l *Limiter) serve(now clock.Nanos, e *entry, c int64) (v Verdict, ok bool) {
	left, ok := e.spend(now, c)
	if !ok {
		return Verdict{}, false
	}
	if left < e.lowWater.Load() && !e.refilling.Load() {
		l.prefetch(e)
	}
	return Verdict{Outcome: Allow, Remaining: bucket.Micro(left + e.remaining.Load()), Rule: e.rule, Limits: e.lim}, true
}

// check decides a resolved query.
func (l *Limiter) check(now clock.Nanos, res *resolved, tenant string) Verdict {
	if res.settle && !res.route.Rule.Direct {
		return l.checkSettle(now, res, tenant)
	}
	if res.charges && !directCharges(res) {
		return l.checkCharges(now, res, tenant)
	}
	e := res.e
	if e == nil {
		// A key's first use does not mark it: keys used once are evicted before keys used again.
		e = l.insert(res, tenant)
	} else if !e.touched.Load() {
		e.touched.Store(true)
	}
	if v, ok := l.serve(now, e, res.cost); ok {
		return v
	}
	return l.slowCheck(now, e, res.cost)
}

// insert adds the entry of a resolved query to its view's table.
func (l *Limiter) insert(res *resolved, tenant string) *entry {
	v := res.view
	e, _ := v.table.getOrInsert(res.hash, res.route.ID, tenant, func() *entry {
		// The tenant string may point into a request buffer: the table keeps its own copy.
		e := &entry{route: res.route.ID, tenant: string([]byte(tenant)), lim: res.lim, rule: res.route.Rule, view: v,
			unit: bucket.Micro(v.set.Cost(res.route)) * bucket.PerToken}
		l.parked.restore(e)
		return e
	})
	return e
}

// slowCheck decides when the current lease cannot serve c: a cached denial, a prefetched lease,
// the failure mode, or a refill to wait for.
func (l *Limiter) slowCheck(now clock.Nanos, e *entry, c int64) Verdict {
	e.mu.Lock()
	defer e.unlock()
	for {
		if e.dead.Load() {
			// Evicted or its view closed while we looked: the caller checks again and finds the
			// live entry of the current view.
			return Verdict{Outcome: Wait, Ticket: retryTicket, Rule: e.rule, Limits: e.lim}
		}
		if e.usableLocked(now, c) {
			if left, ok := e.spend(now, c); ok {
				return l.allowLocked(e, left)
			}
			continue // a concurrent spender took the tokens
		}
		if l.promoteLocked(now, e) {
			continue
		}
		// Past its deadline by the caller's clock with nothing to replace it: the lease may be in
		// its last Guard. (A prefetched lease replaces it first, above, so a hot key's checks go
		// back to the lock-free path at once.)
		if left, ok := l.graceLocked(now, e, c); ok {
			return l.allowLocked(e, left)
		}
		// Denied, or paced (agents compete for the bucket and this one had its share): answer
		// locally until then.
		if until := clock.Nanos(e.deniedUntil.Load()); now < until {
			e.refused += bucket.Micro(c)
			return l.shadow(e, Verdict{Outcome: Deny, RetryAfter: (until - now).Duration()})
		}
		if exp := e.expires.Load(); exp != 0 && int64(now) >= exp {
			// Expired: hand back what is left now rather than at the next sweep.
			l.expiredLocked(now, e)
		}
		if e.fail != nil && now < e.fail.until {
			return l.failureLocked(now, e, c)
		}
		t := &Ticket{e: e, cost: c, ready: make(chan struct{}), at: now}
		e.wait(t)
		l.queueLocked(e)
		return Verdict{Outcome: Wait, Ticket: t, Rule: e.rule, Limits: e.lim}
	}
}

// allowLocked answers a check that spent from e's lease, left µ remaining in it, and queues a
// refill once the lease is below its low water. e.mu is held.
func (l *Limiter) allowLocked(e *entry, left int64) Verdict {
	if left < e.lowWater.Load() {
		l.queueLocked(e)
	}
	return Verdict{Outcome: Allow, Remaining: bucket.Micro(left + e.remaining.Load()), Rule: e.rule, Limits: e.lim}
}

// graceLocked spends c from e's current lease past its deadline by the caller's reading (now) but
// in its last Guard, if the exact clock (Config.Exact) reads before the lease's whole lifetime both
// before and after the spend: the deadline is the lifetime less Guard because the caller decides
// by a reading that may be that much older than the moment it spends, and a check in that last
// stretch would otherwise lose the lease. The second reading dates the spend itself; a spend it
// finds too late is undone (under e.mu the lease cannot be retired meanwhile). ok is false when
// it cannot serve (no exact clock, no lease, too few tokens, or its lifetime is over). e.mu is
// held.
func (l *Limiter) graceLocked(now clock.Nanos, e *entry, c int64) (left int64, ok bool) {
	exp := clock.Nanos(e.expires.Load())
	if l.cfg.Exact == nil || l.cfg.Guard <= 0 || exp == 0 || now < exp || e.tokens.Load() < c {
		return 0, false
	}
	end := exp + l.cfg.Guard // the lease's whole lifetime, from the moment its Acquire was sent
	if l.cfg.Exact() >= end {
		return 0, false
	}
	if left, ok = e.spend(exp-1, c); !ok { // exp-1: before the deadline it was installed with
		return 0, false
	}
	if l.cfg.Exact() >= end {
		e.tokens.Add(c)
		return 0, false
	}
	l.stats.Grace.Add(1)
	return left, true
}

// promoteLocked replaces an exhausted or expired current lease by the prefetched one.
func (l *Limiter) promoteLocked(now clock.Nanos, e *entry) bool {
	n := e.s().next
	if n.tokens == 0 {
		return false
	}
	e.setNextLocked(grant{})
	e.prefetchDoneLocked()
	l.handBackLocked(now, e, e.retireLocked())
	if now >= n.expires {
		e.acct -= n.tokens
		l.handBackLocked(now, e, n)
		return false
	}
	e.installLocked(n)
	return true
}

// Fallback is the failure-mode answer for a check that stopped waiting for its refill (the shell
// calls it when a Wait outlasts its patience). The ticket leaves its key's queue: a grant that
// comes later serves the checks still waiting, or becomes the lease. A ticket decided meanwhile
// keeps its decision, unless that decision is to look again (Wait: a check of several buckets
// whose bucket's refill was answered, a retired key), which is no answer: the failure mode
// replaces it.
func (l *Limiter) Fallback(now clock.Nanos, t *Ticket) Verdict {
	e := t.e
	if e == nil {
		if t.v.Outcome == Wait {
			// A retired key's "check again" (retryTicket), and no time left to: the check fails
			// closed, as nothing is known of its rule's failure mode here.
			return Verdict{Outcome: Unavailable}
		}
		return t.v
	}
	e.mu.Lock()
	defer e.unlock()
	decided := false
	select {
	case <-t.ready:
		if t.v.Outcome != Wait {
			return t.v
		}
		// Decided "look again" (a check of several buckets, when its bucket's refill was
		// answered) just as the wait ran out: no time is left to look, and "look again" is no
		// answer (Envoy's API would read it as OK): the failure mode decides, as for a wait that
		// ran out first.
		decided = true
	default:
		e.unwait(t)
	}
	v := l.failureLocked(now, e, t.cost)
	if t.recheck && v.ShadowDeny {
		// A check of several buckets that waited too long for a shadow rule's bucket: the other
		// buckets were not charged, so it cannot be allowed; it fails as the rule fails closed.
		v = Verdict{Outcome: Unavailable, RetryAfter: e.rule.FailureRetryAfter, Rule: e.rule, Limits: e.lim}
	}
	if !decided {
		t.decideLocked(v)
	}
	return v
}

// failureLocked applies the rule's failure mode: a fail-closed rule answers Unavailable with its
// Retry-After; an emergency rule spends the local emergency bucket and answers degraded.
func (l *Limiter) failureLocked(now clock.Nanos, e *entry, c int64) Verdict {
	em := e.lim.Emergency
	if e.rule.OnFailure != policy.Emergency || em == nil {
		l.stats.Unavailable.Add(1)
		return l.shadow(e, Verdict{Outcome: Unavailable, RetryAfter: e.rule.FailureRetryAfter})
	}
	ms := bucket.Millis(now / clock.Nanos(time.Millisecond))
	if e.fail == nil {
		e.fail = &fails{}
	}
	f := e.fail
	if !f.emergencyOn {
		f.emergency, f.emergencyOn = bucket.Full(em.Bucket, ms), true
	}
	res := f.emergency.Take(em.Bucket, ms, bucket.Micro(c), bucket.Micro(c))
	if res.Granted > 0 {
		l.stats.Degraded.Add(1)
		return Verdict{Outcome: Allow, Degraded: true, Remaining: res.Remaining, Rule: e.rule, Limits: e.lim}
	}
	retry := time.Duration(res.RetryAfter) * time.Millisecond
	if res.RetryAfter == bucket.Never {
		retry = e.rule.FailureRetryAfter
	}
	return l.shadow(e, Verdict{Outcome: Deny, Degraded: true, RetryAfter: retry})
}

// shadow completes a denying verdict; a shadow rule turns it into an allow that says so.
func (l *Limiter) shadow(e *entry, v Verdict) Verdict {
	v.Rule, v.Limits = e.rule, e.lim
	v.Remaining = bucket.Micro(e.tokens.Load() + e.remaining.Load())
	if e.rule.Shadow {
		l.stats.ShadowDenied.Add(1)
		v.Outcome, v.ShadowDeny, v.RetryAfter = Allow, true, 0
	}
	return v
}

// prefetch queues a refill ahead of need (the lease fell below its low water).
func (l *Limiter) prefetch(e *entry) {
	e.mu.Lock()
	l.queueLocked(e)
	e.unlock()
}

// queueLocked queues a refill of e unless one is queued, in flight or put off. e.mu is held.
func (l *Limiter) queueLocked(e *entry) {
	if e.refilling.CompareAndSwap(false, true) {
		l.enqueueLocked(e)
	}
}

// enqueueLocked puts e in the queue of keys a call is due for, and wakes the shell. e.mu is held.
func (l *Limiter) enqueueLocked(e *entry) {
	e.queued = true
	l.qmu.Lock()
	l.queue = append(l.queue, e)
	l.qmu.Unlock()
	l.signal()
}

// Stats counts what the core did; the shells export it as metrics.
type Stats struct {
	Unavailable  atomic.Uint64 // fail-closed answers
	Degraded     atomic.Uint64 // emergency-bucket admissions
	ShadowDenied atomic.Uint64 // shadow rules that would have denied

	Acquires       atomic.Uint64 // Acquire calls built
	Resends        atomic.Uint64 // of which sent again with the seq of a call whose outcome was unknown
	RefillsDropped atomic.Uint64 // queued refills not sent: every check that asked stopped waiting, and the key does not refill ahead of need
	AcquireErrors  atomic.Uint64 // Acquire calls that failed as a whole
	Grants         atomic.Uint64 // grants received
	GrantedMicro   atomic.Uint64 // µ granted
	Denials        atomic.Uint64 // refills denied by the global bucket
	ItemFailures   atomic.Uint64 // items failed by the store or the policy
	Returns        atomic.Uint64 // leases handed back (with their key's refill or alone)
	ReturnedMicro  atomic.Uint64 // µ handed back
	ReturnsSkipped atomic.Uint64 // leases not handed back: the refill since their grant covers them, or they were worth less than a request and no refill came to carry them
	SkippedMicro   atomic.Uint64 // µ of those leases
	CreditedMicro  atomic.Uint64 // µ the coordinators credited
	Refunds        atomic.Uint64 // costs given back to their lease by a check of several buckets that one refused
	RefundsLost    atomic.Uint64 // of those, costs whose lease was retired meanwhile: they stay spent
	// RefundsLostMicro is the µ of RefundsLost.
	RefundsLostMicro atomic.Uint64
	LostMicro        atomic.Uint64 // µ handed back in calls that failed

	Holds            atomic.Uint64 // checks allowed with Query.Settle, kept for Settle
	HoldsDropped     atomic.Uint64 // of those, dropped unsettled (past the settle window, or to make room): their estimate stays charged
	Settles          atomic.Uint64 // Settle calls applied
	ChargedAfter     atomic.Uint64 // costs charged after the fact with no estimate (Envoy's apply_on_stream_done descriptors)
	SettleCredited   atomic.Uint64 // µ of estimates given back (per bucket)
	SettleUncredited atomic.Uint64 // µ of estimates not given back: no lease held them (lease: off, emergency answers, a lease changed under the check)
	SettleSpent      atomic.Uint64 // µ settled beyond estimates and spent from leases (per bucket)
	DebtMicro        atomic.Uint64 // µ settled beyond estimates that no lease held: debt for the global buckets
	DebtCharged      atomic.Uint64 // µ of debt the global buckets were debited
	DebtForgiven     atomic.Uint64 // µ of debt not debited: the bucket was at its max_debt below zero
	DebtLost         atomic.Uint64 // µ of debt never sent: its bucket went with a replaced policy, or its call may have failed unapplied
	Expired          atomic.Uint64 // leases that expired with tokens left
	Grace            atomic.Uint64 // checks served from a lease in its last Guard, by the exact clock (Config.Exact)
	Evicted          atomic.Uint64 // keys evicted by the LRU bound
	Released         atomic.Uint64 // waiting checks told to check again: their key was retired while they waited
	PolicyMismatch   atomic.Uint64 // coordinator did not know the policy version or a route

	ops storeOps // store operations by rule (StoreOps)
}

// Stats returns the core's counters.
func (l *Limiter) Stats() *Stats { return &l.stats }

// Keys is the number of keys in the lease table.
func (l *Limiter) Keys() int { return l.view.Load().table.len() }
