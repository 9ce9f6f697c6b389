package agent

import (
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/policy"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// handBackLocked takes the unspent tokens of a retired lease g to hand back. They ride with the
// key's next refill if one comes; they go alone only if worth at least one request (or the key
// is gone); and not at all once the refill since their grant covers them. e.mu is held.
//
// A key with no slow state whose lease is spent, or whose remainder the refill already covers,
// gets none: the expiry of a cold key's lease allocates nothing.
func (l *Limiter) handBackLocked(now clock.Nanos, e *entry, g grant) {
	if g.tokens > 0 {
		b := e.s().back
		b.add(g.tokens, g.grantedAt, g.recvAt)
		if e.slow == nil && l.creditEstimate(now, e, b) <= 0 {
			l.skipBack(now, e, b)
			return // nothing else waits to go back: e has no slow state
		}
		e.sw().back = b
	}
	l.settleBackLocked(now, e)
}

// skipBack counts b, which a coordinator would credit nothing, as given up instead of handed back.
func (l *Limiter) skipBack(now clock.Nanos, e *entry, b handBack) {
	l.stats.ReturnsSkipped.Add(1)
	l.stats.SkippedMicro.Add(uint64(b.amount))
	l.forfeit(now, e, b)
}

// settleBackLocked drops what e has to hand back if the coordinator would credit none of it, and
// queues it to go alone if it is worth a request or its entry is gone. e.mu is held.
func (l *Limiter) settleBackLocked(now clock.Nanos, e *entry) {
	b := e.s().back
	if b.amount == 0 {
		return
	}
	credit := l.creditEstimate(now, e, b)
	if credit <= 0 {
		l.skipBack(now, e, b)
		e.clearBack()
		return
	}
	if e.backed || !goesAlone(e, credit) {
		return // queued already, or waits for its key's next refill
	}
	e.backed = true
	l.qmu.Lock()
	if len(l.backs) == 0 {
		l.oldestBack = now
	}
	l.backs = append(l.backs, e)
	l.qmu.Unlock()
	l.signal()
}

// Forfeit is a lease this agent kept instead of handing it back, because the coordinator would
// have credited none of it (Config.RecordForfeits).
type Forfeit struct {
	Amount    bucket.Micro
	GrantedAt bucket.Millis // the store's clock at its grant
	At        clock.Nanos   // when it was given up
	e         *entry
}

// Ref is the bucket of the forfeited lease.
func (f Forfeit) Ref() *coordinatorv1.BucketRef { return f.e.view.lim.ref(f.e.view, f.e) }

// maxForfeits bounds the forfeits waiting for the shell: beyond it they are only counted
// (Stats.ReturnsSkipped).
const maxForfeits = 1 << 16

func (l *Limiter) forfeit(now clock.Nanos, e *entry, b handBack) {
	if !l.cfg.RecordForfeits {
		return
	}
	l.fmu.Lock()
	if len(l.forfeits) < maxForfeits {
		l.forfeits = append(l.forfeits, Forfeit{Amount: b.amount, GrantedAt: b.grantedAt, At: now, e: e})
	}
	l.fmu.Unlock()
}

// Forfeits returns the leases given up since the last call (with Config.RecordForfeits; the
// simulator keeps its per-key ledgers with them).
func (l *Limiter) Forfeits() []Forfeit {
	l.fmu.Lock()
	defer l.fmu.Unlock()
	f := l.forfeits
	l.forfeits = nil
	return f
}

// Withheld lists the leases waiting in the lease table to be handed back that no call can carry
// yet: a key's hand-back waits while its refill or its previous hand-back is out, and goes when
// that call is answered. After Close, what NextCall no longer returns and Withheld lists is what
// the calls in flight hold up; the simulator counts it, with Forfeits, as what a crashed agent
// held. It walks the lease table, closed entries included (not evicted ones).
func (l *Limiter) Withheld() []Forfeit {
	var out []Forfeit
	l.view.Load().table.eachHeld(func(e *entry) {
		e.mu.Lock()
		if b := e.s().back; b.amount > 0 && !e.backed {
			out = append(out, Forfeit{Amount: b.amount, GrantedAt: b.grantedAt, At: b.recvAt, e: e})
		}
		e.unlock()
	})
	return out
}

// goesAlone reports whether a hand-back of e that a coordinator would credit credit > 0 goes in
// a call of its own rather than with its key's next refill: it is worth a request, its entry is
// gone (no refill will come), or it is the grant of a direct take of several buckets, which no
// refill carries (handsBackAlone).
func goesAlone(e *entry, credit bucket.Micro) bool {
	return credit >= e.unit || e.dead.Load() || handsBackAlone(e)
}

// creditEstimate is the most a coordinator would credit for b now (bucket.State.Return): its
// tokens less the refill since their grant. The grant was before its answer arrived (recvAt),
// so the refill since recvAt bounds the decay from below and the estimate errs high: a lease
// dropped because its estimate is 0 would have been credited nothing. For a grant of several
// buckets (handsBackAlone) it is the most any of them would credit.
func (l *Limiter) creditEstimate(now clock.Nanos, e *entry, b handBack) bucket.Micro {
	credit := estimateCredit(now, e.lim.Bucket, b)
	if handsBackAlone(e) {
		var buf [policy.MaxCharges]*policy.Limits
		for _, lim := range l.chargeLimits(e, buf[:0]) {
			credit = max(credit, estimateCredit(now, lim.Bucket, b))
		}
	}
	return credit
}

// estimateCredit is creditEstimate for one bucket of limit lim.
func estimateCredit(now clock.Nanos, lim bucket.Limit, b handBack) bucket.Micro {
	credit := min(b.amount, lim.Capacity())
	if age := now - b.recvAt; age > 0 {
		credit -= lim.Refilled(bucket.Millis(age / clock.Nanos(time.Millisecond)))
	}
	return credit
}

// retireEntry retires everything e holds: its lease, its prefetched lease, its waiting checks
// (they check again). e is dead afterwards.
func (l *Limiter) retireEntry(e *entry) {
	e.mu.Lock()
	defer e.unlock()
	e.dead.Store(true)
	now := e.recvAt // any reading: a dead entry hands back everything its credit estimate keeps
	if n := e.s().next; n.tokens > 0 {
		e.acct -= n.tokens
		e.setNextLocked(grant{})
		l.handBackLocked(max(now, n.recvAt), e, n)
	}
	l.handBackLocked(now, e, e.retireLocked())
	l.releaseLocked(e)
	if e.owesLocked() && !e.inflight && !e.queued {
		// Its debt goes alone, once, failure backoff or not: no check will bring it a call.
		l.enqueueLocked(e)
	}
}

func (l *Limiter) evicted(e *entry) {
	l.stats.Evicted.Add(1)
	l.retireEntry(e)
	e.mu.Lock()
	l.parked.park(e)
	e.unlock()
}

// Expire retires the leases that expired by now in the next shards of the lease table (a cursor
// moves on, so successive calls walk the whole table), installs prefetched leases whose current
// one ran out, and drops the leases waiting to be handed back that the refill since their grant
// covers. The shell calls it every few milliseconds with a few shards. It visits only the entries
// that hold something (armed): a table of a million keys, most of them idle, costs the sweep what
// the keys in play cost.
func (l *Limiter) Expire(now clock.Nanos, shards int) {
	v := l.view.Load()
	n := len(v.table.shards)
	from := int(l.sweep.Add(int64(shards))) - shards
	for i := range min(shards, n) {
		v.table.sweepArmed((from+i)%n, func(e *entry) bool { return l.sweepEntry(now, e) })
	}
}

// sweepEntry expires what e holds (expireLocked) and reports whether e stays armed.
func (l *Limiter) sweepEntry(now clock.Nanos, e *entry) bool {
	e.mu.Lock()
	defer e.mu.Unlock() // not unlock: the sweep keeps the armed flag itself
	if !e.dead.Load() {
		l.expireLocked(now, e)
		e.trimLocked()
	}
	e.armed = !e.dead.Load() && e.holdsLocked() // a dead entry's hand-back is queued (retireEntry)
	return e.armed
}

// ExpireAll is Expire over the whole table.
func (l *Limiter) ExpireAll(now clock.Nanos) { l.Expire(now, len(l.view.Load().table.shards)) }

// expireLocked retires e's lease if it expired, installs its prefetched lease if the current one
// ran out, drops or queues its hand-back and sends a debt whose backoff is over. e.mu is held.
func (l *Limiter) expireLocked(now clock.Nanos, e *entry) {
	if exp := e.expires.Load(); exp != 0 && int64(now) >= exp {
		l.expiredLocked(now, e)
	}
	if n := e.s().next; n.tokens > 0 && now >= n.expires {
		l.stats.Expired.Add(1)
		e.acct -= n.tokens
		e.setNextLocked(grant{})
		e.prefetchDoneLocked()
		l.handBackLocked(now, e, n)
	}
	if e.s().next.tokens > 0 && !e.usableLocked(now, 1) {
		l.promoteLocked(now, e)
	}
	if !e.backed {
		l.settleBackLocked(now, e)
	}
	l.oweLocked(now, e) // a debt put back by a failed call goes once the backoff is over
}

// expiredLocked retires e's current lease, which expired, and hands back what is left of it.
func (l *Limiter) expiredLocked(now clock.Nanos, e *entry) {
	g := e.retireLocked()
	if g.tokens > 0 {
		l.stats.Expired.Add(1)
	}
	l.handBackLocked(now, e, g)
}

// Close retires every lease (graceful shutdown): afterwards NextCall yields Returns of them all,
// at once.
func (l *Limiter) Close() {
	v := l.view.Load()
	v.closed.Store(true)
	v.table.each(func(e *entry) { l.retireEntry(e) })
	l.signal()
}

// Outstanding is what this agent holds of the global buckets, in µ: the unspent tokens of its
// current and prefetched leases (expired ones not yet retired included) and of retired leases
// not yet handed to a call. The tokens lost if the agent dies are at most this plus what its calls
// in flight carry (I7). It walks the lease table: a metrics scrape's cost, not a check's.
func (l *Limiter) Outstanding() bucket.Micro {
	var held bucket.Micro
	add := func(e *entry) {
		e.mu.Lock()
		held += bucket.Micro(e.tokens.Load()) + e.s().next.tokens + e.s().back.amount
		e.unlock()
	}
	l.view.Load().table.each(add)
	// Entries of closed views and evicted ones hold only what they have to hand back.
	l.qmu.Lock()
	backs := append([]*entry(nil), l.backs...)
	l.qmu.Unlock()
	for _, e := range backs {
		if e.dead.Load() {
			add(e)
		}
	}
	return held
}

// Pending reports the refills queued and the leases waiting to be handed back alone.
func (l *Limiter) Pending() (refills, returns int) {
	l.qmu.Lock()
	defer l.qmu.Unlock()
	return len(l.queue), len(l.backs)
}
