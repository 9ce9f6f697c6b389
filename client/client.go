// Package client is the Go client of the leasebucket agent: it asks the node's agent "may this
// tenant do this operation on this route now?" over the agent's Unix socket.
//
// A Client holds one gRPC connection, shared by every goroutine that checks. Checks travel in one
// of two ways:
//
//   - CheckStream batches (the default). A background sender coalesces concurrent Check calls
//     into batches of at most MaxBatch checks on one long-lived stream: whatever is queued when
//     the sender is free goes out at once and, under load (batches in flight), the sender
//     lingers up to Linger for more. At one check at a time a batch is a single check, sent at
//     once. Batches are sent with partial: each check is answered when the agent decides it,
//     not when the slowest check of its batch is decided.
//   - Unary Check calls, one per check: when the agent does not serve CheckStream (it answers
//     UNIMPLEMENTED; the stream is probed again every StreamReprobe), while a broken stream is
//     being reopened, and always with Options.Unary.
//
// A check that was in flight on a stream that broke is sent once more as a unary Check: it is
// never lost, but it may be charged twice (unless it carries an idempotency key).
//
// While the agent is unreachable checks fail fast (the caller applies the route's failure mode),
// and a check retries the connection when the last retry is at least 50 ms old: an agent that
// starts after the client, or restarts, decides the next check once its socket answers.
//
// A decision is never an error: DENY and UNAVAILABLE are Results. Check's errors are
// *UnreachableError (no decision could be had from the agent: no socket, no answer by the
// deadline, the agent shutting down), *InvalidError (the agent rejected the check as malformed),
// ErrIdempotencyPending (a repeat of an idempotency key whose first check is still being
// decided) and the caller's own context.Canceled.
package client

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/internal/checkwire"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

// DefaultSocket is the agent's default Unix socket (the agent's --socket default).
const DefaultSocket = "/run/leasebucket/agent.sock"

const (
	// DefaultTimeout bounds a check whose context has no earlier deadline. The agent answers a
	// check within its --max-wait (50 ms by default) even when it has to fall back to a rule's
	// failure mode, so a second means the agent is not answering at all.
	DefaultTimeout = time.Second

	// DefaultMaxBatch is the most checks in one CheckStream message. 128 checks are a few
	// kilobytes: big enough that batching pays for itself under load, small enough that one
	// batch never holds up the checks behind it for long.
	DefaultMaxBatch = 128

	// DefaultLinger is how long the sender waits for more checks under load: long enough for the
	// goroutines that are already running to add their checks, short next to a check's round
	// trip on the socket (tens of microseconds).
	DefaultLinger = 50 * time.Microsecond

	// DefaultStreamReprobe is how long the client uses unary checks after the agent answered
	// CheckStream with UNIMPLEMENTED, before it tries the stream again (an agent upgraded in
	// place is picked up without restarting the gateway).
	DefaultStreamReprobe = 30 * time.Second

	// reconnectMax caps gRPC's reconnect backoff (120 s by default): an agent restarting on the
	// node is back within seconds, and so should the gateway's connection be.
	reconnectMax = time.Second
)

// Options configures a Client. The zero value dials DefaultSocket with the defaults above.
type Options struct {
	// Socket is the agent's Unix socket; DefaultSocket if empty.
	Socket string
	// Target is a gRPC target used instead of Socket, such as "dns:///127.0.0.1:7074" for an
	// agent's TCP listener.
	Target string
	// DialOptions are added to the client's own (plaintext transport, reconnect backoff).
	DialOptions []grpc.DialOption
	// Timeout bounds a check whose context has no earlier deadline; DefaultTimeout if zero.
	Timeout time.Duration
	// Unary disables CheckStream: every check is a unary Check call.
	Unary bool
	// MaxBatch is the most checks per stream batch; DefaultMaxBatch if zero.
	MaxBatch int
	// Linger is how long a forming batch waits for more checks under load; DefaultLinger if
	// zero, none if negative.
	Linger time.Duration
	// StreamReprobe is how long the client stays unary after the agent answered the stream with
	// UNIMPLEMENTED; DefaultStreamReprobe if zero.
	StreamReprobe time.Duration
	Logger        *zap.Logger
}

// Decision is the agent's answer to a check.
type Decision uint8

const (
	// Allow means go ahead: call upstream.
	Allow Decision = iota + 1
	// Deny means over the limit (HTTP 429 with Retry-After).
	Deny
	// Unavailable means the global state is unreachable and the rule fails closed (HTTP 503
	// with Retry-After).
	Unavailable
)

func (d Decision) String() string {
	switch d {
	case Allow:
		return "allow"
	case Deny:
		return "deny"
	case Unavailable:
		return "unavailable"
	}
	return "unknown"
}

// Request is one check.
type Request struct {
	// Tenant is the authenticated principal. Never a raw IP or an unverified client header.
	Tenant string
	// Route is the request path as received (the agent normalizes it and matches the policy's
	// templates); a query is ignored.
	Route string
	// Operation is an HTTP method, a named operation or an operation class.
	Operation string
	// Cost in tokens; 0 means the rule's cost.
	Cost int64
	// IdempotencyKey, if set, makes a repeat of the same key on the same bucket within the
	// agent's window get the first decision without being charged again.
	IdempotencyKey string
	// Settle: Cost is an estimate; an allowed check's Result.SettleID is then passed to Settle
	// with the actual cost once the response is done.
	Settle bool
	// Brief: the caller reads none of Result's RateLimit fields (Remaining, Limit, Window,
	// Reset) of an allow, for a response that carries no RateLimit headers: an allowed check's
	// Result has them zero, and its answer is smaller and cheaper for both ends. A denied or
	// unavailable check's Result is complete.
	Brief bool
}

// Result is a decision with what the agent knows about the bucket that made it.
type Result struct {
	Decision Decision
	// Degraded: allowed (or denied) by the agent's local emergency bucket while the global state
	// is unreachable.
	Degraded bool
	// RetryAfter is, for Deny and Unavailable, how long until a retry can succeed (at least 1 ms).
	RetryAfter time.Duration
	// Remaining is the tokens left as the agent sees them, rounded down.
	Remaining int64
	// Limit requests per Window: the effective rule of the tenant (after overrides).
	Limit  int64
	Window time.Duration
	// Reset is how long until the bucket would be full again at the rule's rate.
	Reset time.Duration
	// Rule is the name of the policy rule that decided.
	Rule string
	// ShadowDeny: the rule is in shadow mode and would have denied; Decision is Allow.
	ShadowDeny bool
	// Replayed: an idempotent repeat answered with the first decision, not charged again.
	Replayed bool
	// SettleID names an allowed check of a Request with Settle, for Settle; 0 otherwise.
	SettleID uint64
}

// UnreachableError means no decision could be had from the agent: the socket is missing or
// refuses connections, the agent did not answer by the check's deadline, it is shutting down, or
// it failed the call. The caller applies the route's failure mode.
type UnreachableError struct {
	Target string // the socket or target dialed
	Err    error  // the cause: a gRPC status error, or context.DeadlineExceeded
}

func (e *UnreachableError) Error() string {
	return fmt.Sprintf("client: agent %s unreachable: %v", e.Target, e.Err)
}

func (e *UnreachableError) Unwrap() error { return e.Err }

// InvalidError means the agent rejected the check as malformed (an invalid tenant, a path that
// cannot be normalized safely, a cost above the rule's burst). Nothing was charged.
type InvalidError struct {
	Msg string // the agent's explanation
}

func (e *InvalidError) Error() string { return "client: invalid check: " + e.Msg }

// ErrIdempotencyPending means a check with the same idempotency key on the same bucket is still
// being decided (a concurrent repeat). Nothing was charged for this one; retry it shortly.
var ErrIdempotencyPending = errors.New("client: a check with the same idempotency key is still being decided")

// pendingText identifies ErrIdempotencyPending among a stream batch's per-check errors, which
// carry the agent's error text only (on unary calls it is the status code ABORTED).
const pendingText = "same idempotency key is still being decided"

// Stats count how checks travelled; they tell whether the stream is in use.
type Stats struct {
	StreamChecks  uint64 // checks answered on the stream
	StreamBatches uint64 // batches sent on the stream
	UnaryChecks   uint64 // unary Check calls (including retries of checks a broken stream lost)
	StreamErrors  uint64 // streams that failed or were refused
}

// Client checks with the agent. It is safe for concurrent use; create one per process and Close
// it when done.
type Client struct {
	target  string
	conn    *grpc.ClientConn
	api     agentv1.AgentServiceClient
	timeout time.Duration
	log     *zap.Logger
	st      *streamer // nil when Unary
	rd      *redialer
	health  healthpb.HealthClient

	unary atomic.Uint64
}

// New dials the agent. The connection is made in the background and re-established when it
// breaks (at most reconnectMax apart, and at once when a check arrives while the agent is
// unreachable: see Check); New fails only for unusable options.
func New(opts Options) (*Client, error) {
	target := opts.Target
	if target == "" {
		sock := opts.Socket
		if sock == "" {
			sock = DefaultSocket
		}
		target = "unix:" + sock // "unix:relative/path" and "unix:/absolute/path" both work
	}
	if opts.Timeout <= 0 {
		opts.Timeout = DefaultTimeout
	}
	if opts.MaxBatch <= 0 {
		opts.MaxBatch = DefaultMaxBatch
	}
	if opts.Linger == 0 {
		opts.Linger = DefaultLinger
	}
	if opts.StreamReprobe <= 0 {
		opts.StreamReprobe = DefaultStreamReprobe
	}
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	bo := backoff.DefaultConfig
	bo.MaxDelay = reconnectMax
	dial := append([]grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: bo, MinConnectTimeout: time.Second}),
	}, opts.DialOptions...)
	conn, err := grpc.NewClient(target, dial...)
	if err != nil {
		return nil, fmt.Errorf("client: dial %s: %w", target, err)
	}
	conn.Connect()
	c := &Client{target: target, conn: conn, api: agentv1.NewAgentServiceClient(conn), timeout: opts.Timeout, log: opts.Logger,
		rd: newRedialer(conn, target), health: healthpb.NewHealthClient(conn)}
	if !opts.Unary {
		c.st = newStreamer(c, opts)
	}
	return c, nil
}

// Close stops the stream's goroutines and closes the connection. Checks in flight fail with an
// *UnreachableError.
func (c *Client) Close() error {
	if c.st != nil {
		c.st.close()
	}
	return c.conn.Close()
}

// Stats returns the client's counters.
func (c *Client) Stats() Stats {
	s := Stats{UnaryChecks: c.unary.Load()}
	if c.st != nil {
		s.StreamChecks = c.st.checks.Load()
		s.StreamBatches = c.st.batches.Load()
		s.StreamErrors = c.st.failures.Load()
	}
	return s
}

// Check asks the agent to decide req. It returns by ctx's deadline (or Timeout, if earlier).
//
// While the agent is unreachable a check fails fast, but first retries the connection if the
// last retry is at least 50 ms old: when the agent's socket answers, that check waits for the
// connection and is decided by the agent. An agent that starts after the client, or restarts,
// is used by the next check, not after gRPC's reconnect backoff.
func (c *Client) Check(ctx context.Context, req Request) (Result, error) {
	if err := validUTF8(req); err != nil {
		return Result{}, err
	}
	deadline := time.Now().Add(c.timeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	if c.st != nil && !c.rd.down.Load() {
		// On the stream, without a context of its own: the deadline is a pooled timer's.
		a, err := c.st.check(ctx, deadline, checkwire.Check(req))
		if !errors.Is(err, errNoStream) {
			res := Result{}
			if err == nil {
				res, err = c.result(a.res, a.errMsg)
			} else {
				err = c.callError(ctx, err)
			}
			c.observe(err)
			return res, err
		}
		// No usable stream, or the stream broke before answering: ask unary, by the same deadline.
	}
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	if c.rd.down.Load() {
		c.rd.await(ctx)
	}
	res, err := c.unaryCheck(ctx, req)
	c.observe(err)
	return res, err
}

// Settled is what Settle charged, in tokens.
type Settled struct {
	Charged  int64 // beyond the estimate: spent from the agent's leases or sent as debt
	Credited int64 // the estimate's unused part, given back
	Debt     int64 // of Charged, what no lease held: debited from the global bucket
	// Forgiven is, of Debt, what the global bucket did not debit: it was at the rule's max_debt
	// below zero (rounded up; the most of any bucket the check charged).
	Forgiven int64
	// Pending: the agent did not see the debt debited within its wait bound; it goes on with
	// the key's calls, and Forgiven is not known.
	Pending bool
}

// ErrUnknownSettle is returned by Settle when the agent does not hold the id: never given,
// settled already, or past the agent's settle window (the estimate stays charged). Nothing is
// charged twice.
var ErrUnknownSettle = errors.New("client: unknown settle id")

// Settle replaces the estimate of an allowed check (Result.SettleID of a Request with Settle) by
// its actual cost in tokens, once the response is done. Errors: ErrUnknownSettle, an
// *InvalidError for a negative cost or one above the bucket's capacity plus its max_debt (the
// check can be settled again with a valid cost), an *UnreachableError when the agent could not be
// asked (the settle may be retried with the same id: it is applied at most once).
func (c *Client) Settle(ctx context.Context, id uint64, cost int64) (Settled, error) {
	ctx, cancel := c.bound(ctx)
	defer cancel()
	if c.rd.down.Load() {
		c.rd.await(ctx)
	}
	resp, err := c.api.Settle(ctx, &agentv1.SettleRequest{SettleId: id, Cost: cost})
	if status.Code(err) == codes.NotFound {
		c.observe(nil)
		return Settled{}, fmt.Errorf("%w: %s", ErrUnknownSettle, status.Convert(err).Message())
	}
	if err != nil {
		err = c.callError(ctx, err)
		c.observe(err)
		return Settled{}, err
	}
	c.observe(nil)
	return Settled{Charged: resp.Charged, Credited: resp.Credited, Debt: resp.Debt, Forgiven: resp.Forgiven, Pending: resp.Pending}, nil
}

// Ready reports whether the agent answers and serves checks: nil when its health service
// (grpc.health.v1) says the AgentService is SERVING, or when the agent has no health service;
// an *UnreachableError when it is unreachable, does not answer by the deadline or is not
// serving (shutting down); or the caller's context.Canceled. Like Check, it retries the
// connection of an unreachable agent first. It returns by ctx's deadline (or Timeout, if
// earlier).
func (c *Client) Ready(ctx context.Context) error {
	ctx, cancel := c.bound(ctx)
	defer cancel()
	c.rd.await(ctx)
	resp, err := c.health.Check(ctx, &healthpb.HealthCheckRequest{Service: agentv1.AgentService_ServiceDesc.ServiceName})
	switch {
	case status.Code(err) == codes.Unimplemented:
		err = nil // the agent answered; it just has no health service
	case err != nil:
		if cerr := ctx.Err(); errors.Is(cerr, context.Canceled) {
			return cerr
		}
		err = &UnreachableError{Target: c.target, Err: err}
	case resp.Status != healthpb.HealthCheckResponse_SERVING:
		err = &UnreachableError{Target: c.target, Err: fmt.Errorf("%w (%s)", errNotServing, resp.Status)}
	}
	c.observe(err)
	return err
}

// errNotServing: the agent answers but does not take checks (it is shutting down).
var errNotServing = errors.New("agent not serving")

// bound gives ctx the client's Timeout unless its deadline is earlier.
func (c *Client) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	if d, ok := ctx.Deadline(); ok && time.Until(d) <= c.timeout {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, c.timeout)
}

// observe tells the redialer whether a call found the agent unreachable. A caller's
// cancellation says nothing about the agent.
func (c *Client) observe(err error) {
	if err == nil {
		c.rd.failed(false)
		return
	}
	if errors.Is(err, context.Canceled) {
		return
	}
	var ue *UnreachableError
	c.rd.failed(errors.As(err, &ue))
}

// unaryCheck sends one check in a Check call.
func (c *Client) unaryCheck(ctx context.Context, req Request) (Result, error) {
	c.unary.Add(1)
	resp, err := c.api.Check(ctx, &agentv1.CheckRequest{Tenant: req.Tenant, Route: req.Route, Operation: req.Operation,
		Cost: req.Cost, IdempotencyKey: req.IdempotencyKey, Settle: req.Settle, Brief: req.Brief})
	if err != nil {
		return Result{}, c.callError(ctx, err)
	}
	return c.result(checkwire.Result{Decision: int32(resp.Decision), Degraded: resp.Degraded, RetryAfterMs: resp.RetryAfterMs,
		Remaining: resp.Remaining, Limit: resp.Limit, WindowMs: resp.WindowMs, ResetMs: resp.ResetMs, Rule: resp.Rule,
		ShadowDeny: resp.ShadowDeny, Replayed: resp.Replayed, SettleID: resp.SettleId}, "")
}

// validUTF8 refuses a check with a string that is not UTF-8, which protobuf cannot carry: an
// *InvalidError, as for any check the agent would refuse, without asking it.
func validUTF8(req Request) error {
	for _, f := range []struct{ name, s string }{
		{"tenant", req.Tenant}, {"route", req.Route}, {"operation", req.Operation}, {"idempotency key", req.IdempotencyKey},
	} {
		if !utf8.ValidString(f.s) {
			return &InvalidError{Msg: fmt.Sprintf("the %s %q is not valid UTF-8", f.name, f.s)}
		}
	}
	return nil
}

// errBadAnswer: the agent answered without a decision.
var errBadAnswer = errors.New("answer without a decision")

// result converts the agent's answer; errMsg is a stream batch's per-check error.
func (c *Client) result(resp checkwire.Result, errMsg string) (Result, error) {
	if errMsg != "" {
		if strings.Contains(errMsg, pendingText) {
			return Result{}, ErrIdempotencyPending
		}
		return Result{}, &InvalidError{Msg: errMsg}
	}
	r := Result{
		Degraded:   resp.Degraded,
		RetryAfter: time.Duration(resp.RetryAfterMs) * time.Millisecond,
		Remaining:  resp.Remaining,
		Limit:      resp.Limit,
		Window:     time.Duration(resp.WindowMs) * time.Millisecond,
		Reset:      time.Duration(resp.ResetMs) * time.Millisecond,
		Rule:       resp.Rule,
		ShadowDeny: resp.ShadowDeny,
		Replayed:   resp.Replayed,
		SettleID:   resp.SettleID,
	}
	switch agentv1.Decision(resp.Decision) {
	case agentv1.Decision_DECISION_ALLOW:
		r.Decision = Allow
	case agentv1.Decision_DECISION_DENY:
		r.Decision = Deny
	case agentv1.Decision_DECISION_UNAVAILABLE:
		r.Decision = Unavailable
	default:
		return Result{}, &UnreachableError{Target: c.target, Err: errBadAnswer}
	}
	return r, nil
}

// callError classifies a failed call: the caller's cancellation as is, a malformed check as an
// *InvalidError, a concurrent repeat of an idempotency key (ABORTED) as ErrIdempotencyPending,
// anything else as an *UnreachableError.
func (c *Client) callError(ctx context.Context, err error) error {
	switch cerr := ctx.Err(); {
	case errors.Is(cerr, context.Canceled):
		return cerr
	case errors.Is(cerr, context.DeadlineExceeded):
		return &UnreachableError{Target: c.target, Err: cerr}
	}
	switch status.Code(err) {
	case codes.InvalidArgument:
		return &InvalidError{Msg: status.Convert(err).Message()}
	case codes.Aborted:
		return ErrIdempotencyPending
	case codes.DeadlineExceeded:
		// gRPC's own deadline timer can end the call a moment before ctx reports it.
		return &UnreachableError{Target: c.target, Err: context.DeadlineExceeded}
	}
	return &UnreachableError{Target: c.target, Err: err}
}
