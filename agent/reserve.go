package agent

import (
	"errors"
	"fmt"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/policy"
)

// Reservations: tokens moved out of a key's lease to a holder that hands them out elsewhere, where
// the agent cannot see each use: an Envoy enforcing a quota assignment of the rate limit quota
// service (rlqs.go). docs/leases.md ("Assignments") proves the bounds with them.

// ErrNotReservable is reported by Reserve for a rule whose tokens cannot be held ahead of their
// use: a rule with lease: off, whose every check is one atomic take in the global bucket, holds no
// lease to reserve from.
var ErrNotReservable = errors.New("agent: the rule has no leases to reserve from (lease: off)")

// ReserveAsk is what a holder asks of a key's leases.
type ReserveAsk struct {
	// Want is the µ the holder would like; it gets what one lease holds, up to Want, in whole
	// requests of the route.
	Want bucket.Micro
	// Least is the smallest reservation worth having, µ; never less than one request.
	Least bucket.Micro
	// Life is how long the reserved tokens must stay usable after now: a lease that expires sooner
	// is not reserved from, and a fresh one is asked for instead.
	Life time.Duration
}

// Reservation is tokens moved out of one lease of a key. They are spent, from the bounds' point
// of view, the moment they are reserved; the holder hands out at most Tokens, and nothing at or
// after Expires, the lease's own expiry (measured from its Acquire's send, less the clock guard).
// Release gives back what the holder did not hand out.
type Reservation struct {
	Tokens  bucket.Micro
	Expires clock.Nanos
	Unit    bucket.Micro // one request of the route
	Rule    *policy.Rule
	Limits  *policy.Limits

	from grant // the lease: its expiry, grant time and arrival identify it and price a hand-back
	e    *entry
}

// Reserve moves a.Want µ of q's key out of a lease into a Reservation, if a lease that lives
// a.Life more holds them (the current lease, else the prefetched one). Otherwise the
// verdict says why not: Deny (the global bucket refused; RetryAfter is when it may not), Unavailable
// (the key is in its failure mode for RetryAfter more; Degraded for a rule whose failure mode is its
// emergency bucket, which a reservation never spends), or Wait with a Ticket: a refill was queued or
// joined, and once the ticket is ready Reserved completes the reservation from the refill's grant:
// at least a.Least, up to a.Want (or Unreserve drops it). A lease that holds less than a.Want is
// left to the key's checks and other holders: a holder that could only get part of what it needs
// now would run dry before its next reservation, while the refill, sized by the key's demand, is a
// round trip away. Errors are malformed queries, a closed Limiter, and ErrNotReservable.
func (l *Limiter) Reserve(now clock.Nanos, q Query, a ReserveAsk) (Reservation, Verdict, error) {
	v := l.view.Load()
	if v.closed.Load() {
		return Reservation{}, Verdict{}, ErrClosed
	}
	res, err := l.resolve(v, q)
	if err != nil {
		return Reservation{}, Verdict{}, err
	}
	return l.reserve(now, &res, q.Tenant, a)
}

// reserveResolved is Reserve of a query resolved in res.view, which a holder that reserves for the
// same key again and again (an Envoy's quota bucket) resolves once per policy view: the policy's
// match is not repeated, and its entry is looked up again only once it was retired. It is Reserve
// exactly: a view's limits and costs never change, and an entry is its key's while it is live.
func (l *Limiter) reserveResolved(now clock.Nanos, res *resolved, tenant string, a ReserveAsk) (Reservation, Verdict, error) {
	if res.view.closed.Load() {
		return Reservation{}, Verdict{}, ErrClosed
	}
	if e := res.e; e == nil || e.dead.Load() {
		res.e = res.view.table.get(res.hash, res.route.ID, tenant)
	}
	return l.reserve(now, res, tenant, a)
}

// reserve is Reserve of a resolved query; res.e is set to the key's entry, inserted if need be.
func (l *Limiter) reserve(now clock.Nanos, res *resolved, tenant string, a ReserveAsk) (Reservation, Verdict, error) {
	if res.route.Rule.Direct {
		return Reservation{}, Verdict{}, fmt.Errorf("%w: rule %q", ErrNotReservable, res.route.Rule.Name)
	}
	if res.charges {
		// A reservation is made of one lease's tokens; the route's check charges several buckets.
		return Reservation{}, Verdict{}, fmt.Errorf("%w: rule %q charges several buckets", ErrNotReservable, res.route.Rule.Name)
	}
	e := res.e
	if e == nil {
		e = l.insert(res, tenant)
		res.e = e
	} else if !e.touched.Load() {
		e.touched.Store(true)
	}
	// Whole requests, at most the burst: a refill never asks for more than the bucket can hold.
	least := max(a.Least, bucket.Micro(res.cost))
	least += (e.unit - least%e.unit) % e.unit
	least = max(bucket.Micro(res.cost), min(least, e.lim.Bucket.Capacity()/e.unit*e.unit))
	want := max(least, a.Want-a.Want%e.unit)
	e.mu.Lock()
	defer e.unlock()
	for {
		if r, ok := l.reserveLeaseLocked(now, e, want, a.Life); ok {
			return r, Verdict{Outcome: Allow, Rule: e.rule, Limits: e.lim}, nil
		}
		if until := clock.Nanos(e.deniedUntil.Load()); now < until {
			return Reservation{}, Verdict{Outcome: Deny, RetryAfter: (until - now).Duration(), Rule: e.rule, Limits: e.lim}, nil
		}
		if e.dead.Load() {
			return Reservation{}, Verdict{Outcome: Wait, Ticket: retryTicket, Rule: e.rule, Limits: e.lim}, nil
		}
		if !e.usableLocked(now, 1) && l.promoteLocked(now, e) {
			continue
		}
		if exp := e.expires.Load(); exp != 0 && int64(now) >= exp {
			l.expiredLocked(now, e)
		}
		if e.fail != nil && now < e.fail.until {
			return Reservation{}, l.failedReserveLocked(now, e), nil
		}
		t := &Ticket{e: e, cost: int64(least), ready: make(chan struct{}), at: now}
		e.wait(t)
		if e.refilling.Load() && !e.queued && !e.inflight {
			// The refill was put off because a prefetched lease waits to be installed; a check
			// would have installed it, but it holds less than the reservation wants.
			e.refilling.Store(false)
		}
		l.queueLocked(e)
		return Reservation{}, Verdict{Outcome: Wait, Ticket: t, Rule: e.rule, Limits: e.lim}, nil
	}
}

// reserveLeaseLocked takes want from the current lease, or else from the prefetched one, if either
// lives long enough and holds it. e.mu is held.
func (l *Limiter) reserveLeaseLocked(now clock.Nanos, e *entry, want bucket.Micro, life time.Duration) (Reservation, bool) {
	if exp := clock.Nanos(e.expires.Load()); exp != 0 && exp-now >= clock.Of(life) {
		for {
			t := bucket.Micro(e.tokens.Load())
			if t < want {
				break
			}
			if e.tokens.CompareAndSwap(int64(t), int64(t-want)) {
				if int64(t-want) < e.lowWater.Load() {
					l.queueLocked(e) // a prefetch, as a check below the low water queues
				}
				return e.reservation(want, grant{expires: exp, grantedAt: e.grantedAt, recvAt: e.recvAt}), true
			}
		}
	}
	if n := e.s().next; n.tokens >= want && n.expires-now >= clock.Of(life) {
		e.sw().next.tokens -= want
		e.setRemainingLocked()
		return e.reservation(want, n), true
	}
	return Reservation{}, false
}

func (e *entry) reservation(tokens bucket.Micro, from grant) Reservation {
	from.tokens = 0
	return Reservation{Tokens: tokens, Expires: from.expires, Unit: e.unit, Rule: e.rule, Limits: e.lim, from: from, e: e}
}

// failedReserveLocked is a reservation's answer while e is in its failure mode: Unavailable until
// the backoff ends, Degraded when the rule's failure mode is its emergency bucket (which the holder
// applies itself: a reservation never spends the agent's).
func (l *Limiter) failedReserveLocked(now clock.Nanos, e *entry) Verdict {
	v := Verdict{Outcome: Unavailable, RetryAfter: max(0, e.fail.until-now).Duration(), Rule: e.rule, Limits: e.lim}
	v.Degraded = e.rule.OnFailure == policy.Emergency && e.lim.Emergency != nil
	return v
}

// Reserved completes a reservation whose Wait ticket is ready: the tokens the refill granted the
// ticket, with what is left of the same lease up to a.Want. If the refill was denied or failed,
// the verdict says so as Reserve's would; Wait means Reserve again (the key was retired while the
// ticket waited, or the lease came too late to live a.Life). Call it, or Unreserve, once per ticket.
func (l *Limiter) Reserved(now clock.Nanos, t *Ticket, a ReserveAsk) (Reservation, Verdict) {
	e := t.e
	if e == nil {
		return Reservation{}, t.Verdict()
	}
	e.mu.Lock()
	defer e.unlock()
	v := t.Verdict()
	if v.Outcome != Allow || v.Degraded {
		if v.Outcome == Allow {
			// The refill failed and the failure mode served the ticket from the emergency bucket.
			l.refundEmergencyLocked(e, t.cost)
		}
		if (v.Degraded || v.Outcome == Unavailable) && e.fail != nil {
			return Reservation{}, l.failedReserveLocked(now, e)
		}
		return Reservation{}, v // Deny, or Wait: reserve again
	}
	r := e.reservation(bucket.Micro(t.cost), t.from)
	if r.Expires-now < clock.Of(a.Life) {
		l.giveBackLocked(now, e, r.from, r.Tokens)
		return Reservation{}, Verdict{Outcome: Wait, Ticket: retryTicket, Rule: e.rule, Limits: e.lim}
	}
	// Top up from the rest of the same grant: installed as the current lease, or prefetched.
	if want := a.Want - r.Tokens; want >= e.unit {
		if e.sameLeaseLocked(r.from) {
			for {
				left := bucket.Micro(e.tokens.Load())
				take := min(want, left)
				take -= take % e.unit
				if take <= 0 || e.tokens.CompareAndSwap(int64(left), int64(left-take)) {
					r.Tokens += max(take, 0)
					break
				}
			}
		} else if e.sameNextLocked(r.from) {
			take := min(want, e.s().next.tokens)
			take -= take % e.unit
			e.sw().next.tokens -= take
			e.setRemainingLocked()
			r.Tokens += take
		}
	}
	return r, Verdict{Outcome: Allow, Rule: e.rule, Limits: e.lim}
}

// Unreserve drops a ticket Reserve returned: it leaves its key's queue, and what a refill granted
// it meanwhile is given back. Call it, or Reserved, once per ticket.
func (l *Limiter) Unreserve(now clock.Nanos, t *Ticket) {
	e := t.e
	if e == nil {
		return
	}
	e.mu.Lock()
	defer e.unlock()
	select {
	case <-t.ready:
		if v := t.v; v.Outcome == Allow {
			if v.Degraded {
				l.refundEmergencyLocked(e, t.cost)
			} else {
				l.giveBackLocked(now, e, t.from, bucket.Micro(t.cost))
			}
		}
		return
	default:
	}
	e.unwait(t)
	t.decideLocked(Verdict{Outcome: Wait})
}

// refundEmergencyLocked undoes the failure mode's take of c from e's emergency bucket for a
// reservation's ticket: a reservation is never an admission of the agent's emergency bucket.
func (l *Limiter) refundEmergencyLocked(e *entry, c int64) {
	if f := e.fail; f != nil && f.emergencyOn && e.lim.Emergency != nil {
		f.emergency.Tokens = min(e.lim.Emergency.Bucket.Capacity(), f.emergency.Tokens+bucket.Micro(c))
	}
	l.stats.Degraded.Add(^uint64(0)) // counted as an admission by failureLocked
}

// Release gives back unused µ of r (at most r.Tokens): the holder will never hand them out. They
// go back into the lease they came from while it is live and still the key's, else they are
// handed back to the coordinators like a retired lease's unspent tokens (credited less the refill
// since the lease's grant).
func (l *Limiter) Release(now clock.Nanos, r Reservation, unused bucket.Micro) {
	if r.e == nil || unused <= 0 {
		return
	}
	unused = min(unused, r.Tokens)
	r.e.mu.Lock()
	defer r.e.unlock()
	l.giveBackLocked(now, r.e, r.from, unused)
}

// giveBackLocked returns amount µ taken from the lease from to e: into that lease if it is still
// e's current or prefetched lease and live, else to the hand-back. e.mu is held.
func (l *Limiter) giveBackLocked(now clock.Nanos, e *entry, from grant, amount bucket.Micro) {
	if amount <= 0 {
		return
	}
	if !e.dead.Load() && now < from.expires {
		if e.sameLeaseLocked(from) {
			e.tokens.Add(int64(amount))
			return
		}
		if e.sameNextLocked(from) {
			e.sw().next.tokens += amount
			e.setRemainingLocked()
			return
		}
	}
	e.acct -= amount
	from.tokens = amount
	l.handBackLocked(now, e, from)
}

// sameLeaseLocked reports whether g is e's current lease. e.mu is held.
func (e *entry) sameLeaseLocked(g grant) bool {
	return e.expires.Load() == int64(g.expires) && g.expires != 0 && e.grantedAt == g.grantedAt && e.recvAt == g.recvAt
}

// sameNextLocked reports whether g is e's prefetched lease. e.mu is held.
func (e *entry) sameNextLocked(g grant) bool {
	n := e.s().next
	return n.tokens > 0 && n.expires == g.expires && n.grantedAt == g.grantedAt && n.recvAt == g.recvAt
}

// ObserveDemand feeds a rate of use of q's key, µ per second, that a holder of reservations
// measured (an Envoy's usage reports) into the key's demand, which sizes its leases: the lease
// itself sees only what was reserved, not how much of it the holder's clients wanted.
func (l *Limiter) ObserveDemand(q Query, rate bucket.Micro) error {
	v := l.view.Load()
	if v.closed.Load() {
		return ErrClosed
	}
	res, err := l.resolve(v, q)
	if err != nil {
		return err
	}
	l.observeDemandResolved(&res, q.Tenant, rate)
	return nil
}

// observeDemandResolved is ObserveDemand of a query resolved in res.view (as reserveResolved).
func (l *Limiter) observeDemandResolved(res *resolved, tenant string, rate bucket.Micro) {
	if res.view.closed.Load() || rate <= 0 {
		return
	}
	if e := res.e; e == nil || e.dead.Load() {
		res.e = res.view.table.get(res.hash, res.route.ID, tenant)
	}
	if e := res.e; e != nil { // a key not in the table: its first refill starts from nothing anyway
		e.mu.Lock()
		e.demand.Observe(rate, time.Second)
		e.unlock()
	}
}
