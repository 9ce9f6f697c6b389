package agent

import (
	"errors"
	"fmt"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/policy"
)

// A check of a route with charges (policy.Route.Charges: its rule's further limits, the tenant
// budgets covering its operation) spends its cost from every bucket or from none. Each bucket is
// an entry of the lease table like any other, refilled and handed back on its own; what ties them
// is the check:
//
//  1. Spend the cost from each entry's current lease, lock-free, in order.
//  2. If one cannot (no live lease, too few tokens), give back what was taken from the others,
//     each to the lease it came from (refund), and decide that entry without spending from it
//     (probe): a cached denial or the failure mode answers the check; a lease that turned usable
//     meanwhile, or a prefetched one promoted, starts over; otherwise the check waits for the
//     entry's refill with a ticket that spends nothing and, once the refill is in, asks for the
//     whole check to be made again (the Server does, as for a key retired while it waited).
//
// So no charge is ever left behind: an allowed check spent every cost, a refused one none (an
// entry's emergency bucket aside: when one bucket cannot be reached and its rule falls back on an
// emergency bucket, that bucket alone decides, degraded, as for a check of one bucket). Each
// entry's lease keeps every bound of docs/leases.md on its own: a token is spent only from a live
// lease, and a refunded one goes back only into the lease it came from, or is never spent.

// errChargeCost is wrapped when a check's cost exceeds the burst of one of the buckets it charges.
var errChargeCost = errors.New("the cost exceeds the burst of a bucket the check charges")

// maxAttempts bounds how often a check of several buckets starts over when concurrent checks
// took the tokens it found, before it answers Wait with a ticket that is already decided (check
// again): the caller's wait bound then applies.
const maxAttempts = 4

// charge is one bucket of a check of several: its entry, the cost charged to it, and the lease
// the cost was spent from (the lease's expiry, its identity: a refund goes back only into that
// lease).
type charge struct {
	e     *entry
	cost  int64
	lease int64
	// skipped: a shadow rule's bucket that could not serve; the check goes on without it (a
	// shadow rule is reported, never enforced), and nothing was spent from it.
	skipped bool
}

// checkCharges decides a check of a route with charges (see above). The common case, every lease
// serving, is spendLinked's: lock-free, with no list of charges built.
func (l *Limiter) checkCharges(now clock.Nanos, res *resolved, tenant string) Verdict {
	if e := res.e; e != nil && e.touched.Load() {
		if ln := e.links.Load(); ln != nil {
			if least, left, ok := l.spendLinked(now, e, ln, res.cost); ok {
				return Verdict{Outcome: Allow, Remaining: bucket.Micro(left), Rule: least.rule, Limits: least.lim}
			}
		}
	}
	return l.checkChargesAll(now, res, tenant)
}

// checkChargesAll is checkCharges once its leases cannot all serve (spendAll decides).
func (l *Limiter) checkChargesAll(now clock.Nanos, res *resolved, tenant string) Verdict {
	var cs [policy.MaxCharges + 1]charge
	n := l.chargeEntries(res, tenant, &cs)
	v, _ := l.spendAll(now, cs[:n])
	switch {
	case v.Outcome == Allow && v.Rule == nil:
		return allowCharges(cs[:n])
	case v.ShadowDeny:
		// Allowed, and a shadow rule's bucket would have refused: reported with that rule.
		return v
	case v.Rule == nil:
		v.Rule, v.Limits = res.route.Rule, res.lim
	}
	return v
}

// spendLinked is the common case of a check of several buckets: the key's entry is known and
// used, its links are found, and every bucket's lease serves the cost. It spends the cost from
// e's lease, then from each link's, lock-free, and reports the bucket with the fewest requests
// left and what it has left, as allowCharges does; a lease it leaves below its low water is
// refilled ahead of need. The links are looked at before anything is spent, so a flood over one
// limit never touches the others. ok is false when a lease cannot serve, and nothing is left
// spent (a link that a concurrent check emptied after the look has what was spent before it
// refunded): spendAll decides (a cached denial, a shadow rule's bucket, a prefetched lease, a
// refill to wait for).
func (l *Limiter) spendLinked(now clock.Nanos, e *entry, ln *chargeLinks, c int64) (least *entry, leastLeft int64, ok bool) {
	links := ln.e[:ln.n]
	for _, ce := range links {
		// A dead link's lease was retired (a dead entry never gets another): it cannot serve, and
		// chargeEntries finds the current entry.
		if int64(now) >= ce.expires.Load() || ce.tokens.Load() < c {
			return nil, 0, false
		}
		if !ce.touched.Load() {
			ce.touched.Store(true)
		}
	}
	left, lease, ok := e.spendLease(now, c)
	if !ok {
		return nil, 0, false
	}
	if left < e.lowWater.Load() && !e.refilling.Load() {
		l.prefetch(e)
	}
	least, leastLeft = e, left+e.remaining.Load()
	var leases [policy.MaxCharges]int64 // the lease each link's cost came from, for a refund
	for i, ce := range links {
		if left, leases[i], ok = ce.spendLease(now, c); !ok {
			l.refundLinked(e, lease, links[:i], leases[:i], c)
			return nil, 0, false
		}
		if left < ce.lowWater.Load() && !ce.refilling.Load() {
			l.prefetch(ce)
		}
		if all := left + ce.remaining.Load(); all < leastLeft {
			least, leastLeft = ce, all
		}
	}
	return least, leastLeft, true
}

// refundLinked undoes what spendLinked spent before a link could not serve: c from e's lease
// and from each of links' (leases: where each came from).
func (l *Limiter) refundLinked(e *entry, lease int64, links []*entry, leases []int64, c int64) {
	var cs [policy.MaxCharges + 1]charge
	cs[0] = charge{e: e, cost: c, lease: lease}
	for i, ce := range links {
		cs[i+1] = charge{e: ce, cost: c, lease: leases[i]}
	}
	l.refund(cs[:len(links)+1])
}

// spendAll spends every charge's cost or none. Allowed, the verdict is a bare Allow (the caller
// completes it) and refused is -1; otherwise refused is the charge whose bucket decided (a
// denial, its failure mode, or Wait for its refill: nothing is spent anywhere).
func (l *Limiter) spendAll(now clock.Nanos, cs []charge) (v Verdict, refused int) {
	for range maxAttempts {
		// A bucket that refuses for now (a cached denial, a lease that cannot serve) refuses the
		// check before anything is spent: a flood over one limit never touches the others.
		if j := refusing(now, cs); j >= 0 {
			v, again := l.probe(now, cs[j].e, cs[j].cost)
			if again {
				continue
			}
			return l.longestRetry(now, v, cs), j
		}
		var shadowed Verdict // a shadow rule's bucket that would have refused: reported, not enforced
		var probed *Verdict  // the decision of a shadow rule's bucket probed below, if it decides
		i := 0
		for ; i < len(cs); i++ {
			cs[i].lease, cs[i].skipped = 0, false
			_, exp, ok := cs[i].e.spendLease(now, cs[i].cost)
			if ok {
				cs[i].lease = exp
				continue
			}
			if !cs[i].e.rule.Shadow {
				break
			}
			v, again := l.probe(now, cs[i].e, cs[i].cost)
			if !again && v.ShadowDeny {
				cs[i].skipped, shadowed = true, v
				continue
			}
			if again {
				if _, exp, ok := cs[i].e.spendLease(now, cs[i].cost); ok {
					cs[i].lease = exp
					continue
				}
			} else {
				probed = &v
			}
			break
		}
		if i == len(cs) {
			for _, ch := range cs {
				if e := ch.e; e.tokens.Load() < e.lowWater.Load() && !e.refilling.Load() {
					l.prefetch(e)
				}
			}
			if shadowed.ShadowDeny {
				return shadowed, -1
			}
			return Verdict{Outcome: Allow}, -1
		}
		l.refund(cs[:i])
		if probed != nil {
			return l.longestRetry(now, *probed, cs), i
		}
		v, again := l.probe(now, cs[i].e, cs[i].cost)
		if again {
			continue
		}
		return l.longestRetry(now, v, cs), i
	}
	return Verdict{Outcome: Wait, Ticket: retryTicket}, 0
}

// refusing is the first charge whose entry has a cached denial and no lease that can serve it.
func refusing(now clock.Nanos, cs []charge) int {
	for j, ch := range cs {
		e := ch.e
		if int64(now) < e.deniedUntil.Load() && (int64(now) >= e.expires.Load() || e.tokens.Load() < ch.cost) && !e.rule.Shadow {
			return j
		}
	}
	return -1
}

// longestRetry completes a denial of a check of several buckets: it names the bucket that
// refused, and its Retry-After is the longest any bucket of the check is known to refuse for.
func (l *Limiter) longestRetry(now clock.Nanos, v Verdict, cs []charge) Verdict {
	if v.Outcome != Deny || v.Degraded || v.ShadowDeny {
		return v
	}
	for _, ch := range cs {
		if until := clock.Nanos(ch.e.deniedUntil.Load()); until > now && (until-now).Duration() > v.RetryAfter {
			v.RetryAfter = (until - now).Duration()
		}
	}
	return v
}

// chargeEntries fills cs with the entries of the check's buckets (inserting those used for the
// first time) and returns how many there are.
func (l *Limiter) chargeEntries(res *resolved, tenant string, cs *[policy.MaxCharges + 1]charge) int {
	e := res.e
	if e == nil {
		e = l.insert(res, tenant)
	} else if !e.touched.Load() {
		e.touched.Store(true)
	}
	cs[0].e, cs[0].cost = e, res.cost
	if ln := e.links.Load(); ln != nil {
		live := true
		for i, ce := range ln.e[:ln.n] {
			if ce.dead.Load() {
				live = false // evicted or retired: find the current entries
				break
			}
			if !ce.touched.Load() {
				ce.touched.Store(true)
			}
			cs[i+1].e, cs[i+1].cost = ce, res.cost
		}
		if live {
			return ln.n + 1
		}
	}
	n := 1
	v := res.view
	ln := &chargeLinks{}
	for _, id := range res.route.Charges() {
		h := rehash(res.hash, res.route.ID, id)
		ce := v.table.get(h, id, tenant)
		if ce == nil {
			r := v.set.RouteByID(id)
			lim, err := v.set.Limits(r, tenant, l.cfg.Region)
			if err != nil {
				continue // resolve checked every charge of the query; a route of this Set resolves
			}
			cr := resolved{view: v, route: r, lim: lim, cost: res.cost, hash: h}
			ce = l.insert(&cr, tenant)
		} else if !ce.touched.Load() {
			ce.touched.Store(true)
		}
		cs[n].e, cs[n].cost = ce, res.cost
		ln.e[ln.n] = ce
		ln.n++
		n++
	}
	e.links.Store(ln)
	return n
}

// allowCharges completes an allowed check of several buckets of one cost: it reports the bucket
// with the fewest requests left.
func allowCharges(cs []charge) Verdict {
	var least *entry
	var leastLeft int64
	for _, ch := range cs {
		e := ch.e
		if all := e.tokens.Load() + e.remaining.Load(); least == nil || all < leastLeft {
			least, leastLeft = e, all
		}
	}
	return Verdict{Outcome: Allow, Remaining: bucket.Micro(leastLeft), Rule: least.rule, Limits: least.lim}
}

// spendLease is spend that also reports which lease the tokens came from (its expiry), and what
// that lease holds after the decrement (left). The lease is known only if it is still current
// after the decrement; otherwise the expiry reported is 0
// and a refund of these tokens is not made (they stay spent: the rare race with a refill loses
// them, it never moves a token into another lease).
func (e *entry) spendLease(now clock.Nanos, cost int64) (left, lease int64, ok bool) {
	exp := e.expires.Load()
	if int64(now) >= exp {
		return 0, 0, false
	}
	for {
		t := e.tokens.Load()
		if t < cost {
			return t, 0, false
		}
		if e.tokens.CompareAndSwap(t, t-cost) {
			if e.expires.Load() != exp {
				return t - cost, 0, true
			}
			return t - cost, exp, true
		}
	}
}

// refund gives the cost back to the lease each charge took it from, if that lease is still the
// entry's current one (retiring and installing leases happen under the entry's lock, held here);
// otherwise the lease was retired and handed back without these tokens, which stay spent.
func (l *Limiter) refund(cs []charge) {
	for _, ch := range cs {
		if ch.skipped {
			continue
		}
		e := ch.e
		e.mu.Lock()
		if ch.lease != 0 && e.expires.Load() == ch.lease {
			e.tokens.Add(ch.cost)
			l.stats.Refunds.Add(1)
		} else {
			l.stats.RefundsLost.Add(1)
			l.stats.RefundsLostMicro.Add(uint64(ch.cost))
		}
		e.unlock()
	}
}

// probe decides an entry of a check of several buckets that its current lease cannot serve,
// without spending from it: again is true when a lease can now serve it (start over); otherwise
// the verdict is a denial or the failure mode, or Wait for the entry's refill with a ticket that
// asks for the check to be made again.
func (l *Limiter) probe(now clock.Nanos, e *entry, c int64) (v Verdict, again bool) {
	e.mu.Lock()
	defer e.unlock()
	if e.dead.Load() {
		return Verdict{Outcome: Wait, Ticket: retryTicket, Rule: e.rule, Limits: e.lim}, false
	}
	if e.usableLocked(now, c) || l.promoteLocked(now, e) {
		return Verdict{}, true
	}
	if until := clock.Nanos(e.deniedUntil.Load()); now < until {
		e.refused += bucket.Micro(c)
		return l.shadow(e, Verdict{Outcome: Deny, RetryAfter: (until - now).Duration()}), false
	}
	if exp := e.expires.Load(); exp != 0 && int64(now) >= exp {
		l.expiredLocked(now, e)
	}
	if e.fail != nil && now < e.fail.until {
		return l.failureLocked(now, e, c), false
	}
	t := &Ticket{e: e, cost: c, ready: make(chan struct{}), recheck: true}
	e.wait(t)
	l.queueLocked(e)
	return Verdict{Outcome: Wait, Ticket: t, Rule: e.rule, Limits: e.lim}, false
}

// resolveCharges checks a query's own cost against every bucket its route charges besides its
// own, as resolve does for its own. (The rule's costs are checked against every limit and tenant
// budget when the policy is loaded.)
func (l *Limiter) resolveCharges(v *view, r policy.Route, tenant string, cost int64) error {
	for _, id := range r.Charges() {
		c := v.set.RouteByID(id)
		lim, err := v.set.Limits(c, tenant, l.cfg.Region)
		if err != nil {
			return fmt.Errorf("%w: %w", ErrInvalidRoute, err)
		}
		if burst := int64(lim.Bucket.Capacity() / bucket.PerToken); cost > burst {
			return fmt.Errorf("%w: %w: cost %d, burst %d of %q", ErrInvalidCost, errChargeCost, cost, burst, c.Rule.Name)
		}
	}
	return nil
}
