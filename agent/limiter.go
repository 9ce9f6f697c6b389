// Package agent is the node-local limiter: it answers checks from leases of the global buckets
// and refills them from coordinators.
//
// Limiter is the synchronous, I/O-free core: Check decides at a given now; NextAcquire and
// ApplyAcquire move leases between the agent and a coordinator; NextReturn, Expire and Close hand
// unspent tokens back. Refresher (the goroutine shell), Server (gRPC) and the simulator drive
// the same core.
package agent

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/policy"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// Config shapes a Limiter.
type Config struct {
	// AgentID names this agent process to coordinators (idempotency records); it must differ
	// between processes, including restarts of one node's agent.
	AgentID string
	// Region is the agent's region, for rules with regional scope.
	Region string
	// MaxKeys bounds the lease table; the least recently used keys are evicted (and their leases
	// returned) beyond it.
	MaxKeys int
	// Guard is subtracted from every lease's lifetime: the most the caller's clock may lag real
	// time (clock.Guard for a clock.Coarse; 0 for an exact clock).
	Guard clock.Nanos
	// Notify is called (without locks held, never blocking for long) when a refill is queued:
	// the shell's cue to call NextAcquire.
	Notify func()
	// Skipped, if set, is told of each expired lease that is not returned because the
	// coordinator would credit none of it (returnExpiredLocked). It runs with the entry's lock
	// held and must not call back into the Limiter. The simulator keeps its ledgers with it.
	Skipped func(ref *coordinatorv1.BucketRef, unspent bucket.Micro)
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
	rtt  atomic.Int64 // clock.Nanos: the slowest recent Acquire round trip (observeRTT)

	parked *parking // emergency buckets of evicted entries

	qmu     sync.Mutex
	queue   []*entry     // entries waiting for a refill
	returns []returnItem // retired leases waiting to be returned

	stats Stats
}

// view is one policy Set and the lease table keyed by its route ids. A policy change makes a new
// view; the old one is closed and its leases are returned.
type view struct {
	set    *policy.Set
	table  *table
	closed atomic.Bool
}

// Errors of Check: the request is malformed, not a decision.
var (
	ErrInvalidTenant = errors.New("agent: invalid tenant")
	ErrInvalidRoute  = errors.New("agent: invalid route")
	ErrInvalidCost   = errors.New("agent: invalid cost")
	// ErrClosed: the Limiter was closed (shutting down); no decision is made.
	ErrClosed = errors.New("agent: limiter closed")
)

// New returns a Limiter deciding with set.
func New(cfg Config, set *policy.Set) *Limiter {
	if cfg.MaxKeys <= 0 {
		cfg.MaxKeys = DefaultMaxKeys
	}
	if cfg.Notify == nil {
		cfg.Notify = func() {}
	}
	l := &Limiter{cfg: cfg, parked: newParking(cfg.MaxKeys)}
	l.view.Store(l.newView(set))
	return l
}

func (l *Limiter) newView(set *policy.Set) *view {
	v := &view{set: set}
	v.table = newTable(l.cfg.MaxKeys, func(e *entry) { l.evicted(e) })
	return v
}

// Policy is the Set the Limiter decides with.
func (l *Limiter) Policy() *policy.Set { return l.view.Load().set }

// SetPolicy switches to set. Leases of the previous Set are retired and queued for return (the
// bucket keys of unchanged rules are the same, so the global state carries over; only this
// agent's leases are handed back and acquired again).
func (l *Limiter) SetPolicy(set *policy.Set) {
	old := l.view.Swap(l.newView(set))
	if old == nil || old.set == set {
		return
	}
	old.closed.Store(true)
	old.table.each(func(e *entry) { l.retireEntry(e, true) })
	l.parked.purge()
}

// Query is one check.
type Query struct {
	Tenant    string
	Path      string // the request path as received
	Operation string // class, named operation or HTTP method
	Cost      int64  // tokens; 0 means the rule's cost
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
	// Wait means no usable lease; a refill is in flight. Wait on Verdict.Ready, then check again (or,
	// past the caller's patience, call Fallback).
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
	Remaining  bucket.Micro  // this agent's view of what is left: its lease plus the global level at its last grant
	Rule       *policy.Rule
	Limits     *policy.Limits
	ready      chan struct{}
}

// Ready is closed when the refill a Wait verdict waits for has completed.
func (v Verdict) Ready() <-chan struct{} { return v.ready }

// Check decides q at now. It does not block: without a usable lease it answers Wait and queues a
// refill (or joins the one in flight). Errors are malformed queries, never decisions.
func (l *Limiter) Check(now clock.Nanos, q Query) (Verdict, error) {
	v := l.view.Load()
	if v.closed.Load() {
		return Verdict{}, ErrClosed
	}
	r, err := v.set.Match(q.Path, q.Operation)
	if err != nil {
		return Verdict{}, fmt.Errorf("%w: %w", ErrInvalidRoute, err)
	}
	h := v.table.hash(r.ID, q.Tenant)
	e := v.table.get(h, r.ID, q.Tenant)
	if e == nil {
		// A key's first use does not mark it: keys used once are evicted before keys used again.
		if e, err = l.insert(v, h, r, q.Tenant); err != nil {
			return Verdict{}, err
		}
	} else if !e.touched.Load() {
		e.touched.Store(true)
	}
	cost := q.Cost
	if cost == 0 {
		cost = v.set.Cost(r)
	}
	if cost < 0 || bucket.Micro(cost) > e.lim.Bucket.Capacity()/bucket.PerToken {
		return Verdict{}, fmt.Errorf("%w: cost %d is not in 1..%d, the burst of rule %q",
			ErrInvalidCost, cost, e.lim.Bucket.Capacity()/bucket.PerToken, e.rule.Name)
	}
	c := cost * int64(bucket.PerToken)
	if left, ok := e.spend(now, c); ok {
		if left < e.lowWater.Load() && !e.refilling.Load() {
			l.prefetch(e)
		}
		return Verdict{Outcome: Allow, Remaining: bucket.Micro(left + e.remaining.Load()), Rule: e.rule, Limits: e.lim}, nil
	}
	return l.slowCheck(now, e, c), nil
}

// insert adds the entry of (route, tenant) to the view's table.
func (l *Limiter) insert(v *view, h uint64, r policy.Route, tenant string) (*entry, error) {
	lim, err := v.set.Limits(r, tenant, l.cfg.Region)
	if err != nil {
		if errors.Is(err, policy.ErrInvalidTenant) {
			return nil, fmt.Errorf("%w: %w", ErrInvalidTenant, err)
		}
		return nil, fmt.Errorf("%w: %w", ErrInvalidRoute, err)
	}
	e, _ := v.table.getOrInsert(h, r.ID, tenant, func() *entry {
		// The tenant string may point into a request buffer: the table keeps its own copy.
		e := &entry{route: r.ID, tenant: string([]byte(tenant)), lim: lim, rule: r.Rule, view: v}
		l.parked.restore(e)
		return e
	})
	return e, nil
}

// slowCheck decides when the current lease cannot serve c: a cached denial, a prefetched lease,
// the failure mode, or a refill to wait for.
func (l *Limiter) slowCheck(now clock.Nanos, e *entry, c int64) Verdict {
	e.mu.Lock()
	defer e.mu.Unlock()
	for {
		if until := clock.Nanos(e.deniedUntil.Load()); now < until {
			return l.shadow(e, Verdict{Outcome: Deny, RetryAfter: (until - now).Duration()})
		}
		if e.dead.Load() {
			// Evicted or its view closed while we looked: the caller checks again and finds the
			// live entry of the current view.
			return Verdict{Outcome: Wait, ready: closedChan, Rule: e.rule, Limits: e.lim}
		}
		if e.usableLocked(now, c) {
			if left, ok := e.spend(now, c); ok {
				if left < e.lowWater.Load() {
					l.queueLocked(e)
				}
				return Verdict{Outcome: Allow, Remaining: bucket.Micro(left + e.remaining.Load()), Rule: e.rule, Limits: e.lim}
			}
			continue // a concurrent spender took the tokens
		}
		if l.promoteLocked(now, e) {
			continue
		}
		if exp := e.expires.Load(); exp != 0 && int64(now) >= exp {
			l.retireExpiredLocked(now, e) // expired: hand back what is left now rather than at the next sweep
		}
		if e.fail != nil && now < e.fail.until {
			return l.failureLocked(now, e, c)
		}
		e.wantMin = max(e.wantMin, bucket.Micro(c))
		if e.done == nil {
			e.done = make(chan struct{})
		}
		l.queueLocked(e)
		return Verdict{Outcome: Wait, ready: e.done, Rule: e.rule, Limits: e.lim}
	}
}

// closedChan is the Ready of a verdict that needs no waiting.
var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// promoteLocked replaces an exhausted or expired current lease by the prefetched one.
func (l *Limiter) promoteLocked(now clock.Nanos, e *entry) bool {
	if e.next.tokens == 0 {
		return false
	}
	n := e.next
	e.setNextLocked(grant{})
	e.prefetchDoneLocked()
	l.retireLocked(e)
	if now >= n.expires {
		l.returnExpiredLocked(now, e, n)
		e.acct -= n.tokens
		return false
	}
	e.installLocked(n)
	return true
}

// Fallback is the failure-mode answer for q: what the rule does when the global state cannot be
// reached in time (the shell calls it when a Wait outlasts its patience).
func (l *Limiter) Fallback(now clock.Nanos, q Query) (Verdict, error) {
	v := l.view.Load()
	if v.closed.Load() {
		return Verdict{}, ErrClosed
	}
	r, err := v.set.Match(q.Path, q.Operation)
	if err != nil {
		return Verdict{}, fmt.Errorf("%w: %w", ErrInvalidRoute, err)
	}
	h := v.table.hash(r.ID, q.Tenant)
	e := v.table.get(h, r.ID, q.Tenant)
	if e == nil {
		if e, err = l.insert(v, h, r, q.Tenant); err != nil {
			return Verdict{}, err
		}
	}
	cost := q.Cost
	if cost <= 0 {
		cost = v.set.Cost(r)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return l.failureLocked(now, e, cost*int64(bucket.PerToken)), nil
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
	e.mu.Unlock()
}

// queueLocked queues a refill of e unless one is queued, in flight or put off. e.mu is held.
func (l *Limiter) queueLocked(e *entry) {
	if e.refilling.CompareAndSwap(false, true) {
		e.queued = true
		l.enqueue(e)
	}
}

func (l *Limiter) enqueue(e *entry) {
	l.qmu.Lock()
	l.queue = append(l.queue, e)
	l.qmu.Unlock()
	l.cfg.Notify()
}

// Stats counts what the core did; the shells export it as metrics.
type Stats struct {
	Unavailable  atomic.Uint64 // fail-closed answers
	Degraded     atomic.Uint64 // emergency-bucket admissions
	ShadowDenied atomic.Uint64 // shadow rules that would have denied

	Acquires       atomic.Uint64 // Acquire calls built
	Resends        atomic.Uint64 // of which sent again with the seq of a call whose outcome was unknown
	AcquireErrors  atomic.Uint64 // Acquire calls that failed as a whole
	Grants         atomic.Uint64 // leases granted
	GrantedMicro   atomic.Uint64 // µ granted
	Denials        atomic.Uint64 // refills denied by the global bucket
	ItemFailures   atomic.Uint64 // items failed by the store or the policy
	Returns        atomic.Uint64 // leases sent back in Returns
	ReturnedMicro  atomic.Uint64 // µ sent back in Returns
	ReturnsSkipped atomic.Uint64 // expired leases not returned: the refill since their grant covers them
	SkippedMicro   atomic.Uint64 // µ of those leases
	CreditedMicro  atomic.Uint64 // µ the coordinators credited
	LostMicro      atomic.Uint64 // µ of Returns that failed
	Expired        atomic.Uint64 // leases that expired with tokens left
	Evicted        atomic.Uint64 // keys evicted by the LRU bound
	PolicyMismatch atomic.Uint64 // coordinator did not know the policy version or a route
}

// Stats returns the core's counters.
func (l *Limiter) Stats() *Stats { return &l.stats }

// Keys is the number of keys in the lease table.
func (l *Limiter) Keys() int { return l.view.Load().table.len() }

// ttl is the lease lifetime the coordinator grants for e's limit.
func (e *entry) ttl() time.Duration { return lease.TTL(e.lim.Bucket) }
