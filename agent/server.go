package agent

import (
	"context"
	"errors"
	"math/bits"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
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
}

// Server is the agent's gRPC face: AgentService over the check path. It validates nothing itself
// (the Limiter rejects malformed checks) and maps errors to status codes; every API of the agent
// (Check now; CheckBatch, CheckStream and Envoy's RateLimitService next) decides through Decide.
type Server struct {
	agentv1.UnimplementedAgentServiceServer
	lim     *Limiter
	clk     clock.Clock
	maxWait time.Duration
	metrics *Metrics
	log     *zap.Logger
}

// NewServer returns a Server over cfg.Limiter.
func NewServer(cfg ServerConfig) *Server {
	if cfg.MaxWait <= 0 {
		cfg.MaxWait = DefaultMaxWait
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	return &Server{lim: cfg.Limiter, clk: cfg.Clock, maxWait: cfg.MaxWait, metrics: cfg.Metrics, log: cfg.Logger}
}

// Register registers AgentService and grpc.health.v1 on g and returns the health server, which
// reports SERVING for "" and for AgentService until its Shutdown.
func (s *Server) Register(g *grpc.Server) *health.Server {
	agentv1.RegisterAgentServiceServer(g, s)
	h := health.NewServer()
	h.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	h.SetServingStatus(agentv1.AgentService_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(g, h)
	return h
}

// Decide is the check path. It asks the Limiter at the coarse clock's now; without a usable lease
// it waits for the refill the Limiter queued (at most MaxWait, and never past the caller's
// deadline less a margin) and asks again; past that bound the rule's failure mode answers
// (Limiter.Fallback). Errors are malformed checks (ErrInvalid*), ErrClosed, or context.Canceled
// when the caller went away. Decisions are counted in the metrics.
func (s *Server) Decide(ctx context.Context, q Query) (Verdict, error) {
	v, err := s.decide(ctx, q)
	if err != nil {
		s.metrics.invalid(err)
		return v, err
	}
	s.metrics.decision(v)
	return v, nil
}

func (s *Server) decide(ctx context.Context, q Query) (Verdict, error) {
	v, err := s.lim.Check(s.clk.Now(), q)
	if err != nil || v.Outcome != Wait {
		return v, err
	}
	wait := s.maxWait
	if d, ok := ctx.Deadline(); ok {
		wait = min(wait, time.Until(d)-deadlineMargin)
	}
	if wait <= 0 {
		s.metrics.fallback()
		return s.lim.Fallback(s.clk.Now(), q)
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	for v.Outcome == Wait {
		select {
		case <-v.Ready():
		case <-t.C:
			s.metrics.fallback()
			return s.lim.Fallback(s.clk.Now(), q)
		case <-ctx.Done():
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				// The deadline came with the timer (its margin was eaten by scheduling): answer.
				s.metrics.fallback()
				return s.lim.Fallback(s.clk.Now(), q)
			}
			return Verdict{}, ctx.Err()
		}
		if v, err = s.lim.Check(s.clk.Now(), q); err != nil {
			return v, err
		}
	}
	return v, nil
}

// Check implements AgentService.Check.
func (s *Server) Check(ctx context.Context, req *agentv1.CheckRequest) (*agentv1.CheckResponse, error) {
	v, err := s.Decide(ctx, Query{Tenant: req.Tenant, Path: req.Route, Operation: req.Operation, Cost: req.Cost})
	if err != nil {
		return nil, s.statusError(err)
	}
	resp := &agentv1.CheckResponse{}
	fillResponse(resp, v)
	return resp, nil
}

// statusError maps a Decide error to the status a client sees.
func (s *Server) statusError(err error) error {
	switch {
	case errors.Is(err, ErrInvalidTenant), errors.Is(err, ErrInvalidRoute), errors.Is(err, ErrInvalidCost):
		return status.Error(codes.InvalidArgument, err.Error())
	case errors.Is(err, ErrClosed):
		return status.Error(codes.Unavailable, "agent: shutting down")
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return status.FromContextError(err).Err()
	}
	s.log.Error("check failed", zap.Error(err))
	return status.Error(codes.Internal, "agent: internal error")
}

// fillResponse writes a verdict in the API's units: whole tokens (rounded down), milliseconds
// (Retry-After rounded up, so a client that waits that long is not denied again for the rounding).
func fillResponse(resp *agentv1.CheckResponse, v Verdict) {
	switch v.Outcome {
	case Allow:
		resp.Decision = agentv1.Decision_DECISION_ALLOW
	case Deny:
		resp.Decision = agentv1.Decision_DECISION_DENY
	case Unavailable:
		resp.Decision = agentv1.Decision_DECISION_UNAVAILABLE
	}
	resp.Degraded = v.Degraded
	resp.ShadowDeny = v.ShadowDeny
	if v.Outcome == Deny || v.Outcome == Unavailable {
		resp.RetryAfterMs = max(1, int64((v.RetryAfter+time.Millisecond-1)/time.Millisecond))
	}
	if v.Rule != nil {
		resp.Rule = v.Rule.Name
	}
	if v.Limits == nil {
		return
	}
	lim := v.Limits.Bucket
	rem := min(max(v.Remaining, 0), lim.Capacity())
	resp.Remaining = int64(rem / bucket.PerToken)
	resp.Limit = v.Limits.Requests
	resp.WindowMs = v.Limits.Period.Milliseconds()
	resp.ResetMs = resetMs(lim, rem)
}

// resetMs is how long the bucket of lim takes from level to full at its rate, rounded up; 0 if it
// is full or never refills. The product can pass 2^63, so it is computed in 128 bits.
func resetMs(lim bucket.Limit, level bucket.Micro) int64 {
	num, den := lim.Rate()
	missing := lim.Capacity() - level
	if missing <= 0 || num <= 0 {
		return 0
	}
	hi, lo := bits.Mul64(uint64(missing), uint64(den))
	if hi >= uint64(num) {
		return int64(lim.FillTime())
	}
	q, r := bits.Div64(hi, lo, uint64(num))
	if r > 0 {
		q++
	}
	return int64(min(q, uint64(lim.FillTime())))
}
