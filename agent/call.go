package agent

import (
	"errors"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/policy"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

const (
	// MaxBatch bounds the keys of one call: a batch is one pipelined Redis round trip, and a few
	// hundred keys keep it well under a millisecond of Redis time.
	MaxBatch = 256

	// failureBackoff is how long a key stays in its failure mode after a refill failed, doubling
	// with consecutive failures up to maxFailureBackoff: checks answer locally instead of
	// piling onto an unreachable coordinator, and the first check after it tries again.
	failureBackoff    = 100 * time.Millisecond
	maxFailureBackoff = 2 * time.Second

	// neverRetry is the deny cache of a request that no wait can satisfy (min above capacity);
	// Check rejects such costs before they reach a coordinator, so this is a safety net.
	neverRetry = time.Minute
)

// Call is one coordinator call: an Acquire carrying the queued refills, with the leases to hand
// back riding along (a key's own in its item, others in Returns), or, when nothing is to be
// acquired, a Return of leases waiting to be handed back. Exactly one of Acquire and Return is
// set. The shell sends it and hands the reply to Limiter.Apply.
type Call struct {
	Acquire *coordinatorv1.AcquireRequest
	Return  *coordinatorv1.ReturnRequest

	entries []*entry // Acquire.Items[i] refills entries[i]
	backs   []*entry // the entries whose leases are handed back in Acquire.Returns or Return.Items
	sentAt  clock.Nanos
	// asked: a direct grant serves the checks that began to wait by then (grantLocked), those
	// its items counted: sentAt, or a later ticket's time when a check began to wait after the
	// shell read its clock and before the call was built (it still waited before the send). A
	// resend keeps its first send's.
	asked  clock.Nanos
	resend bool // the seq and send time of an earlier call whose outcome was unknown
}

// Seq is the call's sequence number (the coordinator's idempotency key with the agent id).
func (c *Call) Seq() uint64 {
	if c.Acquire != nil {
		return c.Acquire.Seq
	}
	return c.Return.Seq
}

// Keys is the number of keys the call names.
func (c *Call) Keys() int {
	if c.Acquire != nil {
		return len(c.Acquire.Items) + len(c.Acquire.Returns)
	}
	return len(c.Return.Items)
}

// HandedBack is the µ of the leases the call hands back.
func (c *Call) HandedBack() int64 {
	var n int64
	if c.Acquire != nil {
		for _, it := range c.Acquire.Items {
			n += it.ReturnMicro
		}
		for _, it := range c.Acquire.Returns {
			n += it.UnspentMicro
		}
		return n
	}
	for _, it := range c.Return.Items {
		n += it.UnspentMicro
	}
	return n
}

// Refs are the buckets the call refills (not those it only hands leases back to).
func (c *Call) Refs() []*coordinatorv1.BucketRef {
	if c.Acquire == nil {
		return nil
	}
	refs := make([]*coordinatorv1.BucketRef, len(c.Acquire.Items))
	for i, it := range c.Acquire.Items {
		refs[i] = it.Bucket
	}
	return refs
}

// NextCall builds the next call, or returns nil if none is due. now is the moment it is sent:
// leases are measured from it. Queued refills go at once, up to MaxBatch keys per call, with the
// leases waiting to be handed back riding along; leases with no refill to ride with go in a Return
// once the oldest has waited ReturnLinger (at once when their key is gone: evicted, its policy
// replaced, or the Limiter closed).
func (l *Limiter) NextCall(now clock.Nanos) *Call {
	if c := l.nextAcquire(now); c != nil {
		return c
	}
	return l.nextReturn(now)
}

// ReturnLinger is how long a lease waits to be handed back alone for a refill to ride with: a
// Return costs a call and a store operation per key, a refill carries it for nothing. The decay
// the wait costs is r·ReturnLinger at most.
const ReturnLinger = 20 * time.Millisecond

func (l *Limiter) nextAcquire(now clock.Nanos) *Call {
	v := l.view.Load()
	for {
		l.qmu.Lock()
		n := min(len(l.queue), MaxBatch)
		if n == 0 {
			l.qmu.Unlock()
			return nil
		}
		batch := make([]*entry, n)
		copy(batch, l.queue)
		l.queue = append(l.queue[:0], l.queue[n:]...)
		l.qmu.Unlock()
		if c := l.buildAcquire(now, v, batch); c != nil {
			return c
		}
	}
}

// buildAcquire builds an Acquire of the entries of batch that still need a refill, or returns
// nil if none does.
func (l *Limiter) buildAcquire(now clock.Nanos, v *view, batch []*entry) *Call {
	c := &Call{
		Acquire: &coordinatorv1.AcquireRequest{AgentId: l.cfg.AgentID, PolicyVersion: v.set.Version()},
		entries: batch[:0],
		sentAt:  now,
	}
	if seq, sentAt, rest := l.resendable(batch); seq != 0 {
		batch, c.Acquire.Seq, c.sentAt, c.resend = batch[:len(batch)-len(rest)], seq, sentAt, true
		c.entries = batch[:0]
		l.qmu.Lock()
		l.queue = append(rest, l.queue...)
		l.qmu.Unlock()
	}
	c.asked = c.sentAt
	for _, e := range batch {
		if it := l.acquireItem(now, v, e, c); it != nil {
			c.entries = append(c.entries, e)
			c.Acquire.Items = append(c.Acquire.Items, it)
		}
	}
	if len(c.entries) == 0 {
		return nil
	}
	if c.resend {
		l.stats.Resends.Add(1)
	} else {
		// Leases of other keys ride along. (A resent seq carries exactly its keys: the
		// coordinator answers it from its records.)
		l.rideAlong(now, c, v)
		c.Acquire.Seq = l.seq.Add(1)
	}
	l.stats.Acquires.Add(1)
	l.stats.ops.count(c)
	return c
}

// acquireItem is e's item of an Acquire c, or nil when e needs none any more. An entry with
// debt and no refill to ask for gets an item of its debt alone.
func (l *Limiter) acquireItem(now clock.Nanos, v *view, e *entry, c *Call) *coordinatorv1.AcquireItem {
	e.mu.Lock()
	defer e.unlock()
	e.queued = false
	if e.view != v || e.dead.Load() || v.closed.Load() {
		// A stale view's entry, or the Limiter is closed (an entry inserted by a Check racing
		// Close): its waiting checks check again against the current view.
		e.refilling.Store(false)
		l.releaseLocked(e)
		if e.view == v && l.owes(e, c) {
			// Evicted, or the Limiter closed, with debt: the bucket is still the policy's, the
			// debt goes alone.
			return l.debtItem(now, v, e, c)
		}
		l.dropDebtLocked(e)
		return nil
	}
	debtOnly := e.s().debtOnly
	if debtOnly {
		e.slow.debtOnly = false
	}
	if len(e.s().waiting) == 0 {
		refill := false
		switch {
		case debtOnly && l.owes(e, c):
			// Queued for its debt: no check asked for a refill.
		case e.s().next.tokens > 0:
			// A prefetch while the lease prefetched last time still waits to be installed (the
			// next check does that): asking again would only add a lease that sits unused.
			// refilling stays set, so checks below the low water do not queue it again;
			// installing the waiting lease clears it (promoteLocked).
		case e.usableLocked(now, e.lowWater.Load()) || now < clock.Nanos(e.deniedUntil.Load()):
			// A prefetch no longer needed (the prefetched lease was installed meanwhile), or not
			// yet allowed (the key is paced: its share of the bucket's refill is not there yet).
			e.refilling.Store(false)
		case !c.resend && e.lowWater.Load() == 0:
			// Asked for by checks that all stopped waiting (their failure mode answered them
			// after the server's MaxWait), on a key that never refills ahead of need (a cold
			// key, direct mode): the lease would serve no one and lapse. Under overload every
			// check that gives up would otherwise leave its refill queued, the queue would
			// outgrow what the coordinators answer in MaxWait, and every later check would wait
			// behind refills no one waits for and give up in turn. The key's next check asks
			// again. (A resent seq carries its keys: the coordinator may have applied it.)
			e.refilling.Store(false)
			l.stats.RefillsDropped.Add(1)
		default:
			refill = true
		}
		if !refill {
			if l.owes(e, c) {
				return l.debtItem(now, v, e, c)
			}
			return nil
		}
	}
	e.inflight = true
	least, needed := e.unit, bucket.Micro(0)
	if w := e.s().waiting; len(w) > 0 {
		least = bucket.Micro(w[0].cost)
		for _, t := range w {
			needed += bucket.Micro(t.cost)
			if !c.resend {
				c.asked = max(c.asked, t.at)
			}
		}
	}
	// Before the sample: a key's first ask has had no answer. Direct mode sizes nothing by it.
	scarce := !e.rule.Direct && e.scarceLocked()
	demand := l.sampleDemandLocked(now, e)
	it := &coordinatorv1.AcquireItem{
		Bucket:               l.ref(v, e),
		NeededMicro:          int64(needed),
		MinMicro:             int64(least),
		DemandMicroPerSecond: int64(demand),
		Regular:              e.gaps.Regular(), // as of this sample
		Scarce:               scarce,
		Also:                 l.alsoRefs(v, e), // a direct check of several buckets (direct.go)
	}
	if len(it.Also) > 0 {
		// A take of several buckets carries nothing else: a lease to hand back goes in a Return,
		// a debt in an item of its own once this one is answered (oweAgainLocked).
		return it
	}
	l.backAlongLocked(now, e, it)
	it.DebtMicro = int64(l.takeDebtLocked(e, c))
	return it
}

// backAlongLocked puts e's lease to hand back in e's item: credited in the same atomic operation
// (and a call names a key once: the coordinator refuses a key among both its items and its
// returns). One the coordinator would credit nothing of is given up. e.mu is held.
func (l *Limiter) backAlongLocked(now clock.Nanos, e *entry, it *coordinatorv1.AcquireItem) {
	if b := e.s().back; b.amount > 0 {
		if l.creditEstimate(now, e, b) > 0 {
			it.ReturnMicro, it.ReturnGrantedAtMs = int64(b.amount), int64(b.grantedAt)
			e.clearBack()
		} else {
			l.settleBackLocked(now, e) // decayed away: given up
		}
	}
}

// owes reports whether e has debt for call c: a resend carries the debt of the call it repeats,
// a new call what is pending. e.mu is held.
func (l *Limiter) owes(e *entry, c *Call) bool {
	if c.resend {
		return e.fail != nil && e.fail.lostSeq == c.Acquire.Seq && e.fail.lostDebt > 0
	}
	return e.s().debt > 0
}

// takeDebtLocked moves e's debt into call c: for a resend, exactly the debt of the call it
// repeats (the coordinator answers from its record what that one debited); otherwise all that
// is pending. e.mu is held.
func (l *Limiter) takeDebtLocked(e *entry, c *Call) bucket.Micro {
	var d bucket.Micro
	switch {
	case c.resend:
		if e.fail != nil && e.fail.lostSeq == c.Acquire.Seq {
			d = e.fail.lostDebt
		}
	case e.s().debt > 0:
		d = e.slow.debt
		e.slow.debt = 0
		e.slow.debtOutFor = append(e.slow.debtOutFor, e.slow.debtWait...)
		e.slow.debtWait = nil
	}
	if d > 0 {
		e.sw().debtOut = d
	}
	return d
}

// debtItem is an item of e's debt alone: nothing to take (needed and min 0). refilling stays set
// while it is out, so that no other call of the key is queued meanwhile (a key has one call
// out at a time: its seqs reach the store in order); its answer clears it. e.mu is held.
func (l *Limiter) debtItem(now clock.Nanos, v *view, e *entry, c *Call) *coordinatorv1.AcquireItem {
	e.inflight = true
	e.refilling.Store(true)
	it := &coordinatorv1.AcquireItem{Bucket: l.ref(v, e), DemandMicroPerSecond: int64(e.demand.Rate())}
	l.backAlongLocked(now, e, it)
	it.DebtMicro = int64(l.takeDebtLocked(e, c))
	return it
}

// dropDebtLocked forgets the debt of an entry whose bucket is gone with its policy. e.mu is held.
func (l *Limiter) dropDebtLocked(e *entry) {
	if s := e.slow; s != nil && s.debt > 0 {
		l.stats.DebtLost.Add(uint64(s.debt))
		s.debt = 0
		unconfirmed(s.debtWait)
		s.debtWait = nil
	}
}

// rideAlong adds to an Acquire of view v the leases of other keys of v waiting to be handed back
// alone (up to MaxBatch keys in all).
func (l *Limiter) rideAlong(now clock.Nanos, c *Call, v *view) {
	l.qmu.Lock()
	if len(l.backs) == 0 {
		l.qmu.Unlock()
		return
	}
	backs := l.backs
	l.backs = nil
	l.qmu.Unlock()
	var rest []*entry
	for _, e := range backs {
		if e.view != v || len(c.Acquire.Items)+len(c.Acquire.Returns) >= MaxBatch || handsBackAlone(e) {
			rest = append(rest, e) // (a grant of several buckets goes in a Return: direct.go)
			continue
		}
		if it, ok := l.returnItem(now, v, e); ok {
			c.Acquire.Returns = append(c.Acquire.Returns, it)
			c.backs = append(c.backs, e)
		}
	}
	l.requeueBacks(now, rest)
}

// nextReturn builds a Return of the leases waiting to be handed back, when one is due.
func (l *Limiter) nextReturn(now clock.Nanos) *Call {
	for {
		l.qmu.Lock()
		if len(l.backs) == 0 {
			l.qmu.Unlock()
			return nil
		}
		due := len(l.backs) >= MaxBatch || now-l.oldestBack >= clock.Of(ReturnLinger)
		for _, e := range l.backs {
			due = due || e.dead.Load() // evicted, its policy replaced, or closed: no refill will come
		}
		if !due {
			l.qmu.Unlock()
			return nil
		}
		backs := l.backs
		l.backs = nil
		l.qmu.Unlock()
		if c := l.buildReturn(now, backs); c != nil {
			return c
		}
	}
}

// buildReturn builds a Return of the leases of backs (those of the first one's view, up to
// MaxBatch) still worth handing back alone; the others go back to the queue.
func (l *Limiter) buildReturn(now clock.Nanos, backs []*entry) *Call {
	v := backs[0].view
	c := &Call{Return: &coordinatorv1.ReturnRequest{AgentId: l.cfg.AgentID, PolicyVersion: v.set.Version()}, sentAt: now}
	var rest []*entry
	for _, e := range backs {
		if e.view != v || len(c.Return.Items) >= MaxBatch {
			rest = append(rest, e)
			continue
		}
		if it, ok := l.returnItem(now, v, e); ok {
			c.Return.Items = append(c.Return.Items, it)
			c.backs = append(c.backs, e)
		}
	}
	l.requeueBacks(now, rest)
	if len(c.backs) == 0 {
		return nil
	}
	c.Return.Seq = l.seq.Add(1)
	l.stats.ops.count(c)
	return c
}

// returnItem takes e's lease to hand back alone, if it is still worth it: it leaves the backs
// queue either way, unless it must wait longer for a refill to ride with.
func (l *Limiter) returnItem(now clock.Nanos, v *view, e *entry) (*coordinatorv1.ReturnItem, bool) {
	e.mu.Lock()
	defer e.unlock()
	e.backed = false
	b := e.s().back
	if b.amount == 0 {
		return nil, false // rode with its key's refill meanwhile
	}
	if e.inflight {
		// Its refill is out (in this call, perhaps: a call names a key once): the hand-back waits
		// for the next refill or sweep.
		return nil, false
	}
	if e.returning {
		return nil, false // the answer to the hand-back out queues this one (applyReturns)
	}
	if credit := l.creditEstimate(now, e, b); credit <= 0 || !goesAlone(e, credit) {
		l.settleBackLocked(now, e) // decayed (dropped), or waits for its key's refill
		return nil, false
	}
	e.clearBack()
	e.returning = true
	return &coordinatorv1.ReturnItem{Bucket: l.ref(v, e), UnspentMicro: int64(b.amount), GrantedAtMs: int64(b.grantedAt),
		Also: l.alsoRefs(v, e)}, true // every bucket of a direct grant of several (direct.go)
}

// requeueBacks puts entries taken from the backs queue but not sent back in front of it.
func (l *Limiter) requeueBacks(now clock.Nanos, rest []*entry) {
	l.qmu.Lock()
	defer l.qmu.Unlock()
	if len(rest) > 0 && len(l.backs) == 0 {
		l.oldestBack = now
	}
	l.backs = append(rest, l.backs...)
}

// resendable finds, among the queued entries of batch, those whose last Acquire failed with an
// unknown outcome, and picks the oldest such seq. It reorders batch in place: the entries of
// that seq first, the others (returned as rest, to go back to the head of the queue) after.
// With no such entry, seq is 0 and batch is unchanged.
//
// Sending the seq again, before any newer Acquire of those keys, lets the coordinator answer the
// items Redis applied from their idempotency records (a newer seq would replace them), so no
// granted token is stranded by a lost answer. The lease is measured from the first send: a
// grant that is too old to use is handed straight back (grantLocked), so the admission bound
// holds as if the first answer had come.
func (l *Limiter) resendable(batch []*entry) (seq uint64, sentAt clock.Nanos, rest []*entry) {
	lostSeq := func(e *entry) (uint64, clock.Nanos) {
		e.mu.Lock()
		defer e.unlock()
		if e.fail == nil {
			return 0, 0
		}
		return e.fail.lostSeq, e.fail.lostSentAt
	}
	for _, e := range batch {
		if s, at := lostSeq(e); s != 0 && (seq == 0 || s < seq) {
			seq, sentAt = s, at
		}
	}
	if seq == 0 {
		return 0, 0, nil // the usual case: no allocation
	}
	// Queued entries are not in flight, so nothing changes lostSeq between the two readings; an
	// entry whose seq did change would only wait for the next call.
	keep := batch[:0]
	for _, e := range batch {
		if s, _ := lostSeq(e); s == seq {
			keep = append(keep, e)
		} else {
			rest = append(rest, e)
		}
	}
	copy(batch[len(keep):], rest)
	return seq, sentAt, batch[len(keep):]
}

// sampleDemandLocked updates the entry's demand estimate (µ per second) from what it consumed
// since the last sample — the level then, plus what was granted, minus what was handed back,
// minus the level now — and what its checks were refused over the limit. A sample spans at least
// lease.MinSample: refills that come sooner leave it open and accumulating. Each closed sample is
// also a gap between the key's refills (lease.Gaps): a key colder than its leases samples once per
// check, so the gaps tell a key polled on a fixed period longer than its leases live.
func (l *Limiter) sampleDemandLocked(now clock.Nanos, e *entry) bucket.Micro {
	level := bucket.Micro(e.tokens.Load()) + e.s().next.tokens
	switch elapsed := (now - e.sampledAt).Duration(); {
	case !e.sampled:
		e.acct, e.sampledAt, e.sampled = level, now, true
	case elapsed >= lease.MinSample:
		e.demand.Observe(max(0, e.acct-level)+e.refused, elapsed)
		e.gaps.Observe(elapsed, lease.TTL(e.lim.Bucket))
		e.acct, e.sampledAt, e.refused = level, now, 0
	}
	return e.demand.Rate()
}

func (l *Limiter) ref(v *view, e *entry) *coordinatorv1.BucketRef {
	return routeRef(v.set.RouteByID(e.route), e.tenant, e.lim.Region)
}

// routeRef names the bucket of route r for tenant in region.
func routeRef(r policy.Route, tenant, region string) *coordinatorv1.BucketRef {
	return &coordinatorv1.BucketRef{Rule: r.Rule.Name, Route: r.Template(), Operation: r.Operation(), Tenant: tenant, Region: region}
}

// ErrUnknownPolicy is reported by Apply when the coordinator does not know this agent's policy
// version or one of its routes: the shell reloads the policy.
var ErrUnknownPolicy = errors.New("agent: coordinator does not know this policy")
