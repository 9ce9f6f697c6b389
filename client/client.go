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
//     once.
//   - Unary Check calls, one per check: when the agent does not serve CheckStream (it answers
//     UNIMPLEMENTED; the stream is probed again every StreamReprobe), while a broken stream is
//     being reopened, and always with Options.Unary.
//
// A check that was in flight on a stream that broke is sent once more as a unary Check: it is
// never lost, but it may be charged twice (unless it carries an idempotency key).
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
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

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

	// maxInflight bounds the batches sent and not yet answered on a stream. When the agent falls
	// behind, the sender stops and callers wait in the queue (bounded too), each until its own
	// deadline: memory stays bounded and a stuck agent turns into timeouts, not a pile-up.
	maxInflight = 64

	// queueLen bounds the checks waiting for the sender.
	queueLen = 4 * DefaultMaxBatch

	// reopenMin and reopenMax bound the wait before a broken stream is reopened (doubling while
	// opens keep failing); meanwhile checks go unary.
	reopenMin = 50 * time.Millisecond
	reopenMax = 2 * time.Second

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

	unary atomic.Uint64
}

// New dials the agent. The connection is made in the background and re-established when it
// breaks (at most reconnectMax apart); New fails only for unusable options.
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
	c := &Client{target: target, conn: conn, api: agentv1.NewAgentServiceClient(conn), timeout: opts.Timeout, log: opts.Logger}
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
func (c *Client) Check(ctx context.Context, req Request) (Result, error) {
	if d, ok := ctx.Deadline(); !ok || time.Until(d) > c.timeout {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.timeout)
		defer cancel()
	}
	pb := &agentv1.CheckRequest{Tenant: req.Tenant, Route: req.Route, Operation: req.Operation,
		Cost: req.Cost, IdempotencyKey: req.IdempotencyKey}
	if c.st != nil {
		resp, errMsg, err := c.st.check(ctx, pb)
		switch {
		case err == nil:
			return c.result(resp, errMsg)
		case !errors.Is(err, errNoStream):
			return Result{}, c.callError(ctx, err)
		}
		// No usable stream, or the stream broke before answering: ask once more, unary.
	}
	c.unary.Add(1)
	resp, err := c.api.Check(ctx, pb)
	if err != nil {
		return Result{}, c.callError(ctx, err)
	}
	return c.result(resp, "")
}

// errBadAnswer: the agent answered without a decision.
var errBadAnswer = errors.New("answer without a decision")

// result converts the agent's answer; errMsg is a stream batch's per-check error.
func (c *Client) result(resp *agentv1.CheckResponse, errMsg string) (Result, error) {
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
	}
	switch resp.Decision {
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

// streamer coalesces checks into CheckStream batches. One sender goroutine forms and sends
// batches; one receiver goroutine per open stream delivers the answers.
type streamer struct {
	c        *Client
	maxBatch int
	linger   time.Duration
	reprobe  time.Duration
	log      *zap.Logger

	queue chan *pending
	slots chan struct{} // one token per batch in flight, across streams

	ctx    context.Context // ends at close
	cancel context.CancelFunc
	wg     sync.WaitGroup

	// retryAt (Unix nanoseconds) is when a stream may be opened again; until then checks go
	// unary. Atomic, with closed: every check reads them.
	retryAt atomic.Int64
	closed  atomic.Bool

	mu      sync.Mutex
	cur     *stream // the open stream, or nil
	backoff time.Duration

	checks, batches, failures atomic.Uint64
}

// pending is one check waiting for its answer.
type pending struct {
	ctx  context.Context
	req  *agentv1.CheckRequest
	done chan answer // buffered: the deliverer never blocks on a caller that gave up
}

type answer struct {
	resp   *agentv1.CheckResponse
	errMsg string
	err    error
}

// errNoStream: the check was not answered on a stream (none usable, or it broke): send it unary.
var errNoStream = errors.New("client: no stream")

// errClosed: the Client was closed.
var errClosed = errors.New("client: closed")

// stream is one open CheckStream and the batches sent on it and not yet answered.
type stream struct {
	s        agentv1.AgentService_CheckStreamClient
	cancel   context.CancelFunc
	nextID   uint64
	inflight map[uint64][]*pending // guarded by streamer.mu
	dead     bool                  // guarded by streamer.mu
}

func newStreamer(c *Client, opts Options) *streamer {
	ctx, cancel := context.WithCancel(context.Background())
	st := &streamer{
		c: c, maxBatch: opts.MaxBatch, linger: max(opts.Linger, 0), reprobe: opts.StreamReprobe, log: opts.Logger,
		queue: make(chan *pending, queueLen), slots: make(chan struct{}, maxInflight),
		ctx: ctx, cancel: cancel, backoff: reopenMin,
	}
	st.wg.Add(1)
	go st.send()
	return st
}

func (st *streamer) close() {
	st.closed.Store(true)
	st.cancel()
	st.wg.Wait()
	// The sender is gone: fail whatever is still queued.
	for {
		select {
		case p := <-st.queue:
			p.done <- answer{err: errClosed}
		default:
			return
		}
	}
}

// usable reports whether checks should go to the stream now. (An open stream implies retryAt
// has passed: a stream is opened only then, and a failure closes it before moving retryAt.)
func (st *streamer) usable() bool {
	return !st.closed.Load() && time.Now().UnixNano() >= st.retryAt.Load()
}

// check queues req for the stream and waits for its answer. errNoStream means: send it unary.
func (st *streamer) check(ctx context.Context, req *agentv1.CheckRequest) (*agentv1.CheckResponse, string, error) {
	if !st.usable() {
		return nil, "", errNoStream
	}
	p := &pending{ctx: ctx, req: req, done: make(chan answer, 1)}
	select {
	case st.queue <- p:
	case <-ctx.Done():
		return nil, "", ctx.Err()
	case <-st.ctx.Done():
		return nil, "", errClosed
	}
	select {
	case a := <-p.done:
		if a.err == nil {
			st.checks.Add(1)
		}
		return a.resp, a.errMsg, a.err
	case <-ctx.Done():
		return nil, "", ctx.Err()
	case <-st.ctx.Done():
		return nil, "", errClosed
	}
}

// send is the sender goroutine: it forms batches from the queue and sends them.
func (st *streamer) send() {
	defer st.wg.Done()
	defer st.shutdown()
	batch := make([]*pending, 0, st.maxBatch)
	for {
		select {
		case p := <-st.queue:
			batch = append(batch[:0], p)
		case <-st.ctx.Done():
			return
		}
		batch = st.fill(batch)
		// Wait for a slot before choosing the stream: the batch goes to whatever is open then.
		select {
		case st.slots <- struct{}{}:
		case <-st.ctx.Done():
			for _, p := range batch {
				p.done <- answer{err: errClosed}
			}
			return
		}
		live := batch[:0]
		for _, p := range batch {
			if p.ctx.Err() == nil { // its caller gave up: do not charge it
				live = append(live, p)
			}
		}
		if len(live) == 0 {
			<-st.slots
			continue
		}
		s := st.open()
		if s == nil {
			<-st.slots
			for _, p := range live {
				p.done <- answer{err: errNoStream}
			}
			continue
		}
		st.sendBatch(s, live)
		batch = make([]*pending, 0, st.maxBatch) // the stream owns the sent slice now
	}
}

// fill adds queued checks to batch: at once whatever is there and then, under load (the batch
// already has company, or batches are in flight), whatever arrives within the linger. The
// linger yields the processor rather than sleeping (Go's timers cannot sleep for less than about
// a millisecond on an idle processor, twenty times the linger), and ends early when a yield
// brought no new check: then nobody is about to add one.
func (st *streamer) fill(batch []*pending) []*pending {
	drain := func() (added int, full bool) {
		for len(batch) < st.maxBatch {
			select {
			case p := <-st.queue:
				batch = append(batch, p)
				added++
			default:
				return added, false
			}
		}
		return added, true
	}
	if _, full := drain(); full || st.linger <= 0 || (len(batch) < 2 && len(st.slots) == 0) {
		return batch
	}
	for start := time.Now(); time.Since(start) < st.linger; {
		runtime.Gosched()
		if added, full := drain(); full || added == 0 {
			break
		}
	}
	return batch
}

// open returns the open stream, opening one if allowed; nil if there is none to use now (the
// batch then goes unary). A stream is opened only on a ready connection: opening one on a
// connection still connecting would block the sender, and every batch behind it.
func (st *streamer) open() *stream {
	st.mu.Lock()
	if st.cur != nil || st.closed.Load() || time.Now().UnixNano() < st.retryAt.Load() {
		s := st.cur
		st.mu.Unlock()
		return s
	}
	st.mu.Unlock()
	if !ready(st.c.conn) {
		// Not connected (yet, or any more): this batch goes unary, which waits for the
		// connection or fails fast; the next batch looks again.
		st.c.conn.Connect()
		return nil
	}
	ctx, cancel := context.WithCancel(st.ctx)
	cs, err := st.c.api.CheckStream(ctx)
	if err != nil {
		cancel()
		st.failures.Add(1)
		st.log.Warn("agent stream: open failed; checking unary", zap.String("agent", st.c.target), zap.Error(err))
		st.failedOpen(status.Code(err) == codes.Unimplemented)
		return nil
	}
	s := &stream{s: cs, cancel: cancel, inflight: make(map[uint64][]*pending)}
	st.mu.Lock()
	st.cur = s
	st.mu.Unlock()
	st.wg.Add(1)
	go st.receive(s)
	return s
}

// ready reports whether conn has a transport: a stream opened now does not wait.
func ready(conn *grpc.ClientConn) bool { return conn.GetState() == connectivity.Ready }

// failedOpen sets when the next stream may be opened.
func (st *streamer) failedOpen(unimplemented bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if unimplemented {
		st.retryAt.Store(time.Now().Add(st.reprobe).UnixNano())
		return
	}
	st.retryAt.Store(time.Now().Add(st.backoff).UnixNano())
	st.backoff = min(2*st.backoff, reopenMax)
}

// sendBatch registers batch on s and sends it. A failed send leaves the batch to the receiver,
// which fails every batch of the stream when its Recv fails (as it then must).
func (st *streamer) sendBatch(s *stream, batch []*pending) {
	msg := &agentv1.CheckStreamRequest{Checks: make([]*agentv1.CheckRequest, len(batch))}
	for i, p := range batch {
		msg.Checks[i] = p.req
	}
	st.mu.Lock()
	if s.dead {
		st.mu.Unlock()
		<-st.slots
		for _, p := range batch {
			p.done <- answer{err: errNoStream}
		}
		return
	}
	s.nextID++
	msg.Id = s.nextID
	s.inflight[msg.Id] = batch
	st.mu.Unlock()
	st.batches.Add(1)
	if err := s.s.Send(msg); err != nil {
		// The stream is broken; its Recv reports why and fails the batches in flight. Stop
		// using it now.
		st.mu.Lock()
		if st.cur == s {
			st.cur = nil
		}
		st.mu.Unlock()
	}
}

// receive is the receiver goroutine of s: it delivers answers until the stream ends.
func (st *streamer) receive(s *stream) {
	defer st.wg.Done()
	for {
		resp, err := s.s.Recv()
		if err != nil {
			st.streamFailed(s, err)
			return
		}
		st.mu.Lock()
		batch, ok := s.inflight[resp.Id]
		delete(s.inflight, resp.Id)
		st.backoff = reopenMin // the stream works
		st.mu.Unlock()
		if !ok {
			st.log.Warn("agent stream: answer to an unknown batch", zap.Uint64("id", resp.Id))
			continue
		}
		<-st.slots
		deliver(batch, resp, st.c.target)
	}
}

// deliver hands each check of batch its answer.
func deliver(batch []*pending, resp *agentv1.CheckStreamResponse, target string) {
	if len(resp.Results) != len(batch) || (len(resp.Errors) != 0 && len(resp.Errors) != len(batch)) {
		err := &UnreachableError{Target: target, Err: fmt.Errorf("stream answered %d results and %d errors for %d checks",
			len(resp.Results), len(resp.Errors), len(batch))}
		for _, p := range batch {
			p.done <- answer{err: err}
		}
		return
	}
	for i, p := range batch {
		a := answer{resp: resp.Results[i]}
		if len(resp.Errors) != 0 {
			a.errMsg = resp.Errors[i]
		}
		p.done <- a
	}
}

// streamFailed retires s: its batches in flight are sent again unary, and the next stream is
// opened after a backoff, or after StreamReprobe if the agent does not serve CheckStream.
func (st *streamer) streamFailed(s *stream, err error) {
	st.mu.Lock()
	s.dead = true
	batches := s.inflight
	s.inflight = nil
	if st.cur == s {
		st.cur = nil
	}
	newer := st.cur != nil // a send failed first, and the sender already opened another stream
	closed := st.closed.Load()
	st.mu.Unlock()
	s.cancel()
	code := status.Code(err)
	switch {
	case closed:
	case newer:
		st.failures.Add(1)
	case code == codes.Unimplemented:
		st.failures.Add(1)
		st.log.Info("the agent does not serve CheckStream; checking unary",
			zap.String("agent", st.c.target), zap.Duration("reprobe", st.reprobe))
		st.failedOpen(true)
	default:
		st.failures.Add(1)
		st.log.Warn("agent stream broken; checking unary until it is reopened", zap.String("agent", st.c.target), zap.Error(err))
		st.failedOpen(false)
	}
	ans := answer{err: errNoStream}
	if closed {
		ans.err = errClosed
	}
	for _, batch := range batches {
		<-st.slots
		for _, p := range batch {
			p.done <- ans
		}
	}
}

// shutdown ends the open stream when the sender stops (the Client is closing); the receiver then
// fails its batches.
func (st *streamer) shutdown() {
	st.mu.Lock()
	s := st.cur
	st.cur = nil
	st.mu.Unlock()
	if s != nil {
		s.cancel()
	}
}
