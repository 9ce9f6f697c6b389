package agent

import (
	"math"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// Reply is how a call ended, as its shell saw it (Classify reads a gRPC error).
type Reply struct {
	Failure Failure
	// Acquire and Return are the coordinator's answer when Failure is Answered.
	Acquire *coordinatorv1.AcquireResponse
	Return  *coordinatorv1.ReturnResponse
}

// Failure says whether and how a call failed.
type Failure uint8

const (
	// Answered means the coordinator answered; the reply holds its answer.
	Answered Failure = iota
	// NotApplied means the coordinator refused the call (malformed, credentials, shutting down): the
	// store did nothing.
	NotApplied
	// UnknownPolicy means the coordinator does not know this agent's policy version: nothing was
	// applied, and the shell reloads the policy.
	UnknownPolicy
	// MaybeApplied means no answer, and the store may have applied the call (a timeout, a connection
	// lost, the store timing out). A refill of its keys sends its seq again.
	MaybeApplied
)

// Apply hands the core the reply to c, received at now: grants are installed or go to the checks
// waiting for them, denials and failures decide those checks, and what was handed back is
// accounted. It reports ErrUnknownPolicy when the policy must be reloaded.
func (l *Limiter) Apply(now clock.Nanos, c *Call, r Reply) error {
	if c.Acquire != nil {
		return l.applyAcquire(now, c, r)
	}
	l.applyReturns(c, r.Failure, len(c.Return.Items), func(i int) *coordinatorv1.ReturnResult {
		return r.Return.GetResults()[i]
	}, len(r.Return.GetResults()))
	return nil
}

func (l *Limiter) applyAcquire(now clock.Nanos, c *Call, r Reply) error {
	f := r.Failure
	if f == Answered && len(r.Acquire.GetResults()) != len(c.entries) {
		f = MaybeApplied // a coordinator that answers another call than ours: trust nothing of it
	}
	l.applyReturns(c, f, len(c.Acquire.Returns), func(i int) *coordinatorv1.ReturnResult {
		return r.Acquire.GetReturns()[i]
	}, len(r.Acquire.GetReturns()))
	var mismatch error
	if f != Answered {
		l.stats.AcquireErrors.Add(1)
		if f == UnknownPolicy {
			l.stats.PolicyMismatch.Add(1)
			mismatch = ErrUnknownPolicy
		}
		for i, e := range c.entries {
			it := c.Acquire.Items[i]
			e.mu.Lock()
			e.inflight = false
			if it.ReturnMicro > 0 {
				if f == MaybeApplied {
					l.handedBack(it.ReturnMicro)
					l.stats.LostMicro.Add(uint64(it.ReturnMicro))
				} else {
					// Not applied: the lease goes back to waiting to be handed back.
					e.sw().back.add(bucket.Micro(it.ReturnMicro), bucket.Millis(it.ReturnGrantedAtMs), c.sentAt)
					l.settleBackLocked(now, e)
				}
			}
			l.failLocked(now, e)
			e.fail.setLost(c, f == MaybeApplied)
			if it.DebtMicro > 0 {
				l.debtFailedLocked(e, c, f == MaybeApplied)
			}
			e.unlock()
		}
		return mismatch
	}
	for i, e := range c.entries {
		res := r.Acquire.Results[i]
		e.mu.Lock()
		e.inflight = false
		if e.fail != nil {
			// Answered: the coordinator's record of this seq is what it says (an item the store
			// may have applied without answering is the one exception, below).
			e.fail.setLost(c, false)
		}
		if back := c.Acquire.Items[i].ReturnMicro; back > 0 {
			switch res.Status {
			case coordinatorv1.Status_STATUS_OK, coordinatorv1.Status_STATUS_DENIED:
				l.handedBack(back)
				l.stats.CreditedMicro.Add(uint64(max(0, res.CreditedMicro)))
			case coordinatorv1.Status_STATUS_STALE:
				// Nothing was done: the lease waits to be handed back again.
				e.sw().back.add(bucket.Micro(back), bucket.Millis(c.Acquire.Items[i].ReturnGrantedAtMs), c.sentAt)
				l.settleBackLocked(now, e)
			default:
				l.handedBack(back)
				l.stats.LostMicro.Add(uint64(back))
			}
		}
		it := c.Acquire.Items[i]
		if it.NeededMicro == 0 && it.MinMicro == 0 && res.Status == coordinatorv1.Status_STATUS_OK {
			// An item of debt alone: nothing was asked for, the lease and the deny cache stand.
			l.debtAnsweredLocked(e, c, res)
			if e.s().next.tokens == 0 {
				e.refilling.Store(false)
			}
			e.level = bucket.Micro(res.RemainingMicro)
			e.setRemainingLocked()
			if len(e.s().waiting) > 0 {
				l.queueLocked(e)
			}
			l.oweLocked(now, e) // the call that carried the last debt is back
			e.unlock()
			continue
		}
		e.refilling.Store(false)
		switch res.Status {
		case coordinatorv1.Status_STATUS_OK:
			l.grantLocked(now, c, e, res)
		case coordinatorv1.Status_STATUS_DENIED:
			l.deniedLocked(now, e, res)
		case coordinatorv1.Status_STATUS_UNKNOWN_ROUTE:
			l.stats.PolicyMismatch.Add(1)
			mismatch = ErrUnknownPolicy
			l.failLocked(now, e)
		case coordinatorv1.Status_STATUS_STALE:
			// An older sequence overtook nothing: the waiting checks ask again.
		default: // STATUS_STORE_UNAVAILABLE, STATUS_INVALID, unknown
			l.stats.ItemFailures.Add(1)
			l.failLocked(now, e)
			// A store that timed out may still have applied the item.
			e.fail.setLost(c, res.Status == coordinatorv1.Status_STATUS_STORE_UNAVAILABLE)
		}
		if it.DebtMicro > 0 {
			l.debtAnsweredLocked(e, c, res)
		}
		if len(e.s().waiting) > 0 {
			l.queueLocked(e) // checks the answer could not serve wait for the next refill
		}
		l.oweLocked(now, e) // the call that carried the last debt is back
		e.unlock()
	}
	return mismatch
}

// debtAnsweredLocked accounts the debt an answered item carried: debited, forgiven past the
// bucket's max_debt, or put back to go again (stale: nothing was done). A store failure of the
// item may have applied it: the key's resend carries the same debt, answered from the record.
// e.mu is held.
func (l *Limiter) debtAnsweredLocked(e *entry, c *Call, res *coordinatorv1.AcquireResult) {
	switch res.Status {
	case coordinatorv1.Status_STATUS_OK, coordinatorv1.Status_STATUS_DENIED:
		l.debtFateLocked(e, debtDebited, bucket.Micro(res.DebtChargedMicro))
	case coordinatorv1.Status_STATUS_STALE:
		l.debtFailedLocked(e, c, false)
	case coordinatorv1.Status_STATUS_STORE_UNAVAILABLE:
		l.debtFailedLocked(e, c, true)
	default: // the coordinator refused the item: it will refuse it again
		l.debtFateLocked(e, debtLost, 0)
	}
}

// debtFailedLocked accounts the debt of an item whose call failed as a whole. Not applied, the
// debt is pending again (it goes once the key's backoff is over). Maybe applied, the key's next
// call resends this seq if it is the key's oldest of unknown outcome, with the same debt
// (answered from the record if it was debited); otherwise the debt is lost: it may have been
// debited, and is never sent twice. e.mu is held.
func (l *Limiter) debtFailedLocked(e *entry, c *Call, maybe bool) {
	switch {
	case !maybe:
		l.debtFateLocked(e, debtAgain, 0)
	case e.fail != nil && e.fail.lostSeq == c.Acquire.Seq:
		l.debtFateLocked(e, debtResent, 0)
	default:
		l.debtFateLocked(e, debtLost, 0)
	}
}

// debtFate is what became of the debt a call carried.
type debtFate uint8

const (
	debtDebited debtFate = iota // answered: charged µ debited, the rest forgiven
	debtAgain                   // nothing was done: pending again
	debtResent                  // maybe applied: the key's resend of the seq carries it (fails.lostDebt)
	debtLost                    // maybe applied and not resent, or refused: never sent again
)

// debtFateLocked ends e's debt out with its fate, and answers or requeues the settles waiting
// for it. e.mu is held.
func (l *Limiter) debtFateLocked(e *entry, fate debtFate, charged bucket.Micro) {
	out := e.s().debtOut
	if out == 0 {
		return
	}
	s := e.slow
	s.debtOut = 0
	switch fate {
	case debtDebited:
		charged = min(max(0, charged), out)
		l.stats.DebtCharged.Add(uint64(charged))
		l.stats.DebtForgiven.Add(uint64(out - charged))
		debited(s.debtOutFor, charged)
	case debtAgain:
		s.debt += out
		s.debtWait = append(s.debtOutFor, s.debtWait...)
	case debtResent:
		e.fail.lostDebt = out // its settles wait for the resend
		return
	case debtLost:
		l.stats.DebtLost.Add(uint64(out))
		unconfirmed(s.debtOutFor)
	}
	s.debtOutFor = nil
}

// applyReturns accounts for the leases c handed back alone (Acquire.Returns or Return.Items):
// n of them, answered by result(i) when the call was answered with got results. A lease whose
// return was not applied waits to be handed back again; one that may have been applied is lost
// (under-use, never overshoot).
func (l *Limiter) applyReturns(c *Call, f Failure, n int, result func(int) *coordinatorv1.ReturnResult, got int) {
	if n == 0 {
		return
	}
	if f == Answered && got != n {
		f = MaybeApplied
	}
	for i, e := range c.backs {
		var amount, grantedAt int64
		if c.Acquire != nil {
			amount, grantedAt = c.Acquire.Returns[i].UnspentMicro, c.Acquire.Returns[i].GrantedAtMs
		} else {
			amount, grantedAt = c.Return.Items[i].UnspentMicro, c.Return.Items[i].GrantedAtMs
		}
		// A grant of several buckets goes back to each (direct.go): counted once per bucket, as
		// the coordinator's credit is their sum.
		buckets := int64(1)
		if c.Return != nil {
			buckets += int64(len(c.Return.Items[i].Also))
		}
		// Not applied (the call was refused, or a newer return of the key overtook this one:
		// STALE), it waits to be handed back again, unless its policy is gone: then no
		// coordinator will take it.
		again := (f == NotApplied || f == UnknownPolicy ||
			f == Answered && result(i).GetStatus() == coordinatorv1.Status_STATUS_STALE) && !e.view.closed.Load()
		// The hand-back is answered (or failed): the key's next one may go, and a lease retired
		// meanwhile waits no longer.
		e.mu.Lock()
		e.returning = false
		if again {
			e.sw().back.add(bucket.Micro(amount), bucket.Millis(grantedAt), c.sentAt)
		}
		if e.s().back.amount > 0 && !e.backed {
			l.settleBackLocked(c.sentAt, e)
		}
		e.unlock()
		if again {
			continue
		}
		l.handedBack(amount * buckets)
		if f == Answered && result(i).GetStatus() == coordinatorv1.Status_STATUS_OK {
			l.stats.CreditedMicro.Add(uint64(max(0, result(i).CreditedMicro)))
		} else {
			l.stats.LostMicro.Add(uint64(amount * buckets))
		}
	}
}

// handedBack counts a lease handed back in a call that reached a coordinator.
func (l *Limiter) handedBack(micro int64) {
	l.stats.Returns.Add(1)
	l.stats.ReturnedMicro.Add(uint64(micro))
}

// grantLocked serves the checks waiting for e from a grant, first come first served, and keeps
// the rest as the current lease (if that cannot serve) or as the next one. A direct entry keeps
// nothing: its grant serves only the checks that were waiting when the Acquire was sent (for a
// resent seq, first sent), so each allowed check was taken from the bucket between its send and
// its answer (admission C + r·w); what they did not take — a check stopped waiting, or the grant
// of a lost answer came back — is handed back with the next refill (a grant of several buckets:
// in a Return of its own, to every one of them).
func (l *Limiter) grantLocked(now clock.Nanos, c *Call, e *entry, res *coordinatorv1.AcquireResult) {
	g := bucket.Micro(res.GrantedMicro)
	if e.fail != nil {
		e.fail.count, e.fail.until = 0, 0
	}
	// A contended grant paces the key: once what it got is spent, checks are refused locally
	// until the agent's share of the bucket's refill has covered it (docs/leases.md).
	e.deniedUntil.Store(int64(l.paceUntil(now, e, res.PaceMs)))
	e.level = bucket.Micro(res.RemainingMicro)
	e.setRemainingLocked()
	if g <= 0 {
		return
	}
	l.stats.Grants.Add(1)
	l.stats.GrantedMicro.Add(uint64(g))
	e.acct += g
	n := grant{
		tokens:    g,
		expires:   c.sentAt + clock.Nanos(res.TtlMs)*clock.Nanos(time.Millisecond) - l.cfg.Guard,
		grantedAt: bucket.Millis(res.GrantedAtMs),
		recvAt:    now,
	}
	if e.dead.Load() || e.view.closed.Load() {
		// Evicted or its view closed: hand it straight back.
		e.acct -= g
		l.handBackLocked(now, e, n)
		return
	}
	switch {
	case e.rule.Direct:
		// A direct grant is spent at once, whatever its TTL: on the checks that asked for it.
		n.tokens = l.serveLocked(n.tokens, e, n, c.asked)
	case now < n.expires:
		n.tokens = l.serveLocked(n.tokens, e, n, anyWaiting) // a lease serves whoever waits for it
	}
	if n.tokens == 0 {
		return
	}
	if e.rule.Direct || now >= n.expires {
		// Direct mode keeps no lease; an answer that came too late to use goes back.
		e.acct -= n.tokens
		l.handBackLocked(now, e, n)
		return
	}
	if e.usableLocked(now, 1) {
		if n := e.s().next; n.tokens > 0 {
			e.acct -= n.tokens
			l.handBackLocked(now, e, n)
		}
		e.setNextLocked(n)
		return
	}
	l.handBackLocked(now, e, e.retireLocked())
	e.installLocked(n)
}

// paceUntil is when a key whose grant said paceMs may ask again; 0 when it is not paced (the
// bucket covered the grant) or keeps no lease (direct mode: each check is its own take).
func (l *Limiter) paceUntil(now clock.Nanos, e *entry, paceMs int64) clock.Nanos {
	if paceMs <= 0 || e.rule.Direct {
		return 0
	}
	return now + clock.Nanos(paceMs)*clock.Nanos(time.Millisecond)
}

// anyWaiting, as serveLocked's asked, serves every waiting check.
const anyWaiting = clock.Nanos(math.MaxInt64)

// serveLocked allows the waiting checks of e that began to wait by asked from tokens, in order,
// while they fit, and returns what is left. Checks that do not fit keep waiting. from is the
// grant the tokens came from: a ticket of a reservation keeps its expiry (reserve.go).
func (l *Limiter) serveLocked(tokens bucket.Micro, e *entry, from grant, asked clock.Nanos) bucket.Micro {
	served := 0
	for _, t := range e.s().waiting {
		if t.recheck {
			// The refill is in (it becomes the lease once this returns, under the same lock the
			// check takes to look again): check again.
			t.decideLocked(Verdict{Outcome: Wait})
			served++
			continue
		}
		if bucket.Micro(t.cost) > tokens || t.at > asked {
			break
		}
		tokens -= bucket.Micro(t.cost)
		t.from = from
		t.decideLocked(Verdict{Outcome: Allow, Remaining: tokens + e.level + e.s().next.tokens, Rule: e.rule, Limits: e.lim})
		served++
	}
	e.dropWaiting(served)
	return tokens
}

// deniedLocked answers the waiting checks of a refill the global bucket denied. A lease entry
// caches the denial until the bucket could serve it; a direct entry does not (each of its checks
// is one atomic take).
func (l *Limiter) deniedLocked(now clock.Nanos, e *entry, res *coordinatorv1.AcquireResult) {
	l.stats.Denials.Add(1)
	retry := time.Duration(res.RetryAfterMs) * time.Millisecond
	if res.RetryAfterMs < 0 {
		retry = neverRetry
	}
	if !e.rule.Direct {
		if pace := time.Duration(res.PaceMs) * time.Millisecond; pace > retry {
			retry = pace // agents compete: this one waits for its share of the refill
		}
		e.deniedUntil.Store(int64(now) + int64(retry))
	}
	e.level = bucket.Micro(res.RemainingMicro)
	e.setRemainingLocked()
	if e.fail != nil {
		e.fail.count = 0
	}
	for _, t := range e.s().waiting {
		if t.recheck {
			// The check of several buckets looks again, finds the denial and counts its demand.
			t.decideLocked(Verdict{Outcome: Wait})
			continue
		}
		e.refused += bucket.Micro(t.cost)
		v := l.shadow(e, Verdict{Outcome: Deny, RetryAfter: retry})
		if res.RefusedBucket > 0 && !v.ShadowDeny {
			v.Rule, v.Limits = l.refusedBy(e, res.RefusedBucket) // direct.go
		}
		t.decideLocked(v)
	}
	e.dropWaiting(len(e.s().waiting))
}

// failLocked puts e in its failure mode for a backoff that doubles with consecutive failures; the
// checks waiting for it get the failure mode's answer.
func (l *Limiter) failLocked(now clock.Nanos, e *entry) {
	if e.fail == nil {
		e.fail = &fails{}
	}
	d := failureBackoff << min(e.fail.count, 8)
	e.fail.count++
	e.fail.until = now + clock.Of(min(d, maxFailureBackoff))
	e.refilling.Store(false)
	for _, t := range e.s().waiting {
		if t.recheck {
			t.decideLocked(Verdict{Outcome: Wait}) // the check of several buckets looks again, and finds the failure
			continue
		}
		t.decideLocked(l.failureLocked(now, e, t.cost))
	}
	e.dropWaiting(len(e.s().waiting))
}

// releaseLocked tells the checks waiting for e, which was retired, to check again.
func (l *Limiter) releaseLocked(e *entry) {
	for _, t := range e.s().waiting {
		t.decideLocked(Verdict{Outcome: Wait})
	}
	if n := len(e.s().waiting); n > 0 {
		l.stats.Released.Add(uint64(n))
	}
	e.dropWaiting(len(e.s().waiting))
}

// dropFront removes the first n tickets, keeping the backing array for the next ones.
func dropFront(ts []*Ticket, n int) []*Ticket {
	if n == 0 {
		return ts
	}
	k := copy(ts, ts[n:])
	clear(ts[k:])
	if k == 0 {
		return nil
	}
	return ts[:k]
}

// setLost records c as the entry's Acquire of unknown outcome, or clears the record when the
// outcome is known. A resent seq that fails again keeps its first send time.
func (f *fails) setLost(c *Call, unknown bool) {
	switch {
	case !unknown:
		f.lostSeq, f.lostSentAt, f.lostDebt = 0, 0, 0
	case f.lostSeq == 0:
		f.lostSeq, f.lostSentAt = c.Acquire.Seq, c.sentAt
	}
}
