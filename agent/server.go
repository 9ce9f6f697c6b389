package agent

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	rlqsv3 "github.com/envoyproxy/go-control-plane/envoy/service/rate_limit_quota/v3"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/agent/audit"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/policy"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

const (
	// DefaultMaxWait bounds how long a check waits for a refill before the route's failure mode
	// answers. A refill within a region takes a millisecond or two; 50 ms covers a slow one and a
	// retry on another coordinator, and is still short next to a gateway's own timeouts.
	DefaultMaxWait = 50 * time.Millisecond

	// deadlineMargin is kept from the caller's deadline for the answer to travel back: a check
	// whose caller allows 10 ms waits at most 9 ms, then answers with the failure mode.
	deadlineMargin = time.Millisecond
)

// ServerConfig configures a Server. Limiter and Clock are required.
type ServerConfig struct {
	Limiter *Limiter
	Clock   clock.Clock   // the clock the Limiter's leases are measured on
	MaxWait time.Duration // DefaultMaxWait if zero
	Metrics *Metrics      // nil: none
	Logger  *zap.Logger
	// IdempotencyWindow is how long a repeat of (bucket, idempotency key) is answered with the
	// first decision: DefaultIdempotencyWindow if zero; negative turns idempotency keys off (a
	// repeat is charged again).
	IdempotencyWindow time.Duration
	// IdempotencyKeys bounds the remembered keys (DefaultIdempotencyKeys if zero).
	IdempotencyKeys int
	// Audit receives an event for every deny, unavailable, degraded and shadow-would-deny answer
	// and for sampled allows; nil: no audit.
	Audit *audit.Queue
	// QuotaIdle is how long a rate limit quota bucket may report no request before it is
	// abandoned (DefaultQuotaIdle if zero).
	QuotaIdle time.Duration
}

// Server is the agent's gRPC face: AgentService (Check, CheckBatch, CheckStream) and Envoy's
// RateLimitService over the check path. It validates nothing itself (the Limiter rejects
// malformed checks) and maps errors to status codes; every API decides through the same path
// (start, settle, record below), so waits, failure modes, idempotency, metrics and audit are the
// same whichever API a gateway uses.
type Server struct {
	agentv1.UnimplementedAgentServiceServer
	lim *Limiter
	clk clock.Clock
	// now is the reading each call decides by: the clock's exact reading (Fresh) when it has one.
	// A coarse clock is updated by a ticker goroutine; after the process was starved, a call may
	// run before the ticker does, and a stale reading would let a lease look alive past its
	// expiry. One exact reading a call costs tens of nanoseconds against microseconds of gRPC.
	now     func() clock.Nanos
	maxWait time.Duration
	metrics *Metrics
	log     *zap.Logger
	idem    *idempotency // nil: off
	audit   *audit.Queue // nil: off
	quota   *quotaService

	draining  chan struct{} // closed by Drain: streams end
	drainOnce sync.Once
}

// NewServer returns a Server over cfg.Limiter.
func NewServer(cfg ServerConfig) *Server {
	if cfg.MaxWait <= 0 {
		cfg.MaxWait = DefaultMaxWait
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	s := &Server{lim: cfg.Limiter, clk: cfg.Clock, now: cfg.Clock.Now, maxWait: cfg.MaxWait, metrics: cfg.Metrics, log: cfg.Logger,
		audit: cfg.Audit, draining: make(chan struct{})}
	if f, ok := cfg.Clock.(interface{ Fresh() clock.Nanos }); ok {
		s.now = f.Fresh
	}
	s.quota = newQuotaService(s, cfg.QuotaIdle)
	if cfg.IdempotencyWindow >= 0 {
		if cfg.IdempotencyWindow == 0 {
			cfg.IdempotencyWindow = DefaultIdempotencyWindow
		}
		if cfg.IdempotencyKeys <= 0 {
			cfg.IdempotencyKeys = DefaultIdempotencyKeys
		}
		s.idem = newIdempotency(cfg.IdempotencyWindow, cfg.IdempotencyKeys)
		s.metrics.watchIdempotency(s.idem)
	}
	return s
}

// Register registers AgentService, Envoy's RateLimitService and RateLimitQuotaService and
// grpc.health.v1 on g and returns the health server, which reports SERVING for "" and for the
// three services until its Shutdown.
func (s *Server) Register(g *grpc.Server) *health.Server {
	agentv1.RegisterAgentServiceServer(g, s)
	ratelimitv3.RegisterRateLimitServiceServer(g, envoyServer{s: s})
	rlqsv3.RegisterRateLimitQuotaServiceServer(g, s.quota)
	h := health.NewServer()
	h.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	h.SetServingStatus(agentv1.AgentService_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)
	h.SetServingStatus(ratelimitv3.RateLimitService_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)
	h.SetServingStatus(rlqsv3.RateLimitQuotaService_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(g, h)
	return h
}

// Drain ends every CheckStream: each answers the messages it has read (waiting at most MaxWait
// for refills), then ends with UNAVAILABLE, so a gateway reconnects elsewhere while the gRPC
// server's GracefulStop waits only for unary calls. Call it when shutting down, after the health
// server says NOT_SERVING. New streams end at once.
func (s *Server) Drain() {
	s.drainOnce.Do(func() { close(s.draining) })
}

// The entry points of a check, as audit events name them.
const (
	apiCheck  = "check"
	apiBatch  = "batch"
	apiStream = "stream"
	apiEnvoy  = "envoy"
)

// slot is one check on its way through the check path.
type slot struct {
	q        Query
	key      string // idempotency key; "" for none
	brief    bool   // an allow is answered without its RateLimit fields (CheckRequest.brief)
	v        Verdict
	err      error
	state    slotState
	ik       idemKey     // with key: the bucket and idempotency key
	rec      *idemRecord // with key: the record this check leads or follows
	leader   bool        // this check decides rec
	replayed bool        // answered with rec's decision
	// uncharged: another descriptor of the same Envoy request refused, so this one was answered
	// without being charged (decideTogether); it is not a decision of its own.
	uncharged bool
}

type slotState uint8

const (
	slotDone  slotState = iota
	slotLease           // waits for a refill (v.Ticket)
	slotFirst           // waits for the first check of its idempotency key (rec.done)
)

// decide runs the check path over slots: start each without blocking, settle those that wait
// (one wait bound for all), then count and audit each.
func (s *Server) decide(ctx context.Context, api string, slots []slot) {
	now := s.now()
	if s.startAll(now, slots) {
		s.settle(ctx, slots)
	}
	s.recordAll(api, now, slots)
}

// startAll starts every slot and reports whether any waits.
func (s *Server) startAll(now clock.Nanos, slots []slot) (pending bool) {
	for i := range slots {
		s.start(now, &slots[i])
		pending = pending || slots[i].state != slotDone
	}
	return pending
}

// recordAll counts and audits every slot.
func (s *Server) recordAll(api string, now clock.Nanos, slots []slot) {
	for i := range slots {
		s.record(api, now, &slots[i])
	}
}

// start takes the first, non-blocking step of a check: a replay of a remembered decision, a
// decision, or a wait (for a refill, or for the first check of the same idempotency key). A
// check with an idempotency key is resolved once: the same resolution names its bucket and is
// decided.
func (s *Server) start(now clock.Nanos, sl *slot) {
	v := s.lim.view.Load()
	if v.closed.Load() {
		s.resolve(sl, Verdict{}, ErrClosed)
		return
	}
	var res resolved
	if err := s.lim.resolveInto(v, sl.q, &res); err != nil {
		s.resolve(sl, Verdict{}, err)
		return
	}
	if sl.key != "" && s.idem != nil {
		if len(sl.key) > MaxIdempotencyKey {
			s.resolve(sl, Verdict{}, fmt.Errorf("%w: %d bytes, at most %d", ErrInvalidIdempotencyKey, len(sl.key), MaxIdempotencyKey))
			return
		}
		if sl.ik.bucket == "" {
			sl.ik = idemKey{bucket: res.key(sl.q.Tenant), key: sl.key}
		}
		sl.rec, sl.leader = s.idem.begin(now, sl.ik)
		if !sl.leader {
			select {
			case <-sl.rec.done: // decided and remembered (begin finds no other done record)
				sl.v, sl.replayed, sl.state = sl.rec.v, true, slotDone
			default:
				sl.state = slotFirst
			}
			return
		}
	}
	s.await(sl, s.lim.check(now, &res, sl.q.Tenant))
}

// await completes a slot with a verdict, or makes it wait for the verdict's ticket.
func (s *Server) await(sl *slot, v Verdict) {
	if v.Outcome == Wait {
		sl.v, sl.state = v, slotLease
		return
	}
	s.resolve(sl, v, nil)
}

// resolve completes a slot; the leader of an idempotency key publishes its decision at once,
// so a repeat waiting in the same batch sees it.
func (s *Server) resolve(sl *slot, v Verdict, err error) {
	if err == nil && sl.q.Settle && v.Outcome == Allow && v.SettleID == 0 {
		// Allowed without a lease to hold the estimate (lease: off, an emergency answer): the
		// hold still takes the actual cost.
		v.SettleID = s.lim.holdAfter(s.now(), sl.q)
	}
	sl.v, sl.err, sl.state = v, err, slotDone
	if sl.leader {
		s.idem.finish(sl.ik, sl.rec, v, err)
		sl.leader = false
	}
}

// settle waits for the slots that wait, all under one bound: MaxWait from now, and never past
// the caller's deadline less a margin. Past it, a check waiting for a refill gets its rule's
// failure mode, and one waiting for the first check of its idempotency key gets
// ErrIdempotencyPending. A caller that goes away ends every wait with its context's error.
func (s *Server) settle(ctx context.Context, slots []slot) {
	wait := s.maxWait
	if d, ok := ctx.Deadline(); ok {
		wait = min(wait, time.Until(d)-deadlineMargin)
	}
	expired := wait <= 0
	var timeout <-chan time.Time
	if !expired {
		t := time.NewTimer(wait)
		defer t.Stop()
		timeout = t.C
	}
	for i := range slots {
		sl := &slots[i]
		for !expired && sl.state != slotDone {
			var ready <-chan struct{}
			if sl.state == slotLease {
				ready = sl.v.Ticket.Ready()
			} else {
				ready = sl.rec.done
			}
			select {
			case <-ready:
				s.proceed(sl)
			case <-timeout:
				expired = true
			case <-ctx.Done():
				if !errors.Is(ctx.Err(), context.DeadlineExceeded) {
					s.abandon(slots[i:], ctx.Err())
					return
				}
				// The deadline came with the timer (its margin was eaten by scheduling): answer.
				expired = true
			}
		}
		switch sl.state {
		case slotLease:
			s.metrics.fallback()
			s.resolve(sl, s.lim.Fallback(s.now(), sl.v.Ticket), nil)
		case slotFirst:
			s.resolve(sl, Verdict{}, ErrIdempotencyPending)
		}
	}
}

// abandon ends the waits of slots whose answer nobody will read (the caller went away): a
// ticket leaves its key's queue, so a grant that comes later serves the checks still waiting or
// becomes the lease instead of being spent on these; every slot not decided resolves with err
// (the followers of its idempotency key get it).
func (s *Server) abandon(slots []slot, err error) {
	now := s.now()
	for i := range slots {
		if slots[i].state == slotLease {
			s.lim.Fallback(now, slots[i].v.Ticket)
		}
		if slots[i].state != slotDone {
			s.resolve(&slots[i], Verdict{}, err)
		}
	}
}

// proceed takes the next step of a slot whose wait ended.
func (s *Server) proceed(sl *slot) {
	if sl.state == slotLease {
		v := sl.v.Ticket.Verdict()
		if v.Outcome != Wait {
			s.resolve(sl, v, nil)
			return
		}
		// Its key was retired while it waited: check again against the current view.
		v, err := s.lim.Check(s.now(), sl.q)
		if err != nil {
			s.resolve(sl, v, err)
			return
		}
		s.await(sl, v)
		return
	}
	if sl.rec.ok {
		sl.v, sl.replayed, sl.state = sl.rec.v, true, slotDone
		return
	}
	// The first check was not an allow (or failed): nothing is remembered, decide this one.
	sl.rec = nil
	s.start(s.now(), sl)
}

// record counts a finished check and audits it.
func (s *Server) record(api string, now clock.Nanos, sl *slot) {
	if sl.uncharged {
		return
	}
	if sl.err != nil {
		s.metrics.invalid(sl.err)
		return
	}
	if sl.replayed {
		s.metrics.replay()
	} else {
		s.metrics.decision(sl.v)
	}
	s.auditVerdict(api, now, sl)
}

// Check implements AgentService.Check.
func (s *Server) Check(ctx context.Context, req *agentv1.CheckRequest) (*agentv1.CheckResponse, error) {
	sl := [1]slot{{q: Query{Tenant: req.Tenant, Path: req.Route, Operation: req.Operation, Cost: req.Cost, Settle: req.Settle}, key: req.IdempotencyKey,
		brief: req.Brief}}
	s.decide(ctx, apiCheck, sl[:])
	if sl[0].err != nil {
		return nil, s.statusError(sl[0].err)
	}
	resp := &agentv1.CheckResponse{}
	fillResponse(resp, sl[0].v, sl[0].brief)
	resp.Replayed = sl[0].replayed
	return resp, nil
}

// Settle implements AgentService.Settle.
// It answers once the debt (what no lease held) was debited, or after the wait bound with
// pending set: the debt goes on with the key's calls.
func (s *Server) Settle(ctx context.Context, req *agentv1.SettleRequest) (*agentv1.SettleResponse, error) {
	r, err := s.lim.Settle(s.now(), req.SettleId, req.Cost)
	switch {
	case errors.Is(err, ErrUnknownSettle):
		return nil, status.Error(codes.NotFound, err.Error())
	case err != nil:
		return nil, s.statusError(err)
	}
	wait, cancel := context.WithTimeout(ctx, s.maxWait)
	defer cancel()
	ok := r.Debited(wait)
	resp := &agentv1.SettleResponse{
		Charged:  int64(r.Charged / bucket.PerToken),
		Credited: int64(r.Credited / bucket.PerToken),
		Debt:     int64((r.Debt + bucket.PerToken - 1) / bucket.PerToken),
		Pending:  !ok,
	}
	if ok {
		resp.Forgiven = int64((r.Forgiven + bucket.PerToken - 1) / bucket.PerToken)
	}
	return resp, nil
}

// statusError maps a Decide error to the status a client sees.
func (s *Server) statusError(err error) error {
	switch {
	case invalidCheck(err):
		return status.Error(codes.InvalidArgument, err.Error())
	case errors.Is(err, ErrIdempotencyPending):
		return status.Error(codes.Aborted, err.Error())
	case errors.Is(err, ErrClosed):
		return status.Error(codes.Unavailable, "agent: shutting down")
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return status.FromContextError(err).Err()
	}
	s.log.Error("check failed", zap.Error(err))
	return status.Error(codes.Internal, "agent: internal error")
}

// invalidCheck reports whether err is a malformed check (INVALID_ARGUMENT, nothing charged).
func invalidCheck(err error) bool {
	return errors.Is(err, ErrInvalidTenant) || errors.Is(err, ErrInvalidRoute) ||
		errors.Is(err, ErrInvalidCost) || errors.Is(err, ErrInvalidIdempotencyKey)
}

// fillResponse writes a verdict in the API's units (answerOf).
func fillResponse(resp *agentv1.CheckResponse, v Verdict, brief bool) {
	a := answerOf(v, brief)
	resp.Decision, resp.Degraded, resp.RetryAfterMs = a.decision, a.degraded, a.retryAfterMs
	resp.Remaining, resp.Limit, resp.WindowMs, resp.ResetMs = a.remaining, a.limit, a.windowMs, a.resetMs
	resp.Rule, resp.ShadowDeny, resp.SettleId = a.rule, a.shadowDeny, a.settleID
}

// answer is a verdict as a CheckResponse carries it (without replayed, which is the slot's).
type answer struct {
	decision                                          agentv1.Decision
	degraded, shadowDeny                              bool
	retryAfterMs, remaining, limit, windowMs, resetMs int64
	rule                                              string
	settleID                                          uint64
}

// answerOf is a verdict in the API's units: whole tokens (rounded down), milliseconds
// (Retry-After rounded up, so a client that waits that long is not denied again for the rounding).
// With brief, an allow has no RateLimit fields (remaining, limit, window, reset): its caller
// reads none of them, and they are neither worked out nor sent.
func answerOf(v Verdict, brief bool) answer {
	var a answer
	switch v.Outcome {
	case Allow:
		a.decision = agentv1.Decision_DECISION_ALLOW
	case Deny:
		a.decision = agentv1.Decision_DECISION_DENY
	case Unavailable:
		a.decision = agentv1.Decision_DECISION_UNAVAILABLE
	}
	a.degraded = v.Degraded
	a.settleID = v.SettleID
	a.shadowDeny = v.ShadowDeny
	if v.Outcome == Deny || v.Outcome == Unavailable {
		a.retryAfterMs = max(1, int64((v.RetryAfter+time.Millisecond-1)/time.Millisecond))
	}
	if v.Rule != nil {
		a.rule = v.Rule.Name
	}
	if v.Limits == nil || (brief && v.Outcome == Allow) {
		return a
	}
	rem := min(max(v.Remaining, 0), v.Limits.Bucket.Capacity())
	a.remaining = int64(rem / bucket.PerToken)
	a.limit = v.Limits.Requests
	now := wallFor(v.Limits)
	a.windowMs = window(v.Limits, now).Milliseconds()
	a.resetMs = resetMs(v.Limits, rem, now)
	return a
}

// resetMs is how long the bucket of l takes from level to full at its rate, rounded up; 0 if it
// is full or never refills. A calendar quota is full again when its period ends (now's period, on
// this host's clock).
func resetMs(l *policy.Limits, level bucket.Micro, now time.Time) int64 {
	if l.Calendar != nil {
		if level >= l.Bucket.Capacity() {
			return 0
		}
		return max(0, int64(l.Calendar.Window(now).End)-now.UnixMilli())
	}
	d, ok := bucket.State{Tokens: level}.TimeToFull(l.Bucket)
	if !ok {
		return 0
	}
	return int64(d)
}

// wallFor is the wall clock when l is a calendar quota (its reset and window depend on it), and
// the zero time otherwise: a token bucket's answers need no clock reading.
func wallFor(l *policy.Limits) time.Time {
	if l.Calendar != nil {
		return time.Now()
	}
	return time.Time{}
}

// window is the period the limit's requests are counted over: the refill period of a token
// bucket; for a calendar quota the length of now's period (a day of a daylight-saving change or
// a month varies).
func window(l *policy.Limits, now time.Time) time.Duration {
	if l.Calendar != nil {
		w := l.Calendar.Window(now)
		return time.Duration(w.End-w.Start) * time.Millisecond
	}
	return l.Period
}
