package stackbench

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/leasebucket/leasebucket/internal/checkwire"
	"github.com/leasebucket/leasebucket/internal/testkit/envoyquota"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

// API is how the load asks the agent.
type API string

// APIs.
const (
	// Unary: AgentService.Check, one check per call.
	Unary API = "unary"
	// Stream: AgentService.CheckStream. Callers hand their check to one of the connection's
	// streams, whose sender batches them as the Go client package does: what is queued when it
	// is free goes out as one message (at most Load.MaxBatch checks), lingering up to
	// Load.Linger for more under load; at one check in flight a message is one check. Messages
	// are sent with partial, as the client sends them: a check is answered when it is decided.
	Stream API = "stream"
	// Envoy: RateLimitService.ShouldRateLimit, one descriptor (tenant, path, method) per call,
	// as Envoy's HTTP rate limit filter sends with the policy's mapping.
	Envoy API = "rls"
)

// Load is a closed loop: Callers goroutines, each sending one check, waiting for its answer and
// sending the next at once, all over one gRPC connection to the agent's socket (as a gateway
// holds one); against several agents, one connection to each, the callers spread evenly over
// them (caller i on agent i mod n).
type Load struct {
	API      API
	Path     string // the route every check asks for: its mode's (Mode.Path); Quota: unused, Lease's
	Callers  int
	Streams  int           // Stream: streams on the connection, the callers spread evenly over them
	MaxBatch int           // Stream: most checks in one message
	Linger   time.Duration // Stream: longest wait for more checks under load (0: none)
	Envoys   int           // Quota: Envoy-faithful filters, each its own connection, the callers spread evenly over them
	Pause    time.Duration // Quota: each caller's pause after a request (its client's think time; 0: none)
	// Brief (Unary, Stream): checks are sent brief, as the gateway (httplimit) sends them for a
	// rule with RateLimit headers off: an allow is answered without its RateLimit fields.
	Brief bool
}

// Outcome is what a check got.
type Outcome uint8

// Outcomes.
const (
	Allowed     Outcome = iota
	Denied              // 429: over the limit
	Unavailable         // 503: the rule's failure mode (global state not reached in time)
	Failed              // no decision: a gRPC error or a malformed answer
	numOutcomes
)

// Window is what the callers saw while measuring (between Runner.Begin and Runner.End), and in
// Total over the whole run.
type Window struct {
	Wall     time.Duration
	Latency  Hist
	Outcomes [numOutcomes]int64
	Total    [numOutcomes]int64 // every check of the run, warm-up included
	// Messages and MessageChecks are the stream messages sent while measuring and the checks
	// they carried.
	Messages, MessageChecks int64
	Err                     error // the first failure, if any
}

// Checks is the number of checks answered while measuring.
func (w *Window) Checks() int64 {
	var n int64
	for _, c := range w.Outcomes {
		n += c
	}
	return n
}

// caller is one goroutine of the loop and what it saw.
type caller struct {
	hist     Hist
	outcomes [numOutcomes]int64
	total    [numOutcomes]int64
	err      error
	answered atomic.Int64 // every check answered so far, read while the loop runs (Runner.Answered)
}

func (c *caller) record(measuring bool, d time.Duration, o Outcome, err error) {
	c.total[o]++
	c.answered.Add(1)
	if err != nil && c.err == nil {
		c.err = err
	}
	if measuring {
		c.hist.Record(d)
		c.outcomes[o]++
	}
}

// Runner is a running load.
type Runner struct {
	load       Load
	keys       *Keys
	conns      []*grpc.ClientConn // one per socket
	ctx        context.Context
	cancel     context.CancelFunc
	measuring  atomic.Bool
	callers    []*caller
	wg         sync.WaitGroup // callers
	streamWG   sync.WaitGroup // streams' senders and receivers
	streams    []*checkStream
	filters    []*envoyquota.Filter // Quota
	quotaConns []*grpc.ClientConn   // Quota: the filters' connections
	msgs       atomic.Int64
	msgChecks  atomic.Int64
	begin      time.Time
	end        time.Time
}

// Dial connects to the Unix socket; gRPC connects on first use.
func Dial(socket string) (*grpc.ClientConn, error) {
	return grpc.NewClient("unix:"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
}

// StartLoad starts load against sockets (one agent's, or several agents'), drawing keys from
// keys; it runs until Stop.
func StartLoad(sockets []string, keys *Keys, load Load) (*Runner, error) {
	if (load.API != Unary && load.API != Stream && load.API != Envoy && load.API != Quota) || load.Callers < 1 ||
		(load.API != Quota && load.Path == "") || (load.API == Stream && (load.Streams < 1 || load.MaxBatch < 1)) ||
		len(sockets) == 0 || load.Callers < len(sockets) {
		return nil, fmt.Errorf("stackbench: invalid load %+v on %d sockets", load, len(sockets))
	}
	r := &Runner{load: load, keys: keys, callers: make([]*caller, load.Callers)}
	for _, socket := range sockets {
		conn, err := Dial(socket)
		if err != nil {
			r.closeConns()
			return nil, err
		}
		r.conns = append(r.conns, conn)
	}
	r.ctx, r.cancel = context.WithCancel(context.Background())
	if load.API == Stream {
		// Load.Streams on each connection: streams[k*Streams+j] is connection k's j-th.
		for _, conn := range r.conns {
			for range load.Streams {
				st, err := agentv1.NewAgentServiceClient(conn).CheckStream(r.ctx)
				if err != nil {
					r.cancel()
					r.streamWG.Wait()
					r.closeConns()
					return nil, fmt.Errorf("stackbench: open stream: %w", err)
				}
				s := &checkStream{st: st, queue: make(chan *pending, load.Callers), inflight: map[uint64]*message{}, dead: make(chan struct{})}
				r.streams = append(r.streams, s)
				r.streamWG.Go(func() { r.send(s) })
				r.streamWG.Go(func() { r.receive(s) })
			}
		}
	}
	if load.API == Quota {
		if err := r.startQuota(sockets); err != nil {
			r.stopQuota()
			r.cancel()
			r.closeConns()
			return nil, err
		}
	}
	n := len(r.conns)
	for i := range r.callers {
		c := &caller{}
		r.callers[i] = c
		next := keys.Sampler(i)
		conn := r.conns[i%n]
		switch load.API {
		case Quota:
			f := r.filters[i%len(r.filters)]
			r.wg.Go(func() { r.quota(c, f, next) })
		case Unary:
			r.wg.Go(func() { r.unary(c, conn, next) })
		case Stream:
			s := r.streams[i%n*load.Streams+i/n%load.Streams]
			r.wg.Go(func() { r.stream(c, s, next) })
		case Envoy:
			r.wg.Go(func() { r.envoy(c, conn, next) })
		}
	}
	return r, nil
}

// closeConns closes the connections to the sockets.
func (r *Runner) closeConns() {
	for _, conn := range r.conns {
		_ = conn.Close()
	}
}

// Begin starts the measured window.
func (r *Runner) Begin() {
	r.begin = time.Now()
	r.measuring.Store(true)
}

// End ends the measured window.
func (r *Runner) End() {
	r.measuring.Store(false)
	r.end = time.Now()
}

// Answered is the number of checks answered so far, warm-up included; safe while the callers run.
func (r *Runner) Answered() int64 {
	var n int64
	for _, c := range r.callers {
		n += c.answered.Load()
	}
	return n
}

// Stop stops the callers (a check in flight is abandoned, never counted), closes the connection
// and returns what they saw.
func (r *Runner) Stop() Window {
	r.cancel()
	r.wg.Wait()
	r.streamWG.Wait()
	r.stopQuota()
	r.closeConns()
	w := Window{Wall: r.end.Sub(r.begin), Messages: r.msgs.Load(), MessageChecks: r.msgChecks.Load()}
	for _, c := range r.callers {
		w.Latency.Merge(&c.hist)
		for o := range numOutcomes {
			w.Outcomes[o] += c.outcomes[o]
			w.Total[o] += c.total[o]
		}
		if w.Err == nil {
			w.Err = c.err
		}
	}
	return w
}

func (r *Runner) unary(c *caller, conn *grpc.ClientConn, next func() int) {
	client := agentv1.NewAgentServiceClient(conn)
	req := &agentv1.CheckRequest{Route: r.load.Path, Operation: Operation, Brief: r.load.Brief}
	for r.ctx.Err() == nil {
		req.Tenant = r.keys.Tenant(next())
		t0 := time.Now()
		resp, err := client.Check(r.ctx, req)
		d := time.Since(t0)
		if r.ctx.Err() != nil {
			return
		}
		o, err := nativeOutcome(resp.GetDecision(), err)
		c.record(r.measuring.Load(), d, o, err)
	}
}

func nativeOutcome(d agentv1.Decision, err error) (Outcome, error) {
	if err != nil {
		return Failed, err
	}
	switch d {
	case agentv1.Decision_DECISION_ALLOW:
		return Allowed, nil
	case agentv1.Decision_DECISION_DENY:
		return Denied, nil
	case agentv1.Decision_DECISION_UNAVAILABLE:
		return Unavailable, nil
	}
	return Failed, fmt.Errorf("stackbench: decision %v", d)
}

func (r *Runner) envoy(c *caller, conn *grpc.ClientConn, next func() int) {
	client := ratelimitv3.NewRateLimitServiceClient(conn)
	tenant := &commonv3.RateLimitDescriptor_Entry{Key: "tenant"}
	req := &ratelimitv3.RateLimitRequest{Domain: "leasebucket", Descriptors: []*commonv3.RateLimitDescriptor{{
		Entries: []*commonv3.RateLimitDescriptor_Entry{tenant, {Key: "path", Value: r.load.Path}, {Key: "method", Value: Operation}},
	}}}
	for r.ctx.Err() == nil {
		tenant.Value = r.keys.Tenant(next())
		t0 := time.Now()
		resp, err := client.ShouldRateLimit(r.ctx, req)
		d := time.Since(t0)
		if r.ctx.Err() != nil {
			return
		}
		o, err := envoyOutcome(resp, err)
		c.record(r.measuring.Load(), d, o, err)
	}
}

// envoyOutcome maps an RLS answer: OK allows, OVER_LIMIT denies (429), the gRPC error
// UNAVAILABLE is a fail-closed rule whose global state was not reached (503 behind Envoy).
func envoyOutcome(resp *ratelimitv3.RateLimitResponse, err error) (Outcome, error) {
	switch {
	case status.Code(err) == codes.Unavailable:
		return Unavailable, nil
	case err != nil:
		return Failed, err
	case resp.OverallCode == ratelimitv3.RateLimitResponse_OK:
		return Allowed, nil
	case resp.OverallCode == ratelimitv3.RateLimitResponse_OVER_LIMIT:
		return Denied, nil
	}
	return Failed, fmt.Errorf("stackbench: RLS overall code %v", resp.OverallCode)
}

// checkStream is one CheckStream with its sender's queue and the messages awaiting answers.
// Its messages are written and read by checkwire, as the client package's are.
type checkStream struct {
	st       agentv1.AgentService_CheckStreamClient
	queue    chan *pending
	mu       sync.Mutex
	inflight map[uint64]*message // by id; until every check of it is answered
	nextID   uint64              // sender only
	dead     chan struct{}       // closed when the stream failed; err says why
	once     sync.Once
	err      error
}

// message is a message sent with partial, as the client package sends them: the agent answers
// the checks it decides at once first, the others when they are decided. An answered check is
// nil in checks; left counts the others.
type message struct {
	checks []*pending
	left   int
}

// pending is a caller's check on a stream; the caller reuses it for its next check once
// answered.
type pending struct {
	req  checkwire.Check
	done chan answer // capacity 1: the receiver never blocks on a caller
}

type answer struct {
	decision agentv1.Decision
	err      error
}

// inFlight is the number of messages sent and not answered yet.
func (s *checkStream) inFlight() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.inflight)
}

func (s *checkStream) fail(err error) {
	s.once.Do(func() {
		s.err = err
		close(s.dead)
	})
}

func (r *Runner) stream(c *caller, s *checkStream, next func() int) {
	p := &pending{req: checkwire.Check{Route: r.load.Path, Operation: Operation, Brief: r.load.Brief}, done: make(chan answer, 1)}
	for r.ctx.Err() == nil {
		p.req.Tenant = r.keys.Tenant(next())
		t0 := time.Now()
		var a answer
		gone := false
		select {
		case s.queue <- p:
			select {
			case a = <-p.done:
			case <-s.dead:
				a.err, gone = s.err, true
			case <-r.ctx.Done():
				return
			}
		case <-s.dead:
			a.err, gone = s.err, true
		case <-r.ctx.Done():
			return
		}
		d := time.Since(t0)
		if r.ctx.Err() != nil {
			return
		}
		o, err := nativeOutcome(a.decision, a.err)
		c.record(r.measuring.Load(), d, o, err)
		if gone {
			return
		}
	}
}

// send sends the queued checks as messages of at most MaxBatch checks until the run stops.
func (r *Runner) send(s *checkStream) {
	var (
		checks []checkwire.Check
		buf    []byte
		msg    emptypb.Empty
	)
	for {
		var batch []*pending
		select {
		case p := <-s.queue:
			batch = append(make([]*pending, 0, r.load.MaxBatch), p)
		case <-r.ctx.Done():
			return
		case <-s.dead:
			return
		}
		batch = r.fill(s, batch)
		checks = checks[:0]
		for _, p := range batch {
			checks = append(checks, p.req)
		}
		buf = checkwire.AppendRequest(buf[:0], s.nextID, checks, true)
		msg.ProtoReflect().SetUnknown(buf)
		s.mu.Lock()
		s.inflight[s.nextID] = &message{checks: batch, left: len(batch)}
		s.mu.Unlock()
		s.nextID++
		if r.measuring.Load() {
			r.msgs.Add(1)
			r.msgChecks.Add(int64(len(batch)))
		}
		// SendMsg marshals msg (a copy of buf) before it returns.
		if err := s.st.SendMsg(&msg); err != nil {
			s.fail(fmt.Errorf("stackbench: stream send: %w", err))
			return
		}
	}
}

// fill adds queued checks to batch as the client package's sender does: whatever is queued at
// once and then, under load (the batch already has company, or messages are in flight), what
// arrives while the processor is yielded for up to Load.Linger, stopping early when a yield
// brought nothing.
func (r *Runner) fill(s *checkStream, batch []*pending) []*pending {
	drain := func() (added int, full bool) {
		for len(batch) < r.load.MaxBatch {
			select {
			case p := <-s.queue:
				batch = append(batch, p)
				added++
			default:
				return added, false
			}
		}
		return added, true
	}
	if _, full := drain(); full || r.load.Linger <= 0 || (len(batch) < 2 && s.inFlight() == 0) {
		return batch
	}
	for start := time.Now(); time.Since(start) < r.load.Linger; {
		runtime.Gosched()
		if added, full := drain(); full || added == 0 {
			break
		}
	}
	return batch
}

// receive hands each answer to its callers until the stream ends.
func (r *Runner) receive(s *checkStream) {
	var (
		dec  checkwire.Decoder
		resp checkwire.Answer
	)
	for {
		m := new(emptypb.Empty) // the answer, all of it as unknown fields
		if err := s.st.RecvMsg(m); err != nil {
			s.fail(fmt.Errorf("stackbench: stream receive: %w", err))
			return
		}
		if err := dec.Decode(m.ProtoReflect().GetUnknown(), &resp); err != nil {
			s.fail(fmt.Errorf("stackbench: stream answer: %w", err))
			return
		}
		s.mu.Lock()
		ps, err := s.take(&resp)
		s.mu.Unlock()
		if err != nil {
			s.fail(err)
			return
		}
		for i, p := range ps {
			a := answer{decision: agentv1.Decision(resp.Results[i].Decision)}
			if i < len(resp.Errors) && resp.Errors[i] != "" {
				a.err = errors.New(resp.Errors[i])
			}
			p.done <- a
		}
	}
}

// take removes from the message resp answers the checks it answers, in the order of its results
// (all of them when it lists no indexes); an answer that does not line up is an error. The
// caller holds s.mu.
func (s *checkStream) take(resp *checkwire.Answer) ([]*pending, error) {
	m, ok := s.inflight[resp.ID]
	if !ok {
		return nil, fmt.Errorf("stackbench: stream answer to message %d, which is not waiting", resp.ID)
	}
	bad := func() error {
		return fmt.Errorf("stackbench: stream answer %d: %d results, indexes %v, for %d checks of which %d wait",
			resp.ID, len(resp.Results), resp.Indexes, len(m.checks), m.left)
	}
	var ps []*pending
	switch {
	case len(resp.Indexes) == 0:
		if m.left != len(m.checks) || len(resp.Results) != len(m.checks) {
			return nil, bad()
		}
		ps, m.left = m.checks, 0
	case len(resp.Indexes) != len(resp.Results):
		return nil, bad()
	default:
		ps = make([]*pending, len(resp.Indexes))
		for k, i := range resp.Indexes {
			if int(i) >= len(m.checks) || m.checks[i] == nil {
				return nil, bad()
			}
			ps[k], m.checks[i] = m.checks[i], nil
		}
		m.left -= len(ps)
	}
	if m.left == 0 {
		delete(s.inflight, resp.ID)
	}
	return ps, nil
}

// Warm checks every key of keys once on route path (Keys.Pass order) through each agent of
// sockets, the agents side by side, in CheckBatch calls of warmBatchSize checks from warmWorkers
// goroutines in all: afterwards each agent knows every key, as it would in a process that has run
// for a while, and a key's next check is its steady-state cold check (once the stack is quiet and
// the leases the pass took have expired: Stack.Quiet, Settle). A check answered unavailable (it
// gave up waiting for its refill: the pass outran the stack) is sent again, up to warmTries
// times; denials are fine. It returns the number of checks answered, at least one per key and
// agent, those sent again included (what the agents decided); or an error.
func Warm(ctx context.Context, sockets []string, keys *Keys, path string) (int64, error) {
	var (
		answered atomic.Int64
		errs     = make([]error, len(sockets))
		wg       sync.WaitGroup
	)
	for i, socket := range sockets {
		wg.Go(func() {
			n, err := warmOne(ctx, socket, keys, path, max(1, warmWorkers/len(sockets)))
			answered.Add(n)
			errs[i] = err
		})
	}
	wg.Wait()
	return answered.Load(), errors.Join(errs...)
}

// A warm pass sends CheckBatch calls of warmBatchSize checks from warmWorkers goroutines in all,
// spread over the agents (at least one per agent): 256 checks in flight, about what the stack
// answers within an agent's wait (--max-wait, 50 ms) on two cores, so that few give up.
const warmBatchSize, warmWorkers = 32, 8

// warmTries bounds how often Warm checks a key again whose check was answered unavailable.
const warmTries = 20

// warmBatch sends the checks of req, and again those answered unavailable (a pass that outruns
// the stack has checks give up after the agent's wait), up to warmTries times, 10 ms apart, so
// that the agent took each key to the store once. It returns the checks answered, those sent
// again included: what the agent decided.
func warmBatch(ctx context.Context, client agentv1.AgentServiceClient, req *agentv1.CheckBatchRequest) (int64, error) {
	var answered int64
	for try := 1; ; try++ {
		resp, err := client.CheckBatch(ctx, req)
		if err != nil {
			return answered, err
		}
		for _, e := range resp.Errors {
			if e != "" {
				return answered, errors.New(e)
			}
		}
		answered += int64(len(resp.Results))
		again := req.Checks[:0]
		for i, r := range resp.Results {
			if r.GetDecision() == agentv1.Decision_DECISION_UNAVAILABLE && try < warmTries {
				again = append(again, req.Checks[i])
			}
		}
		if len(again) == 0 {
			return answered, nil
		}
		req.Checks = again
		if err := sleep(ctx, 10*time.Millisecond); err != nil {
			return answered, err
		}
	}
}

// warmOne is Warm's pass through one agent, from workers goroutines.
func warmOne(ctx context.Context, socket string, keys *Keys, path string, workers int) (int64, error) {
	conn, err := Dial(socket)
	if err != nil {
		return 0, err
	}
	defer func() { _ = conn.Close() }()
	client := agentv1.NewAgentServiceClient(conn)
	var answered atomic.Int64
	n := keys.Dist().N
	var (
		cursor atomic.Int64
		mu     sync.Mutex
		first  error
		wg     sync.WaitGroup
	)
	for range workers {
		wg.Go(func() {
			for {
				lo := int(cursor.Add(warmBatchSize)) - warmBatchSize
				if lo >= n || ctx.Err() != nil {
					return
				}
				req := &agentv1.CheckBatchRequest{}
				for j := lo; j < min(lo+warmBatchSize, n); j++ {
					req.Checks = append(req.Checks, &agentv1.CheckRequest{Tenant: keys.Tenant(keys.Pass(j)), Route: path, Operation: Operation})
				}
				got, err := warmBatch(ctx, client, req)
				answered.Add(got)
				if err != nil {
					mu.Lock()
					first = cmp.Or(first, fmt.Errorf("stackbench: warm: %w", err))
					mu.Unlock()
					return
				}
			}
		})
	}
	wg.Wait()
	return answered.Load(), first
}
