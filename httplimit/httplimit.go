// Package httplimit is the rate-limit filter for Go gateways: net/http middleware that asks the
// node's leasebucket agent about every request and calls the next handler only after an allow.
//
//	request ─▶ identity (authenticated principal) ─▶ policy: route template + operation class
//	        ─▶ agent Check ─▶ allow: next handler (marked if degraded)
//	                         deny: 429 + Retry-After   unavailable: 503 + Retry-After
//	                         agent unreachable: the route's failure mode, decided here
//
// The Filter reads the same policy file as the agent (policy.Watcher, or a fixed *policy.Set): it
// needs the rule of a request to apply the rule's failure mode when the agent itself cannot be
// reached, and to know whether the rule may expose the IETF RateLimit headers. docs/gateway.md
// describes the decisions, the headers and the choices behind them.
package httplimit

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/leasebucket/leasebucket/client"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/policy"
)

// Checker asks the agent for a decision; *client.Client is one.
type Checker interface {
	Check(ctx context.Context, req client.Request) (client.Result, error)
}

// Settler settles costs known after the response; *client.Client is one. Config.SettleCosts
// needs the Checker to be one.
type Settler interface {
	Settle(ctx context.Context, id uint64, cost int64) (client.Settled, error)
}

// PolicySource gives the policy in use; *policy.Watcher is one, Static another.
type PolicySource interface {
	Current() *policy.Set
}

// Static is a PolicySource that always gives set.
func Static(set *policy.Set) PolicySource { return staticSet{set} }

type staticSet struct{ set *policy.Set }

func (s staticSet) Current() *policy.Set { return s.set }

const (
	// DefaultTimeout bounds one check. The agent answers within its --max-wait (50 ms) even when
	// it falls back to a rule's failure mode; past 250 ms it is not answering, and the Filter
	// applies the failure mode itself.
	DefaultTimeout = 250 * time.Millisecond

	// DefaultDegradedHeader marks responses allowed (or denied) by an emergency bucket, with the
	// value "true": the header the agent asks Envoy to add in the same case, so a client sees
	// one marker whichever gateway it talks to.
	DefaultDegradedHeader = "X-RateLimit-Degraded"

	// DefaultMaxEmergencyKeys bounds the Filter's own emergency buckets (used only while the
	// agent is unreachable): about 100 bytes each, so a few megabytes at most.
	DefaultMaxEmergencyKeys = 1 << 16

	// maxIdempotencyKey is the agent's bound on idempotency keys (agent.MaxIdempotencyKey); a
	// longer header is ignored (the request is charged as usual) rather than refused. UUIDs and
	// ULIDs are 26–36 bytes.
	maxIdempotencyKey = 256
)

// Config configures a Filter. Checker, Policy and Identity are required.
type Config struct {
	Checker Checker
	Policy  PolicySource
	// Identity reads the authenticated principal (FromContext, ContextValue, ClientCertificate,
	// TrustedHeader, or your own).
	Identity Identity
	// Anonymous is the tenant of requests without an identity: all of them share its buckets
	// (give it a small limit with a tenant override in the policy). If empty, such a request is
	// answered 503 with the rule's Retry-After and never reaches upstream: a request that
	// reaches the rate limiter without an identity means authentication did not run for its
	// route, which the limiter must not paper over. 401 and 403 are authentication's and
	// authorization's answers, not the limiter's.
	Anonymous string
	// Operation names the request's operation for the policy: the HTTP method by default. A
	// gateway that knows named operations (a bulk export) returns them here.
	Operation func(*http.Request) string
	// Cost is the request's cost in tokens; 0 (and the default) is the rule's cost.
	Cost func(*http.Request) int64
	// SettleCosts makes Cost an estimate, replaced by the actual cost once the handler returns:
	// the handler reports it with ReportCost (a request that reports none keeps its estimate).
	// Extra cost beyond the estimate is charged even past the limit (down to the rule's
	// max_debt), an unused estimate is given back. The Checker must be a Settler.
	SettleCosts bool
	// Region is the node's region, as the agent's --region: needed for the Filter's own
	// emergency buckets on rules with regional scope.
	Region string
	// Timeout bounds one check; DefaultTimeout if zero.
	Timeout time.Duration
	// IdempotencyHeader, if set, names the request header whose value is passed to the agent as
	// the idempotency key (for example "Idempotency-Key"): a repeat of the key on the same
	// bucket within the agent's window gets the first decision without being charged again.
	// Off by default: a client can replay an allowed key within the window without being
	// charged, so enable it only where upstream honours the same key (answers a repeat from
	// its record instead of doing the work again).
	IdempotencyHeader string
	// DegradedHeader names the response header (value "true") that marks a response decided by
	// an emergency bucket; DefaultDegradedHeader if empty.
	DegradedHeader string
	// MaxEmergencyKeys bounds the Filter's own emergency buckets; DefaultMaxEmergencyKeys if zero.
	MaxEmergencyKeys int
	// Now is the clock of the Filter's emergency buckets; time.Now if nil.
	Now     func() time.Time
	Metrics *Metrics // nil: none
	Logger  *zap.Logger
}

// Filter is the rate-limit filter. It is safe for concurrent use.
type Filter struct {
	cfg       Config
	log       *zap.Logger // sampled: an unreachable agent does not flood the log
	emergency *emergencyBuckets
}

// New returns a Filter.
func New(cfg Config) (*Filter, error) {
	switch {
	case cfg.Checker == nil:
		return nil, errors.New("httplimit: Config.Checker is required")
	case cfg.Policy == nil:
		return nil, errors.New("httplimit: Config.Policy is required")
	case cfg.Identity == nil:
		return nil, errors.New("httplimit: Config.Identity is required")
	case cfg.Policy.Current() == nil:
		return nil, errors.New("httplimit: Config.Policy has no policy")
	}
	if _, ok := cfg.Checker.(Settler); cfg.SettleCosts && !ok {
		return nil, errors.New("httplimit: Config.SettleCosts needs a Checker that can Settle (a *client.Client)")
	}
	if cfg.Anonymous != "" {
		if err := policy.ValidTenant(cfg.Anonymous); err != nil {
			return nil, fmt.Errorf("httplimit: Config.Anonymous: %w", err)
		}
	}
	if cfg.Operation == nil {
		cfg.Operation = func(r *http.Request) string { return r.Method }
	}
	if cfg.Cost == nil {
		cfg.Cost = func(*http.Request) int64 { return 0 }
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.DegradedHeader == "" {
		cfg.DegradedHeader = DefaultDegradedHeader
	}
	cfg.DegradedHeader = http.CanonicalHeaderKey(cfg.DegradedHeader)
	cfg.IdempotencyHeader = http.CanonicalHeaderKey(cfg.IdempotencyHeader)
	if cfg.MaxEmergencyKeys <= 0 {
		cfg.MaxEmergencyKeys = DefaultMaxEmergencyKeys
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	log := cfg.Logger.WithOptions(zap.WrapCore(func(c zapcore.Core) zapcore.Core {
		return zapcore.NewSamplerWithOptions(c, time.Second, 1, 0) // each message once a second
	}))
	return &Filter{cfg: cfg, log: log, emergency: newEmergencyBuckets(cfg.MaxEmergencyKeys, cfg.Now)}, nil
}

// Handler wraps next: next is called only for requests the limiter allows.
func (f *Filter) Handler(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { f.serve(w, r, next) })
}

// Outcomes, as the metrics count them.
const (
	outAllow         = "allow"
	outDeny          = "deny"
	outUnavailable   = "unavailable"
	outDegradedAllow = "degraded_allow"
	outDegradedDeny  = "degraded_deny"
	outShadowDeny    = "shadow_deny"
	outNoIdentity    = "no_identity"
	outBadRequest    = "bad_request"
	outConflict      = "conflict"
)

// degradedValue is the degraded marker's value.
const degradedValue = "true"

// pendingRetry is the Retry-After of a 409 for a repeat whose first check is being decided: the
// first is decided within the agent's wait bound (tens of milliseconds), so the shortest
// Retry-After the header can say.
const pendingRetry = time.Second

func (f *Filter) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	set := f.cfg.Policy.Current()
	path := r.URL.EscapedPath() // as received: %2F stays inside its segment
	op := f.cfg.Operation(r)
	route, err := set.Match(path, op)
	if err != nil { // a path that cannot be normalized safely; nothing is charged
		f.cfg.Metrics.outcome("", outBadRequest)
		refuse(w, http.StatusBadRequest, 0)
		return
	}
	rule := route.Rule
	tenant, ok := f.cfg.Identity(r)
	if ok {
		if err := policy.ValidTenant(tenant); err != nil {
			// Authentication produced a principal the policy cannot key (too long, control
			// bytes): a configuration problem, and not the anonymous tenant's.
			f.log.Error("rate limit: the authenticated principal is not a valid tenant; refusing", zap.Error(err))
			f.noIdentity(w, rule)
			return
		}
	} else {
		if f.cfg.Anonymous == "" {
			f.log.Warn("rate limit: request without an identity; refusing (set an anonymous tenant to limit such requests instead)",
				zap.String("rule", rule.Name))
			f.noIdentity(w, rule)
			return
		}
		tenant = f.cfg.Anonymous
	}
	// A rule without headers: an allow's RateLimit fields would not be read, so the agent leaves
	// them out (a smaller answer, cheaper for both ends). Should the agent decide by a rule with
	// headers on (the two between reloads), the answer has no window and headersAllowed says no.
	req := client.Request{Tenant: tenant, Route: path, Operation: op, Cost: f.cfg.Cost(r), IdempotencyKey: f.idempotencyKey(r),
		Settle: f.cfg.SettleCosts, Brief: !rule.Headers}
	ctx, cancel := context.WithTimeout(r.Context(), f.cfg.Timeout)
	start := time.Now()
	res, err := f.cfg.Checker.Check(ctx, req)
	cancel()
	f.cfg.Metrics.checked(time.Since(start))
	if err != nil {
		f.checkFailed(w, r, next, set, route, req, err)
		return
	}
	h := w.Header()
	switch res.Decision {
	case client.Allow:
		switch {
		case res.Degraded:
			h.Set(f.cfg.DegradedHeader, degradedValue)
			f.cfg.Metrics.outcome(res.Rule, outDegradedAllow)
		case res.ShadowDeny:
			f.cfg.Metrics.outcome(res.Rule, outShadowDeny)
		default:
			f.cfg.Metrics.outcome(res.Rule, outAllow)
		}
		if f.headersAllowed(set, rule, res) {
			setRateLimit(h, res.Rule, res.Limit, res.Window, res.Remaining, nextToken(res))
		}
		if res.SettleID != 0 {
			f.serveSettled(w, r, next, res.SettleID)
			return
		}
		next.ServeHTTP(w, r)
	case client.Deny:
		if res.Degraded {
			h.Set(f.cfg.DegradedHeader, degradedValue)
			f.cfg.Metrics.outcome(res.Rule, outDegradedDeny)
		} else {
			f.cfg.Metrics.outcome(res.Rule, outDeny)
		}
		if f.headersAllowed(set, rule, res) {
			// t is the Retry-After: both say when a retry can succeed.
			setRateLimit(h, res.Rule, res.Limit, res.Window, res.Remaining, res.RetryAfter)
		}
		refuse(w, http.StatusTooManyRequests, res.RetryAfter)
	default: // client.Unavailable
		f.cfg.Metrics.outcome(res.Rule, outUnavailable)
		refuse(w, http.StatusServiceUnavailable, res.RetryAfter)
	}
}

// headersAllowed reports whether the response may carry RateLimit headers: the rule that decided
// (as the agent names it, looked up in the Filter's policy) has headers on, and the answer
// describes the rule's bucket (not an emergency bucket). If the agent names a rule this policy
// does not know (the two are between reloads), no headers: policy is revealed only where the
// policy says so.
func (f *Filter) headersAllowed(set *policy.Set, matched *policy.Rule, res client.Result) bool {
	if res.Degraded || res.Window <= 0 || res.Rule == "" {
		return false
	}
	r := matched
	if r.Name != res.Rule {
		if r = set.Rule(res.Rule); r == nil {
			return false
		}
	}
	return r.Headers
}

// idempotencyKey is the configured header's value, if it appears once and is short enough.
func (f *Filter) idempotencyKey(r *http.Request) string {
	if f.cfg.IdempotencyHeader == "" {
		return ""
	}
	v := r.Header[f.cfg.IdempotencyHeader]
	if len(v) != 1 || len(v[0]) > maxIdempotencyKey {
		return ""
	}
	return v[0]
}

// noIdentity refuses a request the Filter cannot key: 503 with the rule's Retry-After, as a
// fail-closed route answers when it cannot decide.
func (f *Filter) noIdentity(w http.ResponseWriter, rule *policy.Rule) {
	f.cfg.Metrics.outcome(rule.Name, outNoIdentity)
	refuse(w, http.StatusServiceUnavailable, rule.FailureRetryAfter)
}

// checkFailed answers when the agent gave no decision: a malformed check is the client's 400, a
// concurrent repeat of an idempotency key 409; an unreachable agent gets the matched rule's
// failure mode, decided here.
func (f *Filter) checkFailed(w http.ResponseWriter, r *http.Request, next http.Handler, set *policy.Set,
	route policy.Route, req client.Request, err error) {
	rule := route.Rule
	if r.Context().Err() != nil {
		// The client went away; nobody reads the answer, and upstream is not called.
		refuse(w, http.StatusServiceUnavailable, 0)
		return
	}
	if inv := (*client.InvalidError)(nil); errors.As(err, &inv) {
		f.cfg.Metrics.outcome(rule.Name, outBadRequest)
		refuse(w, http.StatusBadRequest, 0)
		return
	}
	if errors.Is(err, client.ErrIdempotencyPending) {
		// A repeat of an idempotency key whose first request is still being decided: 409, as
		// the Idempotency-Key header's specification answers a retry that overlaps its first
		// attempt. Nothing was charged.
		f.cfg.Metrics.outcome(rule.Name, outConflict)
		refuse(w, http.StatusConflict, pendingRetry)
		return
	}
	f.cfg.Metrics.agentUnreachable()
	f.log.Warn("rate limit: agent unreachable; applying the route's failure mode", zap.Error(err))
	if rule.OnFailure != policy.Emergency {
		if rule.Shadow {
			f.cfg.Metrics.outcome(rule.Name, outShadowDeny)
			next.ServeHTTP(w, r)
			return
		}
		f.cfg.Metrics.outcome(rule.Name, outUnavailable)
		refuse(w, http.StatusServiceUnavailable, rule.FailureRetryAfter)
		return
	}
	allowed, retry, ok := f.takeEmergency(set, route, req)
	switch {
	case !ok: // no bucket to spend (the table is full, or the limits cannot be resolved)
		f.cfg.Metrics.outcome(rule.Name, outUnavailable)
		refuse(w, http.StatusServiceUnavailable, rule.FailureRetryAfter)
	case allowed:
		w.Header().Set(f.cfg.DegradedHeader, degradedValue)
		f.cfg.Metrics.outcome(rule.Name, outDegradedAllow)
		next.ServeHTTP(w, r)
	case rule.Shadow:
		w.Header().Set(f.cfg.DegradedHeader, degradedValue)
		f.cfg.Metrics.outcome(rule.Name, outShadowDeny)
		next.ServeHTTP(w, r)
	default:
		w.Header().Set(f.cfg.DegradedHeader, degradedValue)
		f.cfg.Metrics.outcome(rule.Name, outDegradedDeny)
		refuse(w, http.StatusTooManyRequests, retry)
	}
}

// takeEmergency spends the request's cost from the Filter's own emergency bucket of its key.
// ok is false when there is no bucket to spend from.
func (f *Filter) takeEmergency(set *policy.Set, route policy.Route, req client.Request) (allowed bool, retry time.Duration, ok bool) {
	lim, err := set.Limits(route, req.Tenant, f.cfg.Region)
	if err != nil || lim.Emergency == nil {
		f.log.Error("rate limit: no emergency bucket for the route", zap.String("rule", route.Rule.Name), zap.Error(err))
		return false, 0, false
	}
	key, err := set.Key(route, req.Tenant, f.cfg.Region) // carries the limit's fingerprint
	if err != nil {
		return false, 0, false
	}
	cost := req.Cost
	if cost <= 0 {
		cost = set.Cost(route)
	}
	allowed, retry, ok = f.emergency.take(key, lim.Emergency.Bucket, bucket.Micro(cost)*bucket.PerToken)
	if ok && !allowed && retry < 0 { // the cost can never fit the emergency bucket
		retry = route.Rule.FailureRetryAfter
	}
	return allowed, retry, ok
}

// refuse answers without calling upstream: the status, Retry-After in whole seconds rounded up
// (RFC 9110 delay-seconds; at least 1) when retry is positive, and a generic body that names
// nothing internal.
func refuse(w http.ResponseWriter, code int, retry time.Duration) {
	h := w.Header()
	if retry > 0 {
		h.Set("Retry-After", strconv.FormatInt(ceilSeconds(retry), 10))
	}
	h.Set("Content-Type", "text/plain; charset=utf-8")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_, _ = w.Write([]byte(http.StatusText(code) + "\n"))
}

// ceilSeconds rounds d up to whole seconds, at least 1.
func ceilSeconds(d time.Duration) int64 {
	return max(1, int64((d+time.Second-1)/time.Second))
}

// setRateLimit writes the IETF RateLimit-Policy and RateLimit fields
// (draft-ietf-httpapi-ratelimit-headers): the policy's quota q per window w seconds, the
// remaining quota r, and t, the seconds until more quota is available (on a denial the
// Retry-After; on an allow the next token, nextToken). A request is charged to exactly one
// bucket, so there is one policy. No partition key (pk): it would reveal how requests are keyed.
func setRateLimit(h http.Header, rule string, limit int64, window time.Duration, remaining int64, t time.Duration) {
	name := sfString(rule)
	var p strings.Builder
	p.WriteString(name)
	q, w, ok := quotaWindow(limit, window)
	p.WriteString(";q=" + strconv.FormatInt(q, 10))
	if ok {
		p.WriteString(";w=" + strconv.FormatInt(w, 10))
	}
	h.Set("RateLimit-Policy", p.String())
	rl := name + ";r=" + strconv.FormatInt(max(remaining, 0), 10)
	if t > 0 {
		rl += ";t=" + strconv.FormatInt(ceilSeconds(t), 10)
	} else {
		rl += ";t=0"
	}
	h.Set("RateLimit", rl)
}

// nextToken is how long until the bucket of an allowed request gains its next token: 0 if it is
// full. The bucket refills one token every window/limit, continuously, and Reset is the time until
// it is full, so the next token is Reset modulo a token's time (a whole token's time when Reset
// is a multiple of it).
func nextToken(res client.Result) time.Duration {
	if res.Reset <= 0 || res.Limit <= 0 || res.Window <= 0 {
		return 0
	}
	per := res.Window / time.Duration(res.Limit)
	if per <= 0 {
		return res.Reset
	}
	if next := res.Reset % per; next > 0 {
		return next
	}
	return min(per, res.Reset)
}

// quotaWindow expresses limit per window in whole seconds, as the field requires: a window that
// is not a whole number of seconds is scaled to the least one that is (5 per 1.5 s is 10 per 3 s).
// ok is false if that is not representable (the window is then left out).
func quotaWindow(limit int64, window time.Duration) (q, w int64, ok bool) {
	ms := window.Milliseconds()
	if ms <= 0 {
		return limit, 0, false
	}
	g := gcd(ms, 1000)
	scale := 1000 / g // windows of ms/g seconds hold scale windows of ms
	if limit > (1<<53)/scale {
		return limit, 0, false
	}
	return limit * scale, ms / g, true
}

func gcd(a, b int64) int64 {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

// sfString writes s as a Structured Field string (RFC 8941): quoted, with " and \ escaped. Rule
// names are printable ASCII already.
func sfString(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '"' || c == '\\':
			b.WriteByte('\\')
			b.WriteByte(c)
		case c >= 0x20 && c < 0x7f:
			b.WriteByte(c)
		}
	}
	b.WriteByte('"')
	return b.String()
}

// costReport is where a handler's ReportCost lands: the request's context carries it.
type costReport struct {
	cost     atomic.Int64
	reported atomic.Bool
}

type costKey struct{}

// ReportCost tells the Filter the actual cost of the request in tokens, once the handler knows
// it (tokens of a model's answer, bytes, rows), when Config.SettleCosts is on: it replaces the
// estimate after the handler returns. The last report counts. Outside such a request it does
// nothing.
func ReportCost(ctx context.Context, tokens int64) {
	if c, ok := ctx.Value(costKey{}).(*costReport); ok {
		c.cost.Store(tokens)
		c.reported.Store(true)
	}
}

// serveSettled runs next with a cost report in the request's context, then settles the check
// with the reported cost, off the request's path (its response is done).
func (f *Filter) serveSettled(w http.ResponseWriter, r *http.Request, next http.Handler, id uint64) {
	c := &costReport{}
	next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), costKey{}, c)))
	if !c.reported.Load() {
		// The estimate stands; the agent drops its hold of the check after its settle window.
		f.cfg.Metrics.settled("estimate")
		return
	}
	f.settle(id, c.cost.Load())
}

// settle sends the settle of id in the background: the response is done, its writer gone.
func (f *Filter) settle(id uint64, cost int64) {
	s := f.cfg.Checker.(Settler)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), f.cfg.Timeout)
		defer cancel()
		if _, err := s.Settle(ctx, id, cost); err != nil {
			f.cfg.Metrics.settled("error")
			f.log.Warn("rate limit: settling a request's cost failed", zap.Error(err))
			return
		}
		f.cfg.Metrics.settled("ok")
	}()
}
