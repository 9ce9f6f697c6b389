// Package envoyquota is a test harness: an Envoy-faithful client of the rate limit quota service
// (envoy.service.rate_limit_quota.v3), written from the documentation of Envoy's rate_limit_quota
// HTTP filter (envoy.extensions.filters.http.rate_limit_quota.v3) and of the protocol (rlqs.proto),
// so the agent's server is tested against what Envoy is documented to do rather than against
// itself. A Filter takes the filter's own typed configuration (RateLimitQuotaFilterConfig, as an
// Envoy configuration file holds it) and decides requests as the filter does:
//
//   - Bucket matching: the bucket_matchers tree (a matcher_list; predicates on request headers or
//     dynamic metadata, single, and/or/not, with exact, prefix, suffix, contains or safe_regex
//     value matches; the first match wins; on_no_match is the catch-all, and without it an
//     unmatched request is allowed and never reported). bucket_id_builder values are string_value
//     or custom_value of an HttpRequestHeaderMatchInput (a request header) or a DynamicMetadataInput
//     (a value of the request's dynamic metadata, e.g. the verified JWT's sub claim).
//   - Subscription and reports: the first request of a bucket is reported at once (a report of
//     that bucket alone, that request counted); every reporting_interval every bucket's usage since
//     the last report is reported, the domain in the first message of each stream.
//   - Assignments: a token bucket starts full at max_tokens and refills tokens_per_fill per
//     fill_interval, continuously (as Envoy's token bucket does: never fewer admissions than per-
//     interval fills); a request takes one token. An assignment with the active strategy extends it
//     (the token bucket carries over); any other strategy, or one after expiry, replaces it.
//     assignment_time_to_live: unset, no expiry; 0, expired at once.
//   - Fallbacks: before the first assignment, no_assignment_behavior (unset: allow all); after
//     expiry, expired_assignment_behavior (its fallback_rate_limit, or the last assignment) for
//     expired_assignment_behavior_timeout, then the bucket is abandoned; unset: abandoned at once.
//     An abandoned bucket (or one the server abandons) is forgotten with its usage, and its next
//     request subscribes again.
//   - The stream: opened with the first bucket; while it is down, reports are built (usage reset)
//     and dropped, and the stream is opened again at the next report; assignments already held keep
//     their time to live.
//
// Where Envoy's implementation departs from its documentation (it reads only the whole seconds of
// assignment_time_to_live and fill_interval; docs/gateway.md), the client follows the
// documentation, which is the stricter test of the agent's bounds: the agent sends whole seconds.
// Records of every decision let tests check the bounds from the outside.
package envoyquota

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	xdsmatcherv3 "github.com/cncf/xds/go/xds/type/matcher/v3"
	rlqfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/rate_limit_quota/v3"
	networkinputsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/matching/common_inputs/network/v3"
	rlqsv3 "github.com/envoyproxy/go-control-plane/envoy/service/rate_limit_quota/v3"
	matcherv3 "github.com/envoyproxy/go-control-plane/envoy/type/matcher/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"
)

// Request is what the filter sees of an HTTP request: its headers (":path", ":method", …) and the
// dynamic metadata earlier filters set (filter name → struct; jwt_authn's payload_in_metadata).
type Request struct {
	Headers  map[string]string
	Metadata map[string]*structpb.Struct
}

// Source is what decided a request.
type Source uint8

// Sources.
const (
	Unmatched   Source = iota // no bucket: allowed, not reported
	Assignment                // the bucket's active assignment
	NoAssigned                // no_assignment_behavior (before the first assignment)
	Expired                   // expired_assignment_behavior (after the assignment expired)
	BadBucketID               // the bucket id could not be built: allowed (Envoy fails open here)
)

func (s Source) String() string {
	return [...]string{"unmatched", "assignment", "no_assignment", "expired", "bad_bucket_id"}[s]
}

// Decision is the filter's answer to one request.
type Decision struct {
	Allowed bool
	Status  int // the deny response's HTTP status (429 unless deny_response_settings says otherwise)
	Source  Source
	Bucket  string // the bucket id, as "k=v,k=v" sorted by key; "" when unmatched
	At      time.Duration
}

// Options shape a Filter beyond Envoy's configuration.
type Options struct {
	// Now is the clock (monotonic time since some zero); time.Since(start) if nil.
	Now func() time.Duration
	// OnAction, if set, is called for every bucket action received, after it is applied.
	OnAction func(bucket string, a *rlqsv3.RateLimitQuotaResponse_BucketAction)
}

// Filter is one Envoy's rate_limit_quota filter with its RLQS client.
type Filter struct {
	cfg    *rlqfilterv3.RateLimitQuotaFilterConfig
	conn   grpc.ClientConnInterface
	opts   Options
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	// The bucket matchers' actions, decoded once (Envoy builds its matcher tree at load).
	settings map[*xdsmatcherv3.Matcher_OnMatch]*rlqfilterv3.RateLimitQuotaBucketSettings

	mu       sync.Mutex
	buckets  map[string]*qbucket
	interval time.Duration // reporting interval: the first bucket's
	started  bool

	smu    sync.Mutex // the stream and sending on it
	stream grpc.BidiStreamingClient[rlqsv3.RateLimitQuotaUsageReports, rlqsv3.RateLimitQuotaResponse]
	first  bool // the stream's first message is still to be sent

	statsMu sync.Mutex
	stats   Stats
}

// Stats counts what the client did.
type Stats struct {
	Streams, StreamErrors, Reports, DroppedReports int
	Actions                                        map[string]int // by kind: token_bucket, deny_all, allow_all, other, abandon
}

// qbucket is one bucket of the filter's cache.
type qbucket struct {
	sig      string
	id       *rlqsv3.BucketId
	settings *rlqfilterv3.RateLimitQuotaBucketSettings

	mu         sync.Mutex
	allowed    uint64 // since the last report
	denied     uint64
	lastReport time.Duration
	// The active assignment (nil: none yet), its expiry (0: none) and its token bucket.
	action    *rlqsv3.RateLimitQuotaResponse_BucketAction_QuotaAssignmentAction
	expiresAt time.Duration
	tb        *tokenBucket
	// After expiry: the fallback strategy (nil: the last assignment's) until fallbackEnd.
	expired     bool
	fallback    *typev3.RateLimitStrategy
	fallbackTB  *tokenBucket
	fallbackEnd time.Duration
	gone        bool // abandoned: the next request subscribes again
}

// New returns a Filter with cfg (validated as Envoy would) on conn, the RLQS server's connection
// (nil: none; every report is dropped, as while the server is unreachable).
func New(cfg *rlqfilterv3.RateLimitQuotaFilterConfig, conn grpc.ClientConnInterface, opts Options) (*Filter, error) {
	if err := cfg.ValidateAll(); err != nil {
		return nil, fmt.Errorf("envoyquota: invalid filter config: %w", err)
	}
	if opts.Now == nil {
		start := time.Now()
		opts.Now = func() time.Duration { return time.Since(start) }
	}
	f := &Filter{cfg: cfg, conn: conn, opts: opts, buckets: map[string]*qbucket{},
		settings: map[*xdsmatcherv3.Matcher_OnMatch]*rlqfilterv3.RateLimitQuotaBucketSettings{}}
	f.stats.Actions = map[string]int{}
	m := cfg.GetBucketMatchers()
	oms := []*xdsmatcherv3.Matcher_OnMatch{m.GetOnNoMatch()}
	for _, fm := range m.GetMatcherList().GetMatchers() {
		oms = append(oms, fm.GetOnMatch())
	}
	for _, om := range oms {
		if om == nil {
			continue
		}
		var st rlqfilterv3.RateLimitQuotaBucketSettings
		if err := om.GetAction().GetTypedConfig().UnmarshalTo(&st); err != nil {
			return nil, fmt.Errorf("envoyquota: a matcher's action is not RateLimitQuotaBucketSettings: %w", err)
		}
		f.settings[om] = &st
	}
	f.ctx, f.cancel = context.WithCancel(context.Background())
	return f, nil
}

// Close stops the reports and closes the stream.
func (f *Filter) Close() {
	f.cancel()
	f.smu.Lock()
	if f.stream != nil {
		_ = f.stream.CloseSend()
	}
	f.smu.Unlock()
	f.wg.Wait()
}

// Stats returns a copy of the counters.
func (f *Filter) Stats() Stats {
	f.statsMu.Lock()
	defer f.statsMu.Unlock()
	s := f.stats
	s.Actions = map[string]int{}
	for k, v := range f.stats.Actions {
		s.Actions[k] = v
	}
	return s
}

// Decide decides one request, as the filter's decodeHeaders does.
func (f *Filter) Decide(req Request) Decision {
	now := f.opts.Now()
	settings, ok := f.match(req)
	if !ok {
		return Decision{Allowed: true, Source: Unmatched, At: now}
	}
	id, err := buildBucketID(settings, req)
	if err != nil {
		return Decision{Allowed: true, Source: BadBucketID, At: now}
	}
	sig := Sig(id.Bucket)
	f.mu.Lock()
	b := f.buckets[sig]
	if b != nil {
		// A bucket abandoned by now (its expired behaviour timed out) is forgotten: this request
		// subscribes again.
		b.mu.Lock()
		b.advanceLocked(now)
		gone := b.gone
		b.mu.Unlock()
		if gone {
			b = nil
		}
	}
	created := b == nil
	if created {
		b = &qbucket{sig: sig, id: id, settings: settings, lastReport: now}
		f.buckets[sig] = b
		if !f.started {
			f.started = true
			f.interval = settings.GetReportingInterval().AsDuration()
			f.wg.Go(f.reportLoop)
		}
	}
	f.mu.Unlock()

	b.mu.Lock()
	d := b.decideLocked(now)
	d.Bucket = sig
	var report *rlqsv3.RateLimitQuotaUsageReports
	if created {
		// The first request of a bucket is reported at once: the subscription.
		report = &rlqsv3.RateLimitQuotaUsageReports{Domain: f.cfg.Domain,
			BucketQuotaUsages: []*rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage{b.usageLocked(now)}}
	}
	b.mu.Unlock()
	if report != nil {
		f.send(report)
	}
	return d
}

// decideLocked applies the bucket's current strategy to one request and counts it.
func (b *qbucket) decideLocked(now time.Duration) Decision {
	b.advanceLocked(now)
	var strategy *typev3.RateLimitStrategy
	var tb **tokenBucket
	src := Assignment
	switch {
	case b.action != nil && !b.expired:
		strategy, tb = b.action.RateLimitStrategy, &b.tb
	case b.expired:
		src = Expired
		if b.fallback != nil {
			strategy, tb = b.fallback, &b.fallbackTB
		} else {
			strategy, tb = b.action.GetRateLimitStrategy(), &b.tb // reuse_last_assignment
		}
	default:
		src = NoAssigned
		strategy, tb = b.settings.GetNoAssignmentBehavior().GetFallbackRateLimit(), &b.fallbackTB
	}
	allowed := apply(strategy, tb, now)
	if allowed {
		b.allowed++
	} else {
		b.denied++
	}
	status := 429
	if s := b.settings.GetDenyResponseSettings().GetHttpStatus(); s != nil {
		status = int(s.Code)
	}
	if allowed {
		status = 0
	}
	return Decision{Allowed: allowed, Status: status, Source: src, At: now}
}

// advanceLocked moves the bucket through expiry and the expired behaviour's timeout as of now.
func (b *qbucket) advanceLocked(now time.Duration) {
	if b.action != nil && !b.expired && b.expiresAt > 0 && now >= b.expiresAt {
		b.expireLocked(b.expiresAt)
	}
	if b.expired && now >= b.fallbackEnd {
		b.abandonLocked()
	}
}

// expireLocked: the active assignment ran out at t: the expired assignment behaviour applies for
// its timeout (unset: the bucket is abandoned at once).
func (b *qbucket) expireLocked(t time.Duration) {
	eb := b.settings.GetExpiredAssignmentBehavior()
	if eb == nil {
		b.abandonLocked()
		return
	}
	b.expired = true
	b.fallbackEnd = t + eb.GetExpiredAssignmentBehaviorTimeout().AsDuration()
	b.fallback, b.fallbackTB = nil, nil
	if fb := eb.GetFallbackRateLimit(); fb != nil {
		b.fallback = fb
	}
}

// abandonLocked forgets the bucket: the filter applies the no-assignment behaviour to its next
// request, which subscribes again.
func (b *qbucket) abandonLocked() {
	b.gone = true
	b.action, b.tb, b.expired, b.fallback, b.fallbackTB = nil, nil, false, nil, nil
}

// usageLocked is the bucket's usage since its last report, reset.
func (b *qbucket) usageLocked(now time.Duration) *rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage {
	u := &rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage{BucketId: b.id, TimeElapsed: durationpb.New(now - b.lastReport),
		NumRequestsAllowed: b.allowed, NumRequestsDenied: b.denied}
	b.allowed, b.denied, b.lastReport = 0, 0, now
	return u
}

// apply decides one request under strategy (nil: allow all), with *tb its token bucket (made
// when first needed).
func apply(s *typev3.RateLimitStrategy, tb **tokenBucket, now time.Duration) bool {
	switch {
	case s == nil:
		return true
	case s.GetTokenBucket() != nil:
		t := s.GetTokenBucket()
		if *tb == nil {
			*tb = newTokenBucket(float64(t.MaxTokens), float64(max(t.GetTokensPerFill().GetValue(), 1)), t.FillInterval.AsDuration(), now)
		}
		return (*tb).take(now)
	case s.GetRequestsPerTimeUnit() != nil:
		r := s.GetRequestsPerTimeUnit()
		if *tb == nil {
			*tb = newTokenBucket(float64(r.RequestsPerTimeUnit), float64(r.RequestsPerTimeUnit), unitDuration(r.TimeUnit), now)
		}
		return (*tb).take(now)
	case s.GetBlanketRule() == typev3.RateLimitStrategy_DENY_ALL:
		return false
	}
	return true // ALLOW_ALL
}

func unitDuration(u typev3.RateLimitUnit) time.Duration {
	switch u {
	case typev3.RateLimitUnit_MINUTE:
		return time.Minute
	case typev3.RateLimitUnit_HOUR:
		return time.Hour
	case typev3.RateLimitUnit_DAY:
		return 24 * time.Hour
	}
	return time.Second
}

// tokenBucket starts full at max tokens and gains perFill tokens per interval, continuously.
type tokenBucket struct {
	max, tokens, perSec float64
	last                time.Duration
}

func newTokenBucket(maxTokens, perFill float64, interval time.Duration, now time.Duration) *tokenBucket {
	rate := math.Inf(1)
	if interval > 0 {
		rate = perFill / interval.Seconds()
	}
	return &tokenBucket{max: maxTokens, tokens: maxTokens, perSec: rate, last: now}
}

func (t *tokenBucket) take(now time.Duration) bool {
	if now > t.last {
		t.tokens = min(t.max, t.tokens+t.perSec*(now-t.last).Seconds())
		t.last = now
	}
	if t.tokens >= 1 {
		t.tokens--
		return true
	}
	return false
}

// match runs the bucket matchers: the settings of the first matching bucket, or on_no_match's.
func (f *Filter) match(req Request) (*rlqfilterv3.RateLimitQuotaBucketSettings, bool) {
	m := f.cfg.GetBucketMatchers()
	for _, fm := range m.GetMatcherList().GetMatchers() {
		if predicate(fm.GetPredicate(), req) {
			return f.settings[fm.GetOnMatch()], true
		}
	}
	if om := m.GetOnNoMatch(); om != nil {
		return f.settings[om], true
	}
	return nil, false
}

func predicate(p *xdsmatcherv3.Matcher_MatcherList_Predicate, req Request) bool {
	switch {
	case p.GetSinglePredicate() != nil:
		sp := p.GetSinglePredicate()
		v, ok := input(sp.GetInput().GetTypedConfig().GetValue(), sp.GetInput().GetTypedConfig().GetTypeUrl(), req)
		return ok && stringMatch(sp.GetValueMatch(), v)
	case p.GetAndMatcher() != nil:
		for _, q := range p.GetAndMatcher().GetPredicate() {
			if !predicate(q, req) {
				return false
			}
		}
		return true
	case p.GetOrMatcher() != nil:
		return slices.ContainsFunc(p.GetOrMatcher().GetPredicate(), func(q *xdsmatcherv3.Matcher_MatcherList_Predicate) bool { return predicate(q, req) })
	case p.GetNotMatcher() != nil:
		return !predicate(p.GetNotMatcher(), req)
	}
	return false
}

func stringMatch(m *xdsmatcherv3.StringMatcher, v string) bool {
	if m == nil {
		return false
	}
	if m.GetIgnoreCase() {
		v = strings.ToLower(v)
	}
	lower := func(s string) string {
		if m.GetIgnoreCase() {
			return strings.ToLower(s)
		}
		return s
	}
	switch p := m.GetMatchPattern().(type) {
	case *xdsmatcherv3.StringMatcher_Exact:
		return v == lower(p.Exact)
	case *xdsmatcherv3.StringMatcher_Prefix:
		return strings.HasPrefix(v, lower(p.Prefix))
	case *xdsmatcherv3.StringMatcher_Suffix:
		return strings.HasSuffix(v, lower(p.Suffix))
	case *xdsmatcherv3.StringMatcher_Contains:
		return strings.Contains(v, lower(p.Contains))
	case *xdsmatcherv3.StringMatcher_SafeRegex:
		// RE2, as Envoy's google_re2; the whole value must match.
		re, err := regexp.Compile(`^(?:` + p.SafeRegex.GetRegex() + `)$`)
		return err == nil && re.MatchString(v)
	}
	return false
}

// Type URLs of the inputs the client reads.
const (
	headerInputURL   = "type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput"
	metadataInputURL = "type.googleapis.com/envoy.extensions.matching.common_inputs.network.v3.DynamicMetadataInput"
)

// input reads a matching input of the request: a header, or a string of the dynamic metadata.
func input(raw []byte, url string, req Request) (string, bool) {
	switch url {
	case headerInputURL:
		var h matcherv3.HttpRequestHeaderMatchInput
		if proto.Unmarshal(raw, &h) != nil {
			return "", false
		}
		v, ok := req.Headers[strings.ToLower(h.HeaderName)]
		return v, ok
	case metadataInputURL:
		var in networkinputsv3.DynamicMetadataInput
		if proto.Unmarshal(raw, &in) != nil {
			return "", false
		}
		s := req.Metadata[in.Filter]
		var v *structpb.Value
		for i, seg := range in.Path {
			if s == nil {
				return "", false
			}
			v = s.Fields[seg.GetKey()]
			if i < len(in.Path)-1 {
				s = v.GetStructValue()
			}
		}
		if sv, ok := v.GetKind().(*structpb.Value_StringValue); ok {
			return sv.StringValue, true
		}
	}
	return "", false
}

// buildBucketID builds the request's bucket id from the settings' bucket_id_builder.
func buildBucketID(s *rlqfilterv3.RateLimitQuotaBucketSettings, req Request) (*rlqsv3.BucketId, error) {
	b := s.GetBucketIdBuilder().GetBucketIdBuilder()
	if len(b) == 0 {
		return nil, errors.New("no bucket_id_builder")
	}
	id := &rlqsv3.BucketId{Bucket: make(map[string]string, len(b))}
	for k, vb := range b {
		switch {
		case vb.GetCustomValue() != nil:
			tc := vb.GetCustomValue().GetTypedConfig()
			v, ok := input(tc.GetValue(), tc.GetTypeUrl(), req)
			if !ok {
				return nil, fmt.Errorf("bucket_id %q: no value in the request", k)
			}
			id.Bucket[k] = v
		default:
			id.Bucket[k] = vb.GetStringValue()
		}
	}
	return id, nil
}

// Sig is a bucket id as "k=v,k=v", sorted by key (the order of its entries does not matter).
func Sig(id map[string]string) string {
	parts := make([]string, 0, len(id))
	for _, k := range slices.Sorted(maps.Keys(id)) {
		parts = append(parts, k+"="+strconv.Quote(id[k]))
	}
	return strings.Join(parts, ",")
}

// reportLoop reports every bucket's usage each reporting interval.
func (f *Filter) reportLoop() {
	t := time.NewTicker(f.interval)
	defer t.Stop()
	for {
		select {
		case <-f.ctx.Done():
			return
		case <-t.C:
		}
		now := f.opts.Now()
		f.mu.Lock()
		var usages []*rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage
		for sig, b := range f.buckets {
			b.mu.Lock()
			b.advanceLocked(now)
			if b.gone {
				delete(f.buckets, sig) // abandoned: its usage goes with it
			} else {
				usages = append(usages, b.usageLocked(now))
			}
			b.mu.Unlock()
		}
		f.mu.Unlock()
		if len(usages) > 0 {
			f.send(&rlqsv3.RateLimitQuotaUsageReports{Domain: f.cfg.Domain, BucketQuotaUsages: usages})
		}
	}
}

// send sends a report on the stream, opening it if it is down; a report that cannot be sent is
// dropped (its usage was reset when it was built, as Envoy's are).
func (f *Filter) send(r *rlqsv3.RateLimitQuotaUsageReports) {
	f.smu.Lock()
	defer f.smu.Unlock()
	if f.stream == nil && f.ctx.Err() == nil && f.conn != nil {
		c := rlqsv3.NewRateLimitQuotaServiceClient(f.conn)
		s, err := c.StreamRateLimitQuotas(f.ctx)
		if err == nil {
			f.stream, f.first = s, true
			f.count(func(st *Stats) { st.Streams++ })
			f.wg.Go(func() { f.receive(s) })
		}
	}
	if f.stream == nil {
		f.count(func(st *Stats) { st.DroppedReports++ })
		return
	}
	if !f.first {
		r = &rlqsv3.RateLimitQuotaUsageReports{BucketQuotaUsages: r.BucketQuotaUsages} // the domain only in the first message
	}
	if err := f.stream.Send(r); err != nil {
		f.stream = nil
		f.count(func(st *Stats) { st.DroppedReports++; st.StreamErrors++ })
		return
	}
	f.first = false
	f.count(func(st *Stats) { st.Reports++ })
}

func (f *Filter) count(fn func(*Stats)) {
	f.statsMu.Lock()
	fn(&f.stats)
	f.statsMu.Unlock()
}

// receive applies the server's responses until the stream ends.
func (f *Filter) receive(s grpc.BidiStreamingClient[rlqsv3.RateLimitQuotaUsageReports, rlqsv3.RateLimitQuotaResponse]) {
	for {
		resp, err := s.Recv()
		if err != nil {
			f.smu.Lock()
			if f.stream == s {
				f.stream = nil
				f.count(func(st *Stats) { st.StreamErrors++ })
			}
			f.smu.Unlock()
			return
		}
		now := f.opts.Now()
		for _, a := range resp.BucketAction {
			f.applyAction(now, a)
		}
	}
}

// applyAction applies one bucket action (a bucket the filter does not hold is ignored, as Envoy
// does).
func (f *Filter) applyAction(now time.Duration, a *rlqsv3.RateLimitQuotaResponse_BucketAction) {
	sig := Sig(a.GetBucketId().GetBucket())
	f.mu.Lock()
	b := f.buckets[sig]
	if b != nil && a.GetAbandonAction() != nil {
		delete(f.buckets, sig)
	}
	f.mu.Unlock()
	kind := "other"
	switch {
	case a.GetAbandonAction() != nil:
		kind = "abandon"
	case a.GetQuotaAssignmentAction().GetRateLimitStrategy().GetTokenBucket() != nil:
		kind = "token_bucket"
	case a.GetQuotaAssignmentAction() != nil:
		kind = strings.ToLower(a.GetQuotaAssignmentAction().GetRateLimitStrategy().GetBlanketRule().String())
	}
	f.count(func(st *Stats) { st.Actions[kind]++ })
	if b == nil {
		return
	}
	b.mu.Lock()
	if a.GetAbandonAction() != nil {
		b.abandonLocked()
	} else if qa := a.GetQuotaAssignmentAction(); qa != nil {
		b.assignLocked(now, qa)
	}
	b.mu.Unlock()
	if f.opts.OnAction != nil {
		f.opts.OnAction(sig, a)
	}
}

// assignLocked applies an assignment: the same strategy as the active assignment extends it (its
// token bucket carries over); another one, or any after expiry, replaces it with a fresh bucket.
func (b *qbucket) assignLocked(now time.Duration, qa *rlqsv3.RateLimitQuotaResponse_BucketAction_QuotaAssignmentAction) {
	b.advanceLocked(now)
	if b.gone {
		return
	}
	same := b.action != nil && !b.expired && proto.Equal(b.action.RateLimitStrategy, qa.RateLimitStrategy)
	if !same {
		b.tb = nil
	}
	b.action, b.expired, b.fallback, b.fallbackTB = qa, false, nil, nil
	b.expiresAt = 0
	if ttl := qa.GetAssignmentTimeToLive(); ttl != nil {
		b.expiresAt = now + ttl.AsDuration()
		if ttl.AsDuration() <= 0 {
			b.expireLocked(now)
		}
	}
}

// Bucket is the bucket id and settings the filter's matchers give req (ok false: no bucket; the
// request would be allowed and not reported).
func (f *Filter) Bucket(req Request) (map[string]string, *rlqfilterv3.RateLimitQuotaBucketSettings, bool) {
	settings, ok := f.match(req)
	if !ok {
		return nil, nil, false
	}
	id, err := buildBucketID(settings, req)
	if err != nil {
		return nil, settings, false
	}
	return id.Bucket, settings, true
}

// Buckets is the number of buckets the filter holds.
func (f *Filter) Buckets() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.buckets)
}

// Active reports the active assignment's strategy of the bucket sig (nil if it has none, or it
// expired) as of now.
func (f *Filter) Active(sig string) *typev3.RateLimitStrategy {
	f.mu.Lock()
	b := f.buckets[sig]
	f.mu.Unlock()
	if b == nil {
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.advanceLocked(f.opts.Now())
	if b.action == nil || b.expired {
		return nil
	}
	return b.action.RateLimitStrategy
}
