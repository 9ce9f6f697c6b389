package agent

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/policy"
)

// Costs known after the response. A check with Query.Settle is allowed on its cost as an
// estimate, and its answer carries a settle id (Verdict.SettleID). Settle then replaces the
// estimate by the actual cost, in every bucket the check charged:
//
//   - Less than the estimate: the difference goes back into the lease it was spent from while that
//     lease lives, else to the coordinators as a lease's unspent tokens (credited less the refill
//     since the lease's grant: the admission bound holds as for any hand-back).
//   - More: the extra is spent from the key's live lease as far as it holds, and the rest is debt,
//     sent with the key's next call and debited from the global bucket even below zero, down to the
//     rule's max_debt below zero (beyond that it is forgiven and counted). Admissions wait until the
//     bucket is above zero again: docs/leases.md ("Debt") proves the bounds with max_debt.
//
// The estimate is spent like any cost, so a check is refused on its estimate and nothing about a
// settle can refuse it afterwards. A hold (what Settle needs: the buckets, the leases the
// estimate came from) is kept for Config.SettleWindow; unsettled, the estimate stays charged.

const (
	// DefaultSettleWindow is how long a check's hold waits for its Settle: longer than any response
	// a gateway streams (a model's answer runs minutes at most), short enough that the holds of
	// clients that never settle go away.
	DefaultSettleWindow = 15 * time.Minute

	// DefaultMaxHolds bounds the holds waiting for Settle (about 200 bytes each): past it the oldest
	// is dropped, its estimate charged. 2^18 holds cover a thousand settled checks a second over
	// four minutes.
	DefaultMaxHolds = 1 << 18

	holdShards = 16
)

// ErrUnknownSettle is reported by Settle for an id this agent does not hold: never given, settled
// already, or dropped after the settle window.
var ErrUnknownSettle = errors.New("agent: unknown settle id (never given, already settled, or expired)")

// hold is what Settle needs of an allowed check: each bucket it charged and the lease its
// estimate was spent from (from.expires == 0: not known, or none: then an unused estimate is not
// credited back, it stays spent).
type hold struct {
	n        int
	c        [policy.MaxCharges + 1]heldCharge
	estimate bucket.Micro // the estimate, charged to each bucket
	at       clock.Nanos
}

// most is the largest actual cost a settle of hd may carry: the least room (settleRoom) of its
// buckets.
func (hd *hold) most() bucket.Micro {
	most := settleRoom(hd.c[0].e.lim)
	for _, c := range hd.c[1:hd.n] {
		most = min(most, settleRoom(c.e.lim))
	}
	return most
}

// settleRoom is what one settle may charge a bucket of lim: its capacity plus its max_debt.
func settleRoom(lim *policy.Limits) bucket.Micro { return lim.Bucket.Capacity() + lim.MaxDebt }

type heldCharge struct {
	e    *entry
	from grant
}

// holds is the table of holds, sharded by id; each shard drops its holds in the order they came
// (the window is the same for all), so expiry costs a look at the oldest.
type holds struct {
	next   atomic.Uint64
	window clock.Nanos
	max    int // per shard
	shards [holdShards]holdShard
}

type holdShard struct {
	mu    sync.Mutex
	m     map[uint64]*hold
	order []heldID // ids by age; settled ones are skipped when they come up
	head  int
}

type heldID struct {
	id uint64
	at clock.Nanos
}

func newHolds(window time.Duration, most int) *holds {
	if window <= 0 {
		window = DefaultSettleWindow
	}
	if most <= 0 {
		most = DefaultMaxHolds
	}
	h := &holds{window: clock.Of(window), max: max(1, most/holdShards)}
	// Ids start at a random point, so that a restarted agent does not settle ids of its former
	// self: a client's late Settle is refused, not applied to a stranger's check.
	var b [8]byte
	_, _ = rand.Read(b[:])
	h.next.Store(binary.LittleEndian.Uint64(b[:]) >> 1)
	for i := range h.shards {
		h.shards[i].m = make(map[uint64]*hold)
	}
	return h
}

// put keeps hd and returns its id; dropped reports holds dropped to make room or past the window.
func (h *holds) put(now clock.Nanos, hd *hold) (id uint64, dropped int) {
	id = h.next.Add(1)
	if id == 0 {
		id = h.next.Add(1)
	}
	s := &h.shards[id%holdShards]
	s.mu.Lock()
	defer s.mu.Unlock()
	for s.head < len(s.order) {
		o := s.order[s.head]
		if _, ok := s.m[o.id]; ok && now-o.at < h.window && len(s.m) < h.max {
			break
		}
		if _, ok := s.m[o.id]; ok {
			delete(s.m, o.id)
			dropped++
		}
		s.order[s.head] = heldID{}
		s.head++
	}
	if s.head > len(s.order)/2 && s.head > 64 {
		s.order = append(s.order[:0], s.order[s.head:]...)
		s.head = 0
	}
	hd.at = now
	s.m[id] = hd
	s.order = append(s.order, heldID{id: id, at: now})
	return id, dropped
}

// take removes and returns the hold of id if it is there, within the window, and cost (µ) fits it.
func (h *holds) take(now clock.Nanos, id uint64, cost bucket.Micro) (*hold, error) {
	s := &h.shards[id%holdShards]
	s.mu.Lock()
	defer s.mu.Unlock()
	hd, ok := s.m[id]
	if !ok || now-hd.at >= h.window {
		return nil, ErrUnknownSettle
	}
	if most := hd.most(); cost > most {
		return nil, fmt.Errorf("%w: settled cost %d is above %d, the capacity plus max_debt of a bucket the check charged",
			ErrInvalidCost, cost/bucket.PerToken, most/bucket.PerToken)
	}
	delete(s.m, id)
	return hd, nil
}

// Len is the number of holds waiting for Settle.
func (h *holds) Len() int {
	n := 0
	for i := range h.shards {
		s := &h.shards[i]
		s.mu.Lock()
		n += len(s.m)
		s.mu.Unlock()
	}
	return n
}

// checkSettle decides a check with Query.Settle on leases: as a check of several buckets (one,
// or its route's charges), so that the lease each estimate was spent from is known, then keeps
// the hold. res.e of a route without charges may be nil (first check of the key).
func (l *Limiter) checkSettle(now clock.Nanos, res *resolved, tenant string) Verdict {
	var cs [policy.MaxCharges + 1]charge
	n := l.chargeEntries(res, tenant, &cs)
	var from [policy.MaxCharges + 1]grant
	if l.spendHeld(now, cs[:n], &from) {
		v := allowCharges(cs[:n])
		v.SettleID = l.keepHold(now, res.cost, cs[:n], from[:n])
		return v
	}
	// A lease cannot serve: spendAll decides (a denial, the failure mode, a refill to wait for,
	// a shadow rule's bucket), and if it allows after all, the leases are read back below (a
	// lease replaced in between is not known: its estimate is not credited back).
	v, refused := l.spendAll(now, cs[:n])
	switch {
	case v.Outcome == Allow && v.Rule == nil:
		v = allowCharges(cs[:n])
	case v.Outcome == Allow: // a shadow rule's denial, or the failure mode's emergency bucket
	case v.Rule == nil:
		v.Rule, v.Limits = res.route.Rule, res.lim
		return v
	default:
		return v
	}
	for i, ch := range cs[:n] {
		if refused >= 0 || ch.skipped || ch.lease == 0 {
			continue // not spent from a lease (what was, was refunded)
		}
		e := ch.e
		e.mu.Lock()
		if e.expires.Load() == ch.lease {
			from[i] = grant{expires: clock.Nanos(ch.lease), grantedAt: e.grantedAt, recvAt: e.recvAt}
		}
		e.unlock()
	}
	v.SettleID = l.keepHold(now, res.cost, cs[:n], from[:n])
	return v
}

// spendHeld spends each charge's cost from its entry's live lease (promoting a prefetched one)
// under the entry's lock, so that the lease it came from is known for certain (from): a lease is
// installed and retired only under that lock. All or nothing: when one cannot serve, what was
// spent goes back into its lease and spendHeld reports false.
func (l *Limiter) spendHeld(now clock.Nanos, cs []charge, from *[policy.MaxCharges + 1]grant) bool {
	for i := range cs {
		e, c := cs[i].e, cs[i].cost
		cs[i].skipped = false
		e.mu.Lock()
		ok, low := false, false
		if !e.dead.Load() && (e.usableLocked(now, c) || l.promoteLocked(now, e)) {
			if left, lease, spent := e.spendLease(now, c); spent {
				cs[i].lease = lease // under the lock the lease cannot change: lease is its expiry
				from[i] = grant{expires: clock.Nanos(lease), grantedAt: e.grantedAt, recvAt: e.recvAt}
				ok, low = true, left < e.lowWater.Load() && !e.refilling.Load()
			}
		}
		e.unlock()
		if low {
			l.prefetch(e)
		}
		if !ok {
			l.refund(cs[:i])
			return false
		}
	}
	return true
}

// holdAfter keeps the hold of a check with Query.Settle that was allowed without one: a rule with
// lease: off (its estimate was one atomic take, no lease holds it), or an answer of the failure
// mode's emergency bucket. Its estimate is not credited back; extra cost is debt as always.
func (l *Limiter) holdAfter(now clock.Nanos, q Query) uint64 {
	v := l.view.Load()
	var res resolved
	if v.closed.Load() || l.resolveInto(v, q, &res) != nil {
		return 0
	}
	var cs [policy.MaxCharges + 1]charge
	n := l.chargeEntries(&res, q.Tenant, &cs)
	return l.keepHold(now, res.cost, cs[:n], nil)
}

// keepHold keeps the hold of an allowed check of estimate µ over the charges cs, whose costs came
// from the leases from (nil, or a zero grant: not known) and returns its settle id.
func (l *Limiter) keepHold(now clock.Nanos, estimate int64, cs []charge, from []grant) uint64 {
	hd := &hold{n: len(cs), estimate: bucket.Micro(estimate)}
	for i, ch := range cs {
		hd.c[i].e = ch.e
		if from != nil {
			hd.c[i].from = from[i]
		}
	}
	id, dropped := l.holds.put(now, hd)
	l.stats.Holds.Add(1)
	if dropped > 0 {
		l.stats.HoldsDropped.Add(uint64(dropped))
	}
	return id
}

// SettleResult is what Settle did, in µ.
type SettleResult struct {
	Charged  bucket.Micro // beyond the estimate: spent from leases or sent as debt (per bucket)
	Credited bucket.Micro // the estimate's unused part, given back (per bucket)
	Debt     bucket.Micro // of Charged, the most any one bucket sent to the global bucket as debt
	// Forgiven is, once Confirmed, the most debt any bucket did not debit (it was at its
	// max_debt below zero).
	Forgiven bucket.Micro

	waits []*debtWaiter // the debts sent, one per bucket with debt
}

// Debited waits until every debt of r was answered by the global buckets, or ctx ends; it
// reports whether all were confirmed debited (r.Forgiven is then set). A settle without debt is
// confirmed at once.
func (r *SettleResult) Debited(ctx context.Context) bool {
	for _, w := range r.waits {
		select {
		case <-w.done:
		case <-ctx.Done():
			return false
		}
		if !w.ok {
			return false
		}
		r.Forgiven = max(r.Forgiven, w.amount-w.charged)
	}
	return true
}

// Settle replaces the estimate of the check id by its actual cost (tokens, 0 or more). Errors:
// ErrUnknownSettle; ErrInvalidCost for a negative cost or one above a bucket's capacity plus its
// max_debt (the hold is kept: a corrected Settle can follow). Settling twice is ErrUnknownSettle:
// nothing is charged twice.
func (l *Limiter) Settle(now clock.Nanos, id uint64, cost int64) (SettleResult, error) {
	if cost < 0 {
		return SettleResult{}, fmt.Errorf("%w: settled cost %d is negative", ErrInvalidCost, cost)
	}
	if cost > bucket.MaxExact/int64(bucket.PerToken) {
		return SettleResult{}, fmt.Errorf("%w: settled cost %d is too large", ErrInvalidCost, cost)
	}
	actual := bucket.Micro(cost) * bucket.PerToken
	hd, err := l.holds.take(now, id, actual)
	if err != nil {
		return SettleResult{}, err
	}
	l.stats.Settles.Add(1)
	var r SettleResult
	switch {
	case actual < hd.estimate:
		r.Credited = hd.estimate - actual
		for _, hc := range hd.c[:hd.n] {
			l.creditBack(now, hc, r.Credited)
		}
	case actual > hd.estimate:
		r.Charged = actual - hd.estimate
		for _, hc := range hd.c[:hd.n] {
			if w := l.chargeExtra(now, hc.e, r.Charged); w != nil {
				r.Debt = max(r.Debt, w.amount)
				r.waits = append(r.waits, w)
			}
		}
	}
	return r, nil
}

// creditBack gives back amount of an estimate spent from hc.from: into that lease while it lives,
// else handed back to the coordinators. An estimate whose lease is not known stays spent.
func (l *Limiter) creditBack(now clock.Nanos, hc heldCharge, amount bucket.Micro) {
	if hc.from.expires == 0 {
		l.stats.SettleUncredited.Add(uint64(amount))
		return
	}
	l.stats.SettleCredited.Add(uint64(amount))
	e := hc.e
	e.mu.Lock()
	l.giveBackLocked(now, e, hc.from, amount)
	e.unlock()
}

// chargeExtra charges amount beyond an estimate to e's bucket: from its live lease as far as it
// holds, the rest as debt for the key's next call. It returns the debt's waiter (nil: no debt).
func (l *Limiter) chargeExtra(now clock.Nanos, e *entry, amount bucket.Micro) *debtWaiter {
	if e.dead.Load() {
		e = l.liveEntry(e)
		if e == nil {
			l.stats.DebtLost.Add(uint64(amount))
			return nil
		}
	}
	if int64(now) < e.expires.Load() {
		for {
			t := e.tokens.Load()
			take := min(t, int64(amount))
			if take <= 0 || e.tokens.CompareAndSwap(t, t-take) {
				amount -= bucket.Micro(max(take, 0))
				l.stats.SettleSpent.Add(uint64(max(take, 0)))
				break
			}
		}
	}
	if amount == 0 {
		return nil
	}
	e.mu.Lock()
	defer e.unlock()
	s := e.sw()
	s.debt += amount
	w := &debtWaiter{amount: amount, done: make(chan struct{})}
	s.debtWait = append(s.debtWait, w)
	l.stats.DebtMicro.Add(uint64(amount))
	l.oweLocked(now, e)
	return w
}

// debtWaiter is a settle waiting for its debt's debit: amount µ, of which charged was debited
// (the rest forgiven) once done is closed with ok; not ok, the debit is not known (it goes
// again with the key's calls, or was lost).
type debtWaiter struct {
	amount, charged bucket.Micro
	ok              bool
	done            chan struct{}
}

// debited answers the waiters of one debt, charged µ of it debited: the first in order are
// charged first.
func debited(ws []*debtWaiter, charged bucket.Micro) {
	for _, w := range ws {
		w.charged = min(w.amount, max(charged, 0))
		charged -= w.charged
		w.ok = true
		close(w.done)
	}
}

// unconfirmed answers waiters whose debt's debit is not known.
func unconfirmed(ws []*debtWaiter) {
	for _, w := range ws {
		close(w.done)
	}
}

// oweLocked has e's debt, if it owes one, sent with its next call: queued now unless a call of e
// is out or queued (its answer requeues it) or e is in its failure mode (the next call after the
// backoff carries it: Expire queues it). e.mu is held.
func (l *Limiter) oweLocked(now clock.Nanos, e *entry) {
	if !e.owesLocked() || e.inflight || e.queued || (e.fail != nil && now < e.fail.until) {
		return
	}
	e.refilling.Store(true)
	e.sw().debtOnly = true
	l.enqueueLocked(e)
}

// owesLocked reports whether e has debt to send: pending, or carried by a call of unknown outcome
// that its next call resends. e.mu is held.
func (e *entry) owesLocked() bool {
	return e.s().debt > 0 || (e.fail != nil && e.fail.lostSeq != 0 && e.fail.lostDebt > 0)
}

// liveEntry is the current entry of the key of a retired entry e (evicted, inserted again if
// needed), or nil when e's policy view was replaced: a debt then has no bucket to go to.
func (l *Limiter) liveEntry(e *entry) *entry {
	v := l.view.Load()
	if e.view != v || v.closed.Load() {
		return nil
	}
	r := v.set.RouteByID(e.route)
	res := resolved{view: v, route: r, lim: e.lim, hash: e.hash}
	if ce := v.table.get(e.hash, e.route, e.tenant); ce != nil {
		return ce
	}
	return l.insert(&res, e.tenant)
}

// validAfter checks a cost charged after the fact (ChargeAfter): its route and tenant resolve,
// and it is 1..the least capacity + max_debt of the buckets it charges.
func (l *Limiter) validAfter(v *view, q Query) error {
	var res resolved
	_, err := l.resolveAfter(v, q, &res)
	return err
}

// resolveAfter resolves a cost charged after the fact into res (with a placeholder cost: res.cost
// is not q's) and returns q's cost in tokens, checked against the room (settleRoom) of every bucket
// it charges.
func (l *Limiter) resolveAfter(v *view, q Query, res *resolved) (int64, error) {
	cost := q.Cost
	q.Cost = 1
	if err := l.resolveInto(v, q, res); err != nil {
		return 0, err
	}
	if cost == 0 {
		cost = v.set.Cost(res.route)
	}
	most := settleRoom(res.lim)
	for _, id := range res.route.Charges() {
		lim, err := v.set.Limits(v.set.RouteByID(id), q.Tenant, l.cfg.Region)
		if err != nil {
			return 0, fmt.Errorf("%w: %w", ErrInvalidRoute, err)
		}
		most = min(most, settleRoom(lim))
	}
	if cost < 1 || cost > int64(most/bucket.PerToken) {
		return 0, fmt.Errorf("%w: cost %d after the response is not in 1..%d, the capacity plus max_debt of rule %q",
			ErrInvalidCost, cost, most/bucket.PerToken, res.route.Rule.Name)
	}
	return cost, nil
}

// ChargeAfter charges q.Cost, incurred after the response and never refused, in every bucket a
// check of q charges: from the key's live lease as far as it holds, the rest as debt (as Settle
// charges what exceeds an estimate). An invalid q (resolveAfter) charges nothing.
func (l *Limiter) ChargeAfter(now clock.Nanos, q Query) error {
	v := l.view.Load()
	if v.closed.Load() {
		return ErrClosed
	}
	var res resolved
	cost, err := l.resolveAfter(v, q, &res)
	if err != nil {
		return err
	}
	var cs [policy.MaxCharges + 1]charge
	n := l.chargeEntries(&res, q.Tenant, &cs)
	l.stats.ChargedAfter.Add(1)
	for _, ch := range cs[:n] {
		l.chargeExtra(now, ch.e, bucket.Micro(cost)*bucket.PerToken) // Envoy does not wait for the debit
	}
	return nil
}
