package agent

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/calendar"
	"github.com/leasebucket/leasebucket/policy"
)

// Bounds of an Envoy RateLimitRequest. A request beyond them is INVALID_ARGUMENT and charges
// nothing. Envoy sends one descriptor per matching rate_limits entry of a route and one entry
// per action: a handful of each; the agent reads three entries.
const (
	// MaxEnvoyDescriptors bounds the descriptors of one request.
	MaxEnvoyDescriptors = 16
	// MaxEnvoyEntries bounds the entries of one descriptor.
	MaxEnvoyEntries = 8
	// MaxEnvoyValue bounds a domain, an entry's key and an entry's value, in bytes: a request
	// path may be policy.MaxPathLen (2 KiB) long; nothing the agent reads is longer.
	MaxEnvoyValue = 2048
)

// Response headers the agent asks Envoy to add (response_headers_to_add).
const (
	// DegradedHeader is added, with the value "true", when any descriptor was answered by its
	// rule's emergency bucket while the global state was unreachable.
	DegradedHeader = "x-ratelimit-degraded"
	// RetryAfterHeader is added to an OVER_LIMIT answer: the seconds (rounded up) until the
	// descriptors over their limit could allow the request.
	RetryAfterHeader = "retry-after"
	// RateLimitPolicyHeader and RateLimitHeader are the IETF RateLimit fields
	// (draft-ietf-httpapi-ratelimit-headers), added for descriptors whose rule sets headers: true.
	RateLimitPolicyHeader = "ratelimit-policy"
	RateLimitHeader       = "ratelimit"
)

// envoyServer is Envoy's rate limit service (envoy.service.ratelimit.v3) over the agent's check
// path, so envoy.filters.http.ratelimit uses the agent unchanged. Each descriptor is one check,
// mapped by the policy's envoy section (policy.Set.Envoy): its tenant_key entry is the tenant,
// route_key the request path and operation_key the operation; hits_addend is the cost.
//
// Every descriptor is evaluated and charged on its own, as Envoy's reference service does: when
// one is OVER_LIMIT the tokens the others took stay spent. Undoing them would need the lease to
// take credits back, and a credit that lands after the lease was replaced would hand tokens to a
// lease they were never granted to; a refused request is an attempt each bucket that allowed it
// has counted, like a request that fails upstream.
type envoyServer struct {
	ratelimitv3.UnimplementedRateLimitServiceServer
	s *Server
}

// ShouldRateLimit implements envoy.service.ratelimit.v3.RateLimitService. The overall code is
// OVER_LIMIT if any descriptor is over its limit. Otherwise, if a descriptor's rule fails closed
// without its global state, the answer is an UNAVAILABLE error: Envoy's failure_mode_deny (with
// status_on_error 503) turns it into a 503. Shadow rules answer OK and are counted.
func (e envoyServer) ShouldRateLimit(ctx context.Context, req *ratelimitv3.RateLimitRequest) (*ratelimitv3.RateLimitResponse, error) {
	s := e.s
	slots, err := s.envoySlots(req)
	if err != nil {
		s.metrics.invalid(err)
		s.metrics.envoy("invalid")
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if slots[0].q.after {
		return s.envoyAfter(slots)
	}
	if len(slots) == 1 || s.lim.view.Load().set.Envoy().PerDescriptor || !s.decideTogether(ctx, slots) {
		s.decide(ctx, apiEnvoy, slots)
	}
	return s.envoyResponse(slots)
}

// envoyResponse is the answer to an Envoy request whose descriptors were decided (ShouldRateLimit):
// OVER_LIMIT where any descriptor refuses or has no decision, else UNAVAILABLE where one fails
// closed, else OK; the error of a descriptor that failed.
func (s *Server) envoyResponse(slots []slot) (*ratelimitv3.RateLimitResponse, error) {
	resp := &ratelimitv3.RateLimitResponse{
		OverallCode: ratelimitv3.RateLimitResponse_OK,
		Statuses:    make([]*ratelimitv3.RateLimitResponse_DescriptorStatus, len(slots)),
	}
	var (
		over, degraded  bool
		failed          *Verdict
		retry           time.Duration
		policies, state []string
	)
	for i := range slots {
		sl := &slots[i]
		if sl.err != nil {
			// The request was valid when it was read: the agent is shutting down, the caller
			// went away, or a policy reload changed the descriptor's rule in between. What the
			// other descriptors took stays spent, as for any refused request.
			s.metrics.envoy("error")
			if errors.Is(sl.err, ErrClosed) || invalidCheck(sl.err) {
				return nil, status.Errorf(codes.Unavailable, "agent: descriptor %d: %v; retry", i, sl.err)
			}
			return nil, s.statusError(sl.err)
		}
		v := &sl.v
		st := &ratelimitv3.RateLimitResponse_DescriptorStatus{Code: ratelimitv3.RateLimitResponse_OK}
		resp.Statuses[i] = st
		degraded = degraded || v.Degraded
		switch v.Outcome {
		case Deny:
			st.Code, over = ratelimitv3.RateLimitResponse_OVER_LIMIT, true
			retry = max(retry, v.RetryAfter)
		case Unavailable:
			// Refused too: in an OVER_LIMIT answer it is one of the descriptors that refuse.
			st.Code = ratelimitv3.RateLimitResponse_OVER_LIMIT
			retry = max(retry, v.RetryAfter)
			if failed == nil {
				failed = v
			}
		case Allow:
		default:
			// No decision (a wait that leaked out): never OK, which Envoy would let through.
			st.Code, over = ratelimitv3.RateLimitResponse_OVER_LIMIT, true
		}
		if v.Limits == nil {
			continue
		}
		rem := min(max(v.Remaining, 0), v.Limits.Bucket.Capacity())
		st.CurrentLimit = currentLimit(v)
		st.LimitRemaining = uint32(min(int64(rem/bucket.PerToken), math.MaxUint32))
		now := wallFor(v.Limits)
		reset := time.Duration(resetMs(v.Limits, rem, now)) * time.Millisecond
		if v.Outcome != Allow {
			// Over the limit, the reset that matters is when this request could pass.
			reset = v.RetryAfter
		}
		st.DurationUntilReset = durationpb.New(reset)
		if v.Rule != nil && v.Rule.Headers && !v.Degraded && v.Outcome != Unavailable {
			p, r := rateLimitFields(v, rem, reset, window(v.Limits, now))
			policies, state = append(policies, p), append(state, r)
		}
	}
	switch {
	case over:
		resp.OverallCode = ratelimitv3.RateLimitResponse_OVER_LIMIT
		resp.ResponseHeadersToAdd = append(resp.ResponseHeadersToAdd, header(RetryAfterHeader, strconv.FormatInt(ceilSeconds(retry), 10)))
		s.metrics.envoy("over_limit")
	case failed != nil:
		s.metrics.envoy("unavailable")
		name := ""
		if failed.Rule != nil {
			name = failed.Rule.Name
		}
		return nil, status.Errorf(codes.Unavailable, "agent: rule %q fails closed while its global rate-limit state is unreachable; retry after %ds",
			name, ceilSeconds(failed.RetryAfter))
	default:
		s.metrics.envoy("ok")
	}
	if degraded {
		resp.ResponseHeadersToAdd = append(resp.ResponseHeadersToAdd, header(DegradedHeader, "true"))
	}
	if len(policies) > 0 {
		resp.ResponseHeadersToAdd = append(resp.ResponseHeadersToAdd,
			header(RateLimitPolicyHeader, strings.Join(policies, ", ")), header(RateLimitHeader, strings.Join(state, ", ")))
	}
	return resp, nil
}

// envoyAfter charges descriptors sent after the response (Envoy's apply_on_stream_done, marked
// with the policy's envoy.settle_key entry): each one's hits_addend is a cost after the fact,
// charged in every bucket its check would charge (from leases, the rest as debt). Envoy ignores
// the answer; it is OK for each.
func (s *Server) envoyAfter(slots []slot) (*ratelimitv3.RateLimitResponse, error) {
	now := s.now()
	resp := &ratelimitv3.RateLimitResponse{
		OverallCode: ratelimitv3.RateLimitResponse_OK,
		Statuses:    make([]*ratelimitv3.RateLimitResponse_DescriptorStatus, len(slots)),
	}
	for i := range slots {
		if err := s.lim.ChargeAfter(now, slots[i].q); err != nil {
			// Valid when read: the agent is shutting down, or a policy reload changed the
			// descriptor's rule in between. The descriptors before it stay charged.
			s.metrics.envoy("error")
			return nil, status.Errorf(codes.Unavailable, "agent: descriptor %d: %v; retry", i, err)
		}
		resp.Statuses[i] = &ratelimitv3.RateLimitResponse_DescriptorStatus{Code: ratelimitv3.RateLimitResponse_OK}
	}
	s.metrics.envoy("after_response")
	return resp, nil
}

func header(k, v string) *corev3.HeaderValue { return &corev3.HeaderValue{Key: k, Value: v} }

// ceilSeconds rounds d up to whole seconds (at least 1 for a positive d): HTTP delay-seconds.
func ceilSeconds(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return int64((d + time.Second - 1) / time.Second)
}

// rateLimitFields are a descriptor's items of the IETF RateLimit-Policy and RateLimit fields
// (draft-ietf-httpapi-ratelimit-headers), as the HTTP middleware writes them (docs/gateway.md):
// the rule's quota q per window w seconds (a window that is not whole seconds scaled to the least
// one that is: 5 per 1.5 s is q=10;w=3), the remaining r, and t, the seconds until more quota:
// on a refusal the Retry-After, on an allow the bucket's next token (0 when it is full).
func rateLimitFields(v *Verdict, rem bucket.Micro, reset, win time.Duration) (policy, state string) {
	name := sfString(v.Rule.Name)
	policy = name + ";q=" + strconv.FormatInt(v.Limits.Requests, 10)
	if q, w, ok := quotaWindow(v.Limits.Requests, win); ok {
		policy = name + ";q=" + strconv.FormatInt(q, 10) + ";w=" + strconv.FormatInt(w, 10)
	}
	t := reset // a refusal: the Retry-After; a calendar quota's next tokens come at its reset
	if v.Outcome == Allow && v.Limits.Calendar == nil {
		t = nextToken(reset, v.Limits.Period/time.Duration(max(v.Limits.Requests, 1)))
	}
	if t > 0 {
		t = time.Duration(ceilSeconds(t)) * time.Second
	}
	return policy, name + ";r=" + strconv.FormatInt(int64(rem/bucket.PerToken), 10) + ";t=" + strconv.FormatInt(int64(t/time.Second), 10)
}

// nextToken is how long until a bucket that is full in reset gains its next token, one coming
// every per: reset modulo per (a whole per when reset is a multiple of it), 0 when it is full.
func nextToken(reset, per time.Duration) time.Duration {
	if reset <= 0 || per <= 0 {
		return max(reset, 0)
	}
	if next := reset % per; next > 0 {
		return next
	}
	return min(per, reset)
}

// quotaWindow states limit per window in whole seconds; ok is false if that cannot be done
// below 2^53 (the window is then left out).
func quotaWindow(limit int64, window time.Duration) (q, w int64, ok bool) {
	ms := window.Milliseconds()
	if ms <= 0 {
		return limit, 0, false
	}
	a, b := ms, int64(1000)
	for b != 0 {
		a, b = b, a%b
	}
	scale := 1000 / a // a window of ms/a seconds holds scale windows of ms
	if limit > (1<<53)/scale {
		return limit, 0, false
	}
	return limit * scale, ms / a, true
}

// sfString writes s as a Structured Field string (RFC 8941): quoted, " and \ escaped. Rule names
// are printable ASCII.
func sfString(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for i := 0; i < len(s); i++ {
		if c := s[i]; c == '"' || c == '\\' {
			b.WriteByte('\\')
		}
		b.WriteByte(s[i])
	}
	b.WriteByte('"')
	return b.String()
}

// envoySlots validates a request as a whole and turns each descriptor into a check. Nothing is
// charged unless every descriptor is valid: the domain is the policy's, every descriptor has a
// tenant and a path entry (and at most one of each of the three keys, and no other key), its
// cost is 1..burst of its rule, and the request keeps the size bounds.
func (s *Server) envoySlots(req *ratelimitv3.RateLimitRequest) ([]slot, error) {
	v := s.lim.view.Load()
	m := v.set.Envoy()
	switch {
	case len(req.Domain) > MaxEnvoyValue:
		return nil, fmt.Errorf("%w: domain of %d bytes, at most %d", ErrInvalidRoute, len(req.Domain), MaxEnvoyValue)
	case req.Domain != m.Domain:
		return nil, fmt.Errorf("%w: domain %q is not served here; the policy's envoy.domain is %q", ErrInvalidRoute, req.Domain, m.Domain)
	case len(req.Descriptors) == 0:
		return nil, fmt.Errorf("%w: no descriptors", ErrInvalidRoute)
	case len(req.Descriptors) > MaxEnvoyDescriptors:
		return nil, fmt.Errorf("%w: %d descriptors, at most %d", ErrInvalidRoute, len(req.Descriptors), MaxEnvoyDescriptors)
	}
	slots := make([]slot, len(req.Descriptors))
	for i, d := range req.Descriptors {
		q, err := envoyQuery(m, d, req.HitsAddend)
		if err == nil {
			if q.after {
				err = s.lim.validAfter(v, q)
			} else {
				_, err = s.lim.resolve(v, q)
			}
		}
		if err == nil && q.after != slots[0].q.after && i > 0 {
			err = fmt.Errorf("%w: descriptors with the %q entry (sent after the response) and without it in one request", ErrInvalidRoute, m.SettleKey)
		}
		if err != nil {
			return nil, fmt.Errorf("descriptor %d: %w", i, err)
		}
		slots[i].q = q
	}
	return slots, nil
}

// envoyQuery reads one descriptor. The request-level hits_addend applies unless the descriptor
// sets its own; 0 (unset) at the request level means the rule's cost.
func envoyQuery(m policy.Envoy, d *commonv3.RateLimitDescriptor, hits uint32) (Query, error) {
	if d == nil {
		return Query{}, fmt.Errorf("%w: empty descriptor", ErrInvalidRoute)
	}
	switch {
	case d.Limit != nil:
		return Query{}, fmt.Errorf("%w: limit overrides are not supported: limits come from the policy file", ErrInvalidRoute)
	case d.IsNegativeHits:
		return Query{}, fmt.Errorf("%w: negative hits (refunds) are not supported", ErrInvalidCost)
	case len(d.Entries) == 0:
		return Query{}, fmt.Errorf("%w: no entries", ErrInvalidRoute)
	case len(d.Entries) > MaxEnvoyEntries:
		return Query{}, fmt.Errorf("%w: %d entries, at most %d", ErrInvalidRoute, len(d.Entries), MaxEnvoyEntries)
	}
	q := Query{Cost: int64(hits)}
	var tenant, path, op, after bool
	for j, en := range d.Entries {
		if en == nil {
			return Query{}, fmt.Errorf("%w: entry %d is empty", ErrInvalidRoute, j)
		}
		if len(en.Key) > MaxEnvoyValue || len(en.Value) > MaxEnvoyValue {
			return Query{}, fmt.Errorf("%w: entry %d: key of %d bytes and value of %d bytes, at most %d each",
				ErrInvalidRoute, j, len(en.Key), len(en.Value), MaxEnvoyValue)
		}
		var seen *bool
		switch en.Key {
		case m.TenantKey:
			seen, q.Tenant = &tenant, en.Value
		case m.RouteKey:
			seen, q.Path = &path, en.Value
		case m.OperationKey:
			seen, q.Operation = &op, en.Value
		case m.SettleKey:
			seen = &after
		default:
			return Query{}, fmt.Errorf("%w: entry %d: unknown key %q; this agent reads %q, %q, %q and %q",
				ErrInvalidRoute, j, en.Key, m.TenantKey, m.RouteKey, m.OperationKey, m.SettleKey)
		}
		if *seen {
			return Query{}, fmt.Errorf("%w: entry %d: key %q appears twice", ErrInvalidRoute, j, en.Key)
		}
		*seen = true
	}
	switch {
	case !tenant:
		return Query{}, fmt.Errorf("%w: no %q entry", ErrInvalidTenant, m.TenantKey)
	case !path:
		return Query{}, fmt.Errorf("%w: no %q entry", ErrInvalidRoute, m.RouteKey)
	}
	if d.HitsAddend != nil {
		h := d.HitsAddend.Value
		if h == 0 || h > math.MaxInt64 {
			return Query{}, fmt.Errorf("%w: hits_addend %d", ErrInvalidCost, h)
		}
		q.Cost = int64(h)
	}
	q.after = after
	return q, nil
}

// currentLimit is the rule's limit in Envoy's terms: requests per unit, the period in the
// largest unit that divides it (unit_multiplier when it is more than one). A period that is not
// whole seconds is stated per second, rounded down (at least 1).
func currentLimit(v *Verdict) *ratelimitv3.RateLimitResponse_RateLimit {
	l := v.Limits
	rl := &ratelimitv3.RateLimitResponse_RateLimit{RequestsPerUnit: uint32(min(l.Requests, math.MaxUint32))}
	if v.Rule != nil {
		rl.Name = v.Rule.Name
	}
	if c := l.Calendar; c != nil {
		rl.Unit = ratelimitv3.RateLimitResponse_RateLimit_DAY
		if c.Unit == calendar.Month {
			rl.Unit = ratelimitv3.RateLimitResponse_RateLimit_MONTH
		}
		return rl
	}
	for _, u := range []struct {
		d    time.Duration
		unit ratelimitv3.RateLimitResponse_RateLimit_Unit
	}{
		{24 * time.Hour, ratelimitv3.RateLimitResponse_RateLimit_DAY},
		{time.Hour, ratelimitv3.RateLimitResponse_RateLimit_HOUR},
		{time.Minute, ratelimitv3.RateLimitResponse_RateLimit_MINUTE},
		{time.Second, ratelimitv3.RateLimitResponse_RateLimit_SECOND},
	} {
		if l.Period >= u.d && l.Period%u.d == 0 {
			rl.Unit = u.unit
			if n := l.Period / u.d; n > 1 {
				rl.UnitMultiplier = wrapperspb.UInt32(uint32(min(int64(n), math.MaxUint32)))
			}
			return rl
		}
	}
	// Sub-second or fractional periods (500ms, 1500ms): per second.
	perSecond := max(1, l.Requests*int64(time.Second)/int64(l.Period))
	rl.Unit, rl.RequestsPerUnit = ratelimitv3.RateLimitResponse_RateLimit_SECOND, uint32(min(perSecond, math.MaxUint32))
	return rl
}
