package agent

import (
	"errors"
	"math"
	"time"

	rlqsv3 "github.com/envoyproxy/go-control-plane/envoy/service/rate_limit_quota/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"go.uber.org/zap"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/policy"
)

// quotaBucket is one bucket of one stream: what Envoy reported of it, and the assignments the
// agent sent for it that may still admit requests, each backed by a reservation.
type quotaBucket struct {
	sig  string
	id   *rlqsv3.BucketId // as Envoy sent it
	echo []byte           // id as every action's bucket_id field, encoded once (echoField)
	gone bool             // abandoned: the stream holds it no more
	q    Query
	err  error // the bucket cannot be mapped to a key (answered DENY_ALL)

	// The key, as last resolved (resolveBucket), in the policy view resolvedIn.
	resolvedIn *view
	res        resolved     // b.q resolved in resolvedIn, for Limiter.reserveResolved
	unit       bucket.Micro // one request
	emergency  bool         // the rule's failure mode is its emergency bucket
	shadow     bool         // the rule is a shadow rule: ALLOW_ALL
	plan       quotaPlan    // how the key's assignments are timed
	burst      bucket.Micro // the key's burst, in requests
	key        string       // the bucket key its demand is counted under (quotaService.observe)
	keyOf      string       // the bucket key in the view resolvedIn

	// Usage, from Envoy's reports (agent clock).
	allowed    uint64      // requests Envoy reported allowed, in all
	rate       float64     // requests per second offered (allowed + denied), smoothed
	lastReport clock.Nanos // when the last report arrived
	prevReport clock.Nanos // and the one before
	reports    int
	activeAt   clock.Nanos // the last report with a request

	// Assignments.
	state  quotaState
	cur    *quotaAssignment   // the last token bucket sent
	live   []*quotaAssignment // token buckets Envoy may still admit from, oldest first
	ticket *Ticket            // a reservation waiting for a refill
	// polling: ticket's refill is looked at on the stream's grid (wait), since waitFrom
	polling  bool
	waitFrom clock.Nanos
	ask      ReserveAsk // what the reservation asked for

	index int // in the stream's dueHeap; -1 when not scheduled
}

// quotaState is what a bucket's last action told Envoy.
type quotaState uint8

const (
	quotaNone     quotaState = iota // nothing yet: Envoy applies its no_assignment_behavior
	quotaTokens                     // a token bucket backed by a reservation
	quotaDenied                     // DENY_ALL: the global bucket refuses, the key fails closed, or the bucket is invalid
	quotaExpired                    // expired at once: Envoy applies its expired_assignment_behavior (the emergency bucket)
	quotaAllowAll                   // ALLOW_ALL: a shadow rule
)

// quotaAssignment is one token bucket assignment: a bucket of bMax tokens refilling f a second,
// for ttl, sent at sentAt. Envoy admits at most k = bMax + ⌊f·(ttl + AssignmentMargin)⌋ requests
// from it, nothing after endMax; res holds k requests' tokens of a lease that lives past endMax.
type quotaAssignment struct {
	res           Reservation
	k, bMax, f    int64
	ttl           time.Duration
	sentAt        clock.Nanos
	endMax        clock.Nanos
	allowedAtSend uint64 // the bucket's reported allows when it was sent
}

// quotaPlan is how assignments of a key are timed: the life a reservation needs, and the time to
// live to aim at.
type quotaPlan struct {
	life   time.Duration // Reserve's a.Life: the assignment's ttl plus the margin
	target time.Duration
	whole  bool // ttls in whole seconds
}

// planAssignments times the assignments of a key whose leases live tau. Envoy's implementation
// reads only the whole seconds of assignment_time_to_live, so a ttl is whole seconds (half a
// lease, at least one second) whenever a fresh lease outlives a second and the margin; a key with
// shorter leases gets what a lease allows, which Envoys that truncate treat as expired at once
// (docs/gateway.md).
func planAssignments(tau time.Duration) quotaPlan {
	usable := tau - clock.Guard.Duration() - quotaRefillAllowance - AssignmentMargin
	if usable >= time.Second {
		target := min(max(time.Second, tau/2), usable).Truncate(time.Second)
		return quotaPlan{life: AssignmentMargin + time.Second + 20*time.Millisecond, target: target, whole: true}
	}
	target := max(usable, 20*time.Millisecond)
	return quotaPlan{life: AssignmentMargin + target/2, target: target}
}

// assignmentWant is how many requests an assignment of a bucket offered rate requests a second
// asks to reserve: what Envoy's clients offer until the next assignment, a tenth of a second more
// for their bursts, spread standard deviations of that count (quotaSpread), and one; at least two,
// at most the key's burst.
func assignmentWant(rate float64, p quotaPlan, burst bucket.Micro, spread float64) int64 {
	mean := rate * (p.target + AssignmentMargin).Seconds()
	want := math.Ceil(mean+rate*quotaBurstAllowance.Seconds()+spread*math.Sqrt(mean)) + 1
	return int64(max(2, min(want, float64(burst))))
}

// ttl is the time to live of an assignment backed by a reservation that expires at exp, sent at
// now; 0 if the reservation cannot back one.
func (p quotaPlan) ttl(now, exp clock.Nanos) time.Duration {
	left := (exp - now).Duration() - AssignmentMargin
	ttl := min(left, p.target)
	if p.whole && ttl >= time.Second {
		return ttl.Truncate(time.Second)
	}
	return max(0, ttl.Truncate(time.Millisecond))
}

// tokenBucketFor is a token bucket that admits at most k requests over ttl plus the margin:
// bMax tokens at first and f more a second (tokens_per_fill f, fill_interval one second, so that
// Envoy's whole-second reading of it is exact). Refilled continuously, as Envoy does, it admits at
// most bMax + f·t by t, so at most bMax + ⌊f·(ttl + margin)⌋ = k over its life.
//
// When k covers what Envoy's clients offer (rate, requests a second) over the life, the bucket is
// paced at that rate, the rest of k its burst: a bucket replaced before its end then loses at most
// its burst (the refill it would still have had is released, settle). When k is short of it (the
// key is scarce) the bucket is all burst, one token a second more (the protocol requires a refill):
// Envoy's clients spend it as they come, as they would the global bucket's burst, and nothing is
// left to lose when it is replaced. A whole-second ttl is cut to k − 1 seconds if k is too small
// for one token a second over it (k = 1: under a second).
func tokenBucketFor(k int64, ttl time.Duration, rate float64) (bMax, f int64, _ time.Duration) {
	if life := ttl + AssignmentMargin; ttl >= time.Second && int64(life/time.Second) >= k {
		if k >= 2 {
			ttl = time.Duration(k-1) * time.Second
		} else {
			ttl = time.Second - AssignmentMargin - time.Millisecond
		}
	}
	lifeMs := int64((ttl + AssignmentMargin) / time.Millisecond)
	f = 1
	if pace := int64(min(rate, float64(maxAssignTokens))); pace > 1 && pace*lifeMs/1000 <= k-1 {
		f = pace
	}
	return k - f*lifeMs/1000, f, ttl
}

// report handles one usage report of b.
func (st *quotaStream) report(now clock.Nanos, b *quotaBucket, allowed, denied uint64) {
	const (
		maxCount = 1 << 40 // a count beyond this is not a count: clamp it (no overflow in the sums)
		maxRate  = 1e12    // requests per second: reports a microsecond apart cannot make more of one
	)
	allowed, denied = min(allowed, maxCount), min(denied, maxCount)
	b.allowed = min(b.allowed+allowed, math.MaxUint64/2)
	n := float64(allowed + denied)
	st.allowedN += allowed
	st.deniedN += denied
	if b.reports > 0 {
		// The rate since the last report, on the agent's clock (Envoy's time_elapsed is whole
		// seconds); averaged with the previous estimate.
		// Up at once, down by halves: an assignment must cover what was just offered.
		if el := (now - b.lastReport).Duration().Seconds(); el > 0 {
			x := min(n/el, maxRate)
			b.rate = max(x, (b.rate+x)/2)
		}
	} else {
		b.rate = n // the first report: no interval yet; as if over a second
	}
	if n > 0 {
		b.activeAt = now
	}
	b.prevReport, b.lastReport = b.lastReport, now
	b.reports++
	st.settle(now, b, false)

	switch {
	case b.ticket != nil:
		// A reservation is on its way.
	case n == 0 && (now-b.activeAt).Duration() >= st.qs.idle:
		st.abandon(now, b)
		return
	case b.state == quotaNone:
		st.refresh(now, b, false)
	case b.state == quotaTokens && denied > 0 &&
		(b.prevReport >= b.cur.sentAt+clock.Of(AssignmentMargin) || b.allowed-b.cur.allowedAtSend >= uint64(b.cur.bMax)):
		// Envoy ran out under this assignment (the whole last interval was under it, or it
		// allowed its whole burst since it was sent): ask for more now rather than at its end.
		st.refresh(now, b, true)
	}
	if b.err == nil && b.unit > 0 && st.keyOf(b) != "" {
		st.observed = append(st.observed, b)
	}
}

// keyOf is b's bucket key in the current policy ("" if it has none).
func (st *quotaStream) keyOf(b *quotaBucket) string {
	if st.resolveBucket(b) != nil {
		return ""
	}
	return b.keyOf
}

// refresh decides b's next assignment: a token bucket from a reservation, or what the key's state
// says instead. early: the current token bucket ran out before its end; it is replaced only by a
// new token bucket.
func (st *quotaStream) refresh(now clock.Nanos, b *quotaBucket, early bool) {
	if b.ticket != nil {
		return
	}
	err := st.resolveBucket(b)
	if err == nil {
		if b.shadow {
			b.err = nil
			st.allowAll(now, b)
			return
		}
		b.ask = ReserveAsk{Want: bucket.Micro(assignmentWant(b.rate, b.plan, b.burst, quotaSpread)) * b.unit, Least: 2 * b.unit, Life: b.plan.life}
		for range 3 { // a key retired meanwhile is looked up again
			r, v, rerr := st.s.lim.reserveResolved(now, &b.res, b.q.Tenant, b.ask)
			if err = rerr; err != nil || v.Outcome != Wait || v.Ticket != retryTicket {
				if err == nil {
					b.err = nil
					if v.Outcome == Wait {
						st.wait(now, b, v.Ticket)
						return
					}
					st.decided(now, b, r, v)
					return
				}
				break
			}
		}
	}
	if err == nil || errors.Is(err, ErrClosed) {
		st.schedule(b, now+clock.Of(quotaRetryFloor))
		return
	}
	st.invalid(now, b, err)
}

// resolveBucket maps b to its query and what the key's rule says of its assignments, once per
// policy view: a bucket is refreshed about every second, its policy changes seldom.
func (st *quotaStream) resolveBucket(b *quotaBucket) error {
	v := st.s.lim.view.Load()
	if b.resolvedIn == v {
		return nil
	}
	b.resolvedIn = nil
	q, err := quotaQuery(v.set.Envoy(), b.id.GetBucket())
	if err != nil {
		return err
	}
	b.q = q
	res, err := st.s.lim.resolve(v, q)
	if err != nil {
		return err
	}
	b.res = res
	b.unit = bucket.Micro(res.cost)
	b.emergency = res.route.Rule.OnFailure == policy.Emergency && res.lim.Emergency != nil
	b.shadow = res.route.Rule.Shadow
	b.plan = planAssignments(lease.TTL(res.lim.Bucket))
	b.burst = res.lim.Bucket.Capacity() / b.unit
	b.keyOf = res.key(q.Tenant)
	b.resolvedIn = v
	return nil
}

// decided acts on a reservation's outcome.
func (st *quotaStream) decided(now clock.Nanos, b *quotaBucket, r Reservation, v Verdict) {
	switch v.Outcome {
	case Allow:
		st.assign(b, r)
	case Deny:
		st.refused(now, b, v.RetryAfter)
	default:
		st.failing(now, b, v)
	}
}

// assign sends a token bucket assignment backed by r, and releases what it cannot hand out.
func (st *quotaStream) assign(b *quotaBucket, r Reservation) {
	now := st.s.now() // the ttl is measured from here: read the clock exactly
	plan := planAssignments(lease.TTL(r.Limits.Bucket))
	ttl := plan.ttl(now, r.Expires)
	k := min(int64(r.Tokens/r.Unit), maxAssignTokens)
	if ttl <= 0 || k < 1 {
		st.s.lim.Release(now, r, r.Tokens)
		st.schedule(b, now+clock.Of(quotaRetryFloor))
		return
	}
	bMax, f, ttl := tokenBucketFor(k, ttl, b.rate)
	handed := bucket.Micro(k) * r.Unit
	st.s.lim.Release(now, r, r.Tokens-handed)
	r.Tokens = handed
	st.supersede(b, now)
	a := &quotaAssignment{res: r, k: k, bMax: bMax, f: f, ttl: ttl, sentAt: now,
		endMax: now + clock.Of(ttl+AssignmentMargin), allowedAtSend: b.allowed}
	b.live = append(b.live, a)
	b.cur, b.state = a, quotaTokens
	st.s.metrics.quota().reserved(int64(handed))
	st.s.metrics.quota().assigned("token_bucket")
	st.out = appendTokenBucketAction(st.out, b.echo, ttl, bMax, f)
	lead := min(quotaRefreshLead, ttl/2)
	st.scheduleBy(b, now, now+clock.Of(ttl-lead))
}

// refused answers a key the global bucket refuses: DENY_ALL until it may allow again (a little
// longer, so the deny still holds when the next answer arrives), looked at again then. An early
// refresh keeps the token bucket Envoy has.
func (st *quotaStream) refused(now clock.Nanos, b *quotaBucket, retry time.Duration) {
	if st.keepCurrent(now, b) {
		return
	}
	retry = max(retry, quotaRetryFloor)
	st.denyAll(now, b, retry+quotaRefreshLead)
	st.schedule(b, now+clock.Of(retry))
}

// failing answers a key in its failure mode: a fail-closed rule's bucket DENY_ALL; an emergency
// rule's bucket an assignment that expires at once, so that Envoy applies its
// expired_assignment_behavior (the emergency bucket, docs/gateway.md). Each such expiry gives
// Envoy a fresh emergency bucket, so it is sent only to end an assignment Envoy still applies: not
// twice in one failure, not to a bucket that never had one (its no_assignment_behavior is the
// emergency bucket already), not after the assignment ran out (Envoy's fallback applies then).
// Looked at again after the key's backoff.
func (st *quotaStream) failing(now clock.Nanos, b *quotaBucket, v Verdict) {
	if st.keepCurrent(now, b) {
		return
	}
	retry := max(v.RetryAfter, quotaRetryFloor)
	switch {
	case !v.Degraded:
		st.denyAll(now, b, retry+quotaRefreshLead)
	case b.state == quotaNone || b.state == quotaTokens && now >= b.cur.sentAt+clock.Of(b.cur.ttl):
		b.state = quotaExpired
	case b.state != quotaExpired:
		st.supersede(b, now)
		b.state = quotaExpired
		st.s.metrics.quota().assigned("expire")
		st.action(b, assignment(0, blanket(typev3.RateLimitStrategy_DENY_ALL)))
	}
	st.schedule(b, now+clock.Of(retry))
}

// keepCurrent: the current token bucket has time left beyond the refresh lead; a refusal found by
// an early refresh leaves it (and its regular refresh) as it is.
func (st *quotaStream) keepCurrent(now clock.Nanos, b *quotaBucket) bool {
	if b.state != quotaTokens {
		return false
	}
	end := b.cur.sentAt + clock.Of(b.cur.ttl)
	if end-now > clock.Of(quotaRefreshLead) {
		st.scheduleBy(b, now, end-clock.Of(min(quotaRefreshLead, b.cur.ttl/2)))
		return true
	}
	return false
}

// denyAll sends DENY_ALL for ttl (whole seconds, rounded up: Envoys that read only whole seconds
// must not end it sooner; a longer deny is safe).
func (st *quotaStream) denyAll(now clock.Nanos, b *quotaBucket, ttl time.Duration) {
	st.supersede(b, now)
	b.state = quotaDenied
	st.s.metrics.quota().assigned("deny_all")
	st.action(b, assignment(ceilSecond(ttl), blanket(typev3.RateLimitStrategy_DENY_ALL)))
}

// allowAll answers a shadow rule's bucket: it never denies.
func (st *quotaStream) allowAll(now clock.Nanos, b *quotaBucket) {
	st.supersede(b, now)
	b.state = quotaAllowAll
	st.s.metrics.quota().assigned("allow_all")
	st.action(b, assignment(quotaAllowTTL, blanket(typev3.RateLimitStrategy_ALLOW_ALL)))
	st.scheduleBy(b, now, now+clock.Of(quotaAllowTTL-quotaRefreshLead))
}

// invalid answers a bucket that maps to no key: DENY_ALL (the request is refused, as Envoy's RLS
// filter refuses with failure_mode_deny), counted and logged once per stream.
func (st *quotaStream) invalid(now clock.Nanos, b *quotaBucket, err error) {
	if b.err == nil {
		st.s.metrics.quota().invalid()
		if !st.warned {
			st.warned = true
			st.s.log.Warn("rate limit quota bucket maps to no policy key; it is answered DENY_ALL (logged once per stream)",
				zap.Any("bucket_id", b.id.GetBucket()), zap.Error(err))
		}
	}
	b.err = err
	st.qs.observe(now, b, "", -1)
	st.denyAll(now, b, quotaInvalidTTL)
	st.scheduleBy(b, now, now+clock.Of(quotaInvalidTTL-quotaRefreshLead))
}

// abandon tells Envoy to forget b, idle for the stream's idle time: its assignments are settled
// (Envoy drops them within the margin) and b is forgotten too.
func (st *quotaStream) abandon(now clock.Nanos, b *quotaBucket) {
	st.supersede(b, now)
	st.s.metrics.quota().assigned("abandon")
	st.action(b, &rlqsv3.RateLimitQuotaResponse_BucketAction{BucketAction: &rlqsv3.RateLimitQuotaResponse_BucketAction_AbandonAction_{
		AbandonAction: &rlqsv3.RateLimitQuotaResponse_BucketAction_AbandonAction{}}})
	st.forget(now, b)
	delete(st.buckets, b.sig)
	b.gone = true
}

// forget ends the stream's business with b: a waiting reservation is dropped and every
// assignment settled as far as the reports known so far allow.
func (st *quotaStream) forget(now clock.Nanos, b *quotaBucket) {
	if b.ticket != nil {
		st.s.lim.Unreserve(now, b.ticket)
		b.ticket, b.polling = nil, false
	}
	st.settle(now, b, true)
	st.unschedule(b)
	st.qs.observe(now, b, "", -1)
	st.s.metrics.quota().bucket(-1)
}

// supersede: a new action for b is sent at now; Envoy stops admitting from the token buckets it
// had within the margin.
func (st *quotaStream) supersede(b *quotaBucket, now clock.Nanos) {
	end := now + clock.Of(AssignmentMargin)
	for _, a := range b.live {
		a.endMax = min(a.endMax, end)
	}
}

// settle releases what b's assignments will never admit. An assignment admits at most what its
// token bucket can give over its life, bMax + ⌊f·(endMax − sentAt)⌋ (it ends within the margin of
// a newer action). One that ended before the cut of the last report (the report arrived a margin
// after its end) admitted at most what the reports since its send say were allowed; one that may
// not have ended, also what it may admit after that cut: its bucket holds at most bMax then and
// refills f a second until it ends. final settles every assignment (the stream or the bucket
// ends: no report will come); otherwise only those that ended.
func (st *quotaStream) settle(now clock.Nanos, b *quotaBucket, final bool) {
	keep := b.live[:0]
	for _, a := range b.live {
		ended := b.reports > 0 && b.lastReport >= a.endMax+clock.Of(AssignmentMargin)
		if !ended && !final {
			keep = append(keep, a)
			continue
		}
		adm := b.allowed - a.allowedAtSend
		if !ended {
			from := a.sentAt
			if b.lastReport > a.sentAt+clock.Of(AssignmentMargin) {
				from = b.lastReport - clock.Of(AssignmentMargin) // the last report's cut was no sooner
			}
			adm += uint64(a.bMax) + refilled(a.f, from, a.endMax)
		}
		adm = min(adm, uint64(a.bMax)+refilled(a.f, a.sentAt, a.endMax), uint64(a.k))
		unused := bucket.Micro(uint64(a.k)-adm) * a.res.Unit
		st.s.lim.Release(now, a.res, unused)
		st.s.metrics.quota().reserved(-int64(a.res.Tokens))
		st.s.metrics.quota().released(int64(unused))
	}
	clear(b.live[len(keep):])
	b.live = keep
}

// refilled is the most tokens a bucket refilling f a second gains from from to to, rounded up to
// the millisecond.
func refilled(f int64, from, to clock.Nanos) uint64 {
	if to <= from {
		return 0
	}
	ms := (to - from + clock.Of(time.Millisecond) - 1) / clock.Of(time.Millisecond)
	return uint64(f) * uint64(ms) / 1000
}

// Field numbers of envoy.service.rate_limit_quota.v3.RateLimitQuotaResponse and the messages it
// holds, for the actions encoded by hand (checked against the generated descriptors by
// TestTokenBucketAction).
const (
	responseActionField     = 1 // RateLimitQuotaResponse.bucket_action
	actionBucketIDField     = 1 // BucketAction.bucket_id
	actionAssignmentField   = 2 // BucketAction.quota_assignment_action
	assignmentTTLField      = 2 // QuotaAssignmentAction.assignment_time_to_live
	assignmentStrategyField = 3 // QuotaAssignmentAction.rate_limit_strategy
	strategyTokenBucket     = 3 // RateLimitStrategy.token_bucket
	tokenBucketMaxField     = 1 // TokenBucket.max_tokens
	tokenBucketPerFillField = 2 // TokenBucket.tokens_per_fill (google.protobuf.UInt32Value)
	tokenBucketFillField    = 3 // TokenBucket.fill_interval (google.protobuf.Duration)
)

// appendAction appends a bucket action to the encoded response out: echo (its bucket_id field,
// echoField) and body (the rest of the action, encoded).
func appendAction(out, echo, body []byte) []byte {
	out = protowire.AppendTag(out, responseActionField, protowire.BytesType)
	out = protowire.AppendVarint(out, uint64(len(echo)+len(body)))
	return append(append(out, echo...), body...)
}

// appendTokenBucketAction appends the action assigning a token bucket of bMax tokens that gains f
// every second, for ttl, to the bucket of echo: every bucket of every stream gets one about every
// second, encoded here without building its nine messages.
func appendTokenBucketAction(out, echo []byte, ttl time.Duration, bMax, f int64) []byte {
	var perFillBuf, fillBuf, ttlBuf [24]byte
	var tbBuf, strategyBuf, assignBuf, bodyBuf [96]byte
	tb := appendUintField(tbBuf[:0], tokenBucketMaxField, uint64(uint32(bMax)))
	tb = appendMessageField(tb, tokenBucketPerFillField, appendUintField(perFillBuf[:0], 1, uint64(uint32(f))))
	tb = appendMessageField(tb, tokenBucketFillField, appendDuration(fillBuf[:0], time.Second))
	strategy := appendMessageField(strategyBuf[:0], strategyTokenBucket, tb)
	assign := appendMessageField(assignBuf[:0], assignmentTTLField, appendDuration(ttlBuf[:0], ttl))
	assign = appendMessageField(assign, assignmentStrategyField, strategy)
	return appendAction(out, echo, appendMessageField(bodyBuf[:0], actionAssignmentField, assign))
}

// appendMessageField appends field num holding the encoded message m.
func appendMessageField(b []byte, num protowire.Number, m []byte) []byte {
	return protowire.AppendBytes(protowire.AppendTag(b, num, protowire.BytesType), m)
}

// appendUintField appends varint field num of value x (nothing for 0, as proto3 omits it).
func appendUintField(b []byte, num protowire.Number, x uint64) []byte {
	if x == 0 {
		return b
	}
	return protowire.AppendVarint(protowire.AppendTag(b, num, protowire.VarintType), x)
}

// appendDuration appends the fields of a google.protobuf.Duration of d (seconds, nanos).
func appendDuration(b []byte, d time.Duration) []byte {
	b = appendUintField(b, 1, uint64(int64(d/time.Second)))
	return appendUintField(b, 2, uint64(int64(d%time.Second)))
}

// assignment is a quota assignment action of strategy for ttl.
func assignment(ttl time.Duration, strategy *typev3.RateLimitStrategy) *rlqsv3.RateLimitQuotaResponse_BucketAction {
	return &rlqsv3.RateLimitQuotaResponse_BucketAction{BucketAction: &rlqsv3.RateLimitQuotaResponse_BucketAction_QuotaAssignmentAction_{
		QuotaAssignmentAction: &rlqsv3.RateLimitQuotaResponse_BucketAction_QuotaAssignmentAction{
			AssignmentTimeToLive: durationpb.New(ttl),
			RateLimitStrategy:    strategy,
		}}}
}

func blanket(rule typev3.RateLimitStrategy_BlanketRule) *typev3.RateLimitStrategy {
	return &typev3.RateLimitStrategy{Strategy: &typev3.RateLimitStrategy_BlanketRule_{BlanketRule: rule}}
}

// ceilSecond rounds d up to whole seconds.
func ceilSecond(d time.Duration) time.Duration {
	return (d + time.Second - 1).Truncate(time.Second)
}
