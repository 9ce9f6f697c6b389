package agent

import (
	"errors"
	"math/bits"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/internal/lease"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

const (
	// MaxBatch bounds the keys of one Acquire or Return: a batch is one pipelined Redis round
	// trip, and a few hundred keys keep it well under a millisecond of Redis time.
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

// Refill is one Acquire in flight: the request and the entries its items refill.
type Refill struct {
	Req     *coordinatorv1.AcquireRequest
	entries []*entry
	sentAt  clock.Nanos
	resend  bool // the seq and send time of an earlier call whose outcome was unknown
}

// NextAcquire builds the next Acquire from the queued refills (at most MaxBatch keys), or returns
// nil if none is queued. now is the moment the request is sent: leases are measured from it.
func (l *Limiter) NextAcquire(now clock.Nanos) *Refill {
	v := l.view.Load()
	l.qmu.Lock()
	n := min(len(l.queue), MaxBatch)
	batch := make([]*entry, n)
	copy(batch, l.queue)
	l.queue = append(l.queue[:0], l.queue[n:]...)
	l.qmu.Unlock()
	if n == 0 {
		return nil
	}
	r := &Refill{
		Req:     &coordinatorv1.AcquireRequest{AgentId: l.cfg.AgentID, PolicyVersion: v.set.Version()},
		entries: batch[:0],
		sentAt:  now,
	}
	if seq, sentAt, rest := l.resendable(batch); seq != 0 {
		batch, r.Req.Seq, r.sentAt, r.resend = batch[:len(batch)-len(rest)], seq, sentAt, true
		r.entries = batch[:0]
		l.qmu.Lock()
		l.queue = append(rest, l.queue...)
		l.qmu.Unlock()
	}
	for _, e := range batch {
		if e.view != v || e.dead.Load() || v.closed.Load() {
			// A stale view's entry, or the Limiter is closed (an entry inserted by a Check racing
			// Close): release its waiters, who check again against the current view.
			e.mu.Lock()
			e.queued = false
			e.refilling.Store(false)
			e.wakeLocked()
			e.mu.Unlock()
			continue
		}
		e.mu.Lock()
		e.queued = false
		if e.next.tokens > 0 && e.wantMin == 0 {
			// A prefetch while the lease prefetched last time still waits to be installed (the
			// next check does that): asking again would only add a lease that sits unused, or
			// replace and return that one. refilling stays set, so checks below the low water do
			// not queue it again; installing the waiting lease clears it (promoteLocked).
			e.wakeLocked()
			e.mu.Unlock()
			continue
		}
		e.inflight = true
		cost := e.cost()
		least := max(e.wantMin, cost)
		e.wantMin = 0
		var share bucket.Micro = -1
		if e.grantedAt != 0 { // the bucket's level has been reported
			share = shareCapLocked(now, e)
		}
		want := lease.Want(l.sampleDemandLocked(now, e), e.ttl(), least, e.lim.Bucket.Capacity())
		if e.scarce {
			want = want / 2
		}
		if share >= 0 {
			want = min(want, share)
		}
		// Whole requests: a lease that is a multiple of the route's cost is spent to zero, so it
		// needs no Return (one store operation less per lease).
		want = max(least, want-want%cost)
		demand := e.demand
		e.mu.Unlock()
		r.entries = append(r.entries, e)
		r.Req.Items = append(r.Req.Items, &coordinatorv1.AcquireItem{
			Bucket:               l.ref(v, e),
			WantMicro:            int64(want),
			MinMicro:             int64(least),
			DemandMicroPerSecond: int64(demand),
		})
	}
	if len(r.entries) == 0 {
		return nil
	}
	if r.resend {
		l.stats.Resends.Add(1)
	} else {
		r.Req.Seq = l.seq.Add(1)
	}
	l.stats.Acquires.Add(1)
	return r
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
	lostSeq := func(e *entry) uint64 {
		e.mu.Lock()
		defer e.mu.Unlock()
		if e.fail == nil {
			return 0
		}
		return e.fail.lostSeq
	}
	for _, e := range batch {
		if s := lostSeq(e); s != 0 && (seq == 0 || s < seq) {
			e.mu.Lock()
			seq, sentAt = s, e.fail.lostSentAt
			e.mu.Unlock()
		}
	}
	if seq == 0 {
		return 0, 0, nil // the usual case: no allocation
	}
	// Queued entries are not in flight, so nothing changes lostSeq between the two readings; an
	// entry whose seq did change would only wait for the next call.
	keep := batch[:0]
	for _, e := range batch {
		if lostSeq(e) == seq {
			keep = append(keep, e)
		} else {
			rest = append(rest, e)
		}
	}
	copy(batch[len(keep):], rest)
	return seq, sentAt, batch[len(keep):]
}

// sampleDemandLocked updates the entry's demand estimate (µ per second) from what it consumed
// since the last sample: the level then, plus what was installed, minus what was retired, minus
// the level now. A sample spans at least minSample: refills that come sooner leave the sample
// open and accumulating, so a burst of a few requests in a millisecond does not read as a rate of
// thousands per second, and refills every few milliseconds do not read as no demand at all.
func (l *Limiter) sampleDemandLocked(now clock.Nanos, e *entry) bucket.Micro {
	level := bucket.Micro(e.tokens.Load()) + e.next.tokens
	switch {
	case !e.sampled:
		e.acct, e.sampledAt, e.sampled = level, now, true
	case now-e.sampledAt >= minSample:
		rate := perSecond(max(0, e.acct-level), now-e.sampledAt)
		if e.demand == 0 {
			e.demand = rate
		} else {
			e.demand = (e.demand + rate) / 2
		}
		e.acct, e.sampledAt = level, now
	}
	return e.demand
}

// maxDemand bounds a demand estimate (µ per second) where lease.Want expects it: a key's demand
// beyond 2^52 µ/s asks for its whole capacity anyway.
const maxDemand = bucket.MaxExact / 2

// perSecond is used µ over elapsed as µ per second, at most maxDemand. The product used·10^9
// passes 2^63 once a key spends 9,223 tokens between two samples (a hot key does), hence 128 bits.
func perSecond(used bucket.Micro, elapsed clock.Nanos) bucket.Micro {
	hi, lo := bits.Mul64(uint64(used), uint64(time.Second))
	if hi >= uint64(elapsed) {
		return maxDemand
	}
	q, _ := bits.Div64(hi, lo, uint64(elapsed))
	return bucket.Micro(min(q, uint64(maxDemand)))
}

// shareCapLocked is what the coordinator's share rule (lease.Share of the global level) would
// grant now, as this agent last saw the bucket: the level its last answer reported, plus the
// refill since the last demand sample (sampledAt, at or before that Acquire was sent: the
// estimate errs high), at most the capacity. Asking for no more than
// that, in whole requests, keeps grants whole: a grant cut by the share to a fraction of a request
// strands that fraction while the bucket, short of it, denies. Other agents make the view stale;
// a fraction that still comes is handed back at once (grantLocked).
func shareCapLocked(now clock.Nanos, e *entry) bucket.Micro {
	lim := e.lim.Bucket
	level := max(0, bucket.Micro(e.remaining.Load())-e.next.tokens)
	if lim.Refills() {
		elapsed := max(0, int64((now-e.sampledAt)/clock.Nanos(time.Millisecond)))
		if elapsed >= int64(lim.FillTime()) {
			level = lim.Capacity()
		} else {
			// elapsed·num/den < FillTime·num/den ≈ capacity: the quotient fits; the product may
			// not, hence 128 bits.
			num, den := lim.Rate()
			hi, lo := bits.Mul64(uint64(elapsed), uint64(num))
			added, _ := bits.Div64(hi, lo, uint64(den))
			level += bucket.Micro(added)
		}
	}
	return min(level, lim.Capacity()) * lease.Share / 1000
}

// minSample is the shortest window a demand sample is measured over.
const minSample = clock.Nanos(100 * time.Millisecond)

func (l *Limiter) ref(v *view, e *entry) *coordinatorv1.BucketRef {
	r := v.set.RouteByID(e.route)
	return &coordinatorv1.BucketRef{
		Rule:      e.rule.Name,
		Route:     r.Template(),
		Operation: r.Operation(),
		Tenant:    e.tenant,
		Region:    e.lim.Region,
	}
}

// ErrUnknownPolicy is reported through ApplyAcquire when the coordinator does not know this
// agent's policy version or one of its routes: the shell reloads the policy.
var ErrUnknownPolicy = errors.New("agent: coordinator does not know this policy")

// ApplyAcquire installs the answer to r, received at now; err is the call's error. It wakes the
// checks waiting for the refilled keys and reports ErrUnknownPolicy when the policy must be
// reloaded.
func (l *Limiter) ApplyAcquire(now clock.Nanos, r *Refill, resp *coordinatorv1.AcquireResponse, err error) error {
	if err == nil && len(resp.GetResults()) != len(r.entries) {
		err = errors.New("agent: acquire answered a different number of items")
	}
	var mismatch error
	if err == nil && !r.resend {
		l.observeRTT(now - r.sentAt)
	}
	if err != nil {
		l.stats.AcquireErrors.Add(1)
		if isUnknownVersion(err) {
			l.stats.PolicyMismatch.Add(1)
			mismatch = ErrUnknownPolicy
		}
		unknown := mayHaveApplied(err)
		for _, e := range r.entries {
			e.mu.Lock()
			e.inflight = false
			l.failLocked(now, e)
			e.fail.setLost(r, unknown)
			e.mu.Unlock()
		}
		return mismatch
	}
	for i, e := range r.entries {
		res := resp.Results[i]
		e.mu.Lock()
		e.inflight = false
		if e.fail != nil {
			// Answered: the coordinator's record of this seq is what it says (an item the store
			// may have applied without answering is the one exception, below).
			e.fail.setLost(r, false)
		}
		switch res.Status {
		case coordinatorv1.Status_STATUS_OK:
			l.grantLocked(now, r, e, res)
		case coordinatorv1.Status_STATUS_DENIED:
			l.stats.Denials.Add(1)
			retry := time.Duration(res.RetryAfterMs) * time.Millisecond
			if res.RetryAfterMs < 0 {
				retry = neverRetry
			}
			e.deniedUntil.Store(int64(now) + int64(retry))
			e.remaining.Store(res.RemainingMicro + int64(e.next.tokens))
			if e.fail != nil {
				e.fail.count = 0
			}
		case coordinatorv1.Status_STATUS_UNKNOWN_ROUTE:
			l.stats.PolicyMismatch.Add(1)
			mismatch = ErrUnknownPolicy
			l.failLocked(now, e)
		case coordinatorv1.Status_STATUS_STALE:
			// An older sequence overtook nothing: ask again at the next check.
		default: // STATUS_STORE_UNAVAILABLE, STATUS_INVALID, unknown
			l.stats.ItemFailures.Add(1)
			l.failLocked(now, e)
			// A store that timed out may still have applied the item.
			e.fail.setLost(r, res.Status == coordinatorv1.Status_STATUS_STORE_UNAVAILABLE)
		}
		e.refilling.Store(false)
		e.wakeLocked()
		e.mu.Unlock()
	}
	return mismatch
}

// grantLocked installs a granted lease: as the current one if that cannot serve, else as next.
func (l *Limiter) grantLocked(now clock.Nanos, r *Refill, e *entry, res *coordinatorv1.AcquireResult) {
	g := bucket.Micro(res.GrantedMicro)
	if e.fail != nil {
		e.fail.count, e.fail.until = 0, 0
	}
	e.deniedUntil.Store(0)
	e.scarce = res.Scarce
	e.remaining.Store(res.RemainingMicro + int64(e.next.tokens))
	if g <= 0 {
		return
	}
	l.stats.Grants.Add(1)
	l.stats.GrantedMicro.Add(uint64(g))
	e.acct += g
	n := grant{
		tokens:    g,
		expires:   r.sentAt + clock.Nanos(res.TtlMs)*clock.Nanos(time.Millisecond) - l.cfg.Guard,
		grantedAt: bucket.Millis(res.GrantedAtMs),
	}
	if e.dead.Load() || e.view.closed.Load() || now >= n.expires {
		// Evicted, its view closed, or the answer came too late to use: hand it straight back.
		e.acct -= g
		l.queueReturn(e, g, n.grantedAt)
		return
	}
	if cost := e.cost(); g > cost && g%cost != 0 {
		// Keep whole requests and hand the rest back at once: a fraction of a request would sit
		// in the lease unspendable until it expires, while the global bucket, short of it, denies.
		// (A grant capped by the bucket's share is rarely whole.)
		frac := g % cost
		n.tokens -= frac
		e.acct -= frac
		e.remaining.Add(int64(frac))
		l.queueReturn(e, frac, n.grantedAt)
	}
	if e.usableLocked(now, 1) {
		if e.next.tokens > 0 {
			l.queueReturn(e, e.next.tokens, e.next.grantedAt)
			e.acct -= e.next.tokens
		}
		e.setNextLocked(n)
		return
	}
	l.retireLocked(e)
	e.installLocked(n)
}

// failLocked puts e in its failure mode for a backoff that doubles with consecutive failures.
func (l *Limiter) failLocked(now clock.Nanos, e *entry) {
	if e.fail == nil {
		e.fail = &fails{}
	}
	d := failureBackoff << min(e.fail.count, 8)
	e.fail.count++
	e.fail.until = now + clock.Of(min(d, maxFailureBackoff))
	e.refilling.Store(false)
	e.wakeLocked()
}

// setLost records r as the entry's Acquire of unknown outcome, or clears the record when the
// outcome is known. A resent seq that fails again keeps its first send time.
func (f *fails) setLost(r *Refill, unknown bool) {
	switch {
	case !unknown:
		f.lostSeq, f.lostSentAt = 0, 0
	case f.lostSeq == 0:
		f.lostSeq, f.lostSentAt = r.Req.Seq, r.sentAt
	}
}

// mayHaveApplied reports whether an Acquire that failed with err may have been applied by the
// store: every failure but the coordinator's own refusals (invalid request, unknown policy,
// credentials) and the Limiter's closing.
func mayHaveApplied(err error) bool {
	if errors.Is(err, ErrClosed) {
		return false
	}
	switch status.Code(err) {
	case codes.InvalidArgument, codes.FailedPrecondition, codes.PermissionDenied, codes.Unauthenticated,
		codes.Unimplemented, codes.NotFound, codes.ResourceExhausted:
		return false
	}
	return true
}

func isUnknownVersion(err error) bool {
	return coordinatorv1.Reason(err) == coordinatorv1.ReasonUnknownPolicyVersion
}

// retireLocked ends e's current lease and queues its unspent tokens for return.
func (l *Limiter) retireLocked(e *entry) {
	if unspent, grantedAt := e.retireLocked(); unspent > 0 {
		l.queueReturn(e, unspent, grantedAt)
	}
}

// retireExpiredLocked ends e's current lease, which expired by now, and queues its unspent tokens
// for return unless the coordinator would credit none of them.
func (l *Limiter) retireExpiredLocked(now clock.Nanos, e *entry) {
	expires := clock.Nanos(e.expires.Load())
	if unspent, grantedAt := e.retireLocked(); unspent > 0 {
		l.returnExpiredLocked(now, e, grant{tokens: unspent, grantedAt: grantedAt, expires: expires})
	}
}

// returnExpiredLocked queues the unspent tokens of an expired lease g for return, unless the
// coordinator would credit none of them: a return is credited its unspent tokens less the refill
// since the grant (bucket.State.Return), and the grant was at the latest when its answer came
// back — the send (expires + Guard - TTL) plus the slowest recent round trip. If the refill since
// then already covers the unspent tokens, the Return would cost a store operation for nothing.
func (l *Limiter) returnExpiredLocked(now clock.Nanos, e *entry, g grant) {
	received := g.expires + l.cfg.Guard - clock.Of(e.ttl()) + clock.Nanos(l.rtt.Load())
	if age := now - received; age > 0 && g.tokens <= e.lim.Bucket.Refilled(bucket.Millis(age/clock.Nanos(time.Millisecond))) {
		l.stats.ReturnsSkipped.Add(1)
		l.stats.SkippedMicro.Add(uint64(g.tokens))
		if l.cfg.Skipped != nil {
			l.cfg.Skipped(l.ref(e.view, e), g.tokens)
		}
		return
	}
	l.queueReturn(e, g.tokens, g.grantedAt)
}

// observeRTT keeps the slowest recent Acquire round trip: up at once, down by a sixteenth of the
// difference per answer.
func (l *Limiter) observeRTT(rtt clock.Nanos) {
	for {
		old := l.rtt.Load()
		next := int64(rtt)
		if next < old {
			next = old - (old-next)/16
		}
		if l.rtt.CompareAndSwap(old, next) {
			return
		}
	}
}

// retireEntry retires everything e holds: its lease, its prefetched lease, its waiters.
func (l *Limiter) retireEntry(e *entry, dead bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if dead {
		e.dead.Store(true)
	}
	l.retireLocked(e)
	if e.next.tokens > 0 {
		l.queueReturn(e, e.next.tokens, e.next.grantedAt)
		e.setNextLocked(grant{})
	}
	e.wakeLocked()
}

func (l *Limiter) evicted(e *entry) {
	l.stats.Evicted.Add(1)
	l.retireEntry(e, true)
	e.mu.Lock()
	l.parked.park(e)
	e.mu.Unlock()
}

// refKey identifies a bucket among the items of one call.
type refKey struct{ rule, route, operation, tenant, region string }

// returnItem is a retired lease on its way back to a coordinator.
type returnItem struct {
	version   string
	ref       *coordinatorv1.BucketRef
	unspent   bucket.Micro
	grantedAt bucket.Millis
}

func (l *Limiter) queueReturn(e *entry, unspent bucket.Micro, grantedAt bucket.Millis) {
	item := returnItem{version: e.view.set.Version(), ref: l.ref(e.view, e), unspent: unspent, grantedAt: grantedAt}
	l.qmu.Lock()
	l.returns = append(l.returns, item)
	l.qmu.Unlock()
	l.cfg.Notify()
}

// Return is one Return call in flight.
type Return struct {
	Req *coordinatorv1.ReturnRequest
}

// NextReturn builds the next Return from retired leases (at most MaxBatch of one policy
// version), or nil if there are none.
func (l *Limiter) NextReturn() *Return {
	l.qmu.Lock()
	defer l.qmu.Unlock()
	if len(l.returns) == 0 {
		return nil
	}
	version := l.returns[0].version
	req := &coordinatorv1.ReturnRequest{AgentId: l.cfg.AgentID, PolicyVersion: version}
	// One item per bucket: a coordinator answers a second item of one key from the first one's
	// idempotency record (same agent and seq), so two leases of a key go back as one, credited as
	// the older grant (more decay: never more than the two would be credited apart).
	index := make(map[refKey]int)
	rest := l.returns[:0]
	for _, it := range l.returns {
		k := refKey{it.ref.Rule, it.ref.Route, it.ref.Operation, it.ref.Tenant, it.ref.Region}
		if i, ok := index[k]; ok && it.version == version {
			merged := req.Items[i]
			merged.UnspentMicro += int64(it.unspent)
			merged.GrantedAtMs = min(merged.GrantedAtMs, int64(it.grantedAt))
			continue
		}
		if it.version != version || len(req.Items) == MaxBatch {
			rest = append(rest, it)
			continue
		}
		index[k] = len(req.Items)
		req.Items = append(req.Items, &coordinatorv1.ReturnItem{
			Bucket: it.ref, UnspentMicro: int64(it.unspent), GrantedAtMs: int64(it.grantedAt),
		})
	}
	clear(l.returns[len(rest):])
	l.returns = rest
	req.Seq = l.seq.Add(1)
	l.stats.Returns.Add(uint64(len(req.Items)))
	for _, it := range req.Items {
		l.stats.ReturnedMicro.Add(uint64(it.UnspentMicro))
	}
	return &Return{Req: req}
}

// ApplyReturn records the answer to a Return. Tokens of a failed Return are lost to the global
// bucket until it refills them (under-use, never overshoot); the shell may retry the same
// request (same seq) first, which is safe.
func (l *Limiter) ApplyReturn(r *Return, resp *coordinatorv1.ReturnResponse, err error) {
	if err != nil || len(resp.GetResults()) != len(r.Req.Items) {
		for _, it := range r.Req.Items {
			l.stats.LostMicro.Add(uint64(it.UnspentMicro))
		}
		return
	}
	for _, res := range resp.Results {
		l.stats.CreditedMicro.Add(uint64(res.CreditedMicro))
	}
}

// Pending reports whether refills or returns are queued.
func (l *Limiter) Pending() (refills, returns int) {
	l.qmu.Lock()
	defer l.qmu.Unlock()
	return len(l.queue), len(l.returns)
}

// Expire retires the leases that expired by now, in shards [from, from+n) of the table, and
// returns the shard to start from next time: the shell sweeps the table a few shards per tick.
func (l *Limiter) Expire(now clock.Nanos, from, n int) int {
	v := l.view.Load()
	shards := len(v.table.shards)
	for i := range n {
		v.table.eachInShard((from+i)%shards, func(e *entry) {
			e.mu.Lock()
			defer e.mu.Unlock()
			if exp := e.expires.Load(); exp != 0 && int64(now) >= exp {
				if e.tokens.Load() > 0 {
					l.stats.Expired.Add(1)
				}
				l.retireExpiredLocked(now, e)
			}
			if e.next.tokens > 0 && now >= e.next.expires {
				l.stats.Expired.Add(1)
				l.returnExpiredLocked(now, e, e.next)
				e.acct -= e.next.tokens
				e.setNextLocked(grant{})
				e.prefetchDoneLocked()
			}
			if e.next.tokens > 0 && !e.usableLocked(now, 1) {
				l.promoteLocked(now, e)
			}
		})
	}
	return (from + n) % shards
}

// Close retires every lease (graceful shutdown): afterwards NextReturn yields them all.
func (l *Limiter) Close() {
	v := l.view.Load()
	v.closed.Store(true)
	v.table.each(func(e *entry) { l.retireEntry(e, true) })
}

// Outstanding is what this agent holds of the global buckets, in µ: the unspent tokens of its
// current and prefetched leases (expired ones not yet retired included) and of retired leases not
// yet handed to a Return. The tokens lost if the agent dies are at most this plus what its calls in
// flight carry (I7). It walks the lease table: a metrics scrape's cost, not a check's.
func (l *Limiter) Outstanding() bucket.Micro {
	var held bucket.Micro
	l.view.Load().table.each(func(e *entry) {
		e.mu.Lock()
		held += bucket.Micro(e.tokens.Load()) + e.next.tokens
		e.mu.Unlock()
	})
	l.qmu.Lock()
	for _, it := range l.returns {
		held += it.unspent
	}
	l.qmu.Unlock()
	return held
}
