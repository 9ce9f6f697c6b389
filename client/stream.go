package client

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/leasebucket/leasebucket/internal/checkwire"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

const (
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
)

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
	ctx      context.Context
	deadline time.Time
	req      checkwire.Check
	done     chan answer // buffered: the deliverer never blocks on a caller that gave up
}

// pendings and timers are reused from check to check: a check answered leaves both free (one
// whose caller gave up does not come back: its answer may still be delivered). A timer stopped
// before it is reset delivers no stale tick (Go 1.23's timers).
var (
	pendings = sync.Pool{New: func() any { return &pending{done: make(chan answer, 1)} }}
	timers   sync.Pool
)

func getTimer(d time.Duration) *time.Timer {
	if t, ok := timers.Get().(*time.Timer); ok {
		t.Reset(d)
		return t
	}
	return time.NewTimer(d)
}

func putTimer(t *time.Timer) {
	t.Stop()
	timers.Put(t)
}

type answer struct {
	res    checkwire.Result
	errMsg string
	err    error
}

// errNoStream: the check was not answered on a stream (none usable, or it broke): send it unary.
var errNoStream = errors.New("client: no stream")

// errClosed: the Client was closed.
var errClosed = errors.New("client: closed")

// stream is one open CheckStream and the batches sent on it and not yet answered. Its messages
// are written and read by checkwire, sent and received as the unknown fields of an empty
// message: the generated code's message and strings per check were most of what a streamed
// check cost the caller beyond gRPC.
type stream struct {
	s        agentv1.AgentService_CheckStreamClient
	cancel   context.CancelFunc
	nextID   uint64
	inflight map[uint64]*sentBatch // guarded by streamer.mu
	dead     bool                  // guarded by streamer.mu
}

// sentBatch is a batch sent on a stream: the agent answers it whole, or (it is sent with
// partial) the checks it decides at once first and the others later. A check answered is nil
// in checks; left counts the others.
type sentBatch struct {
	checks []*pending
	left   int
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

// check queues req for the stream and waits for its answer until ctx ends or the deadline.
// errNoStream means: send it unary.
func (st *streamer) check(ctx context.Context, deadline time.Time, req checkwire.Check) (answer, error) {
	if !st.usable() {
		return answer{}, errNoStream
	}
	p := pendings.Get().(*pending)
	p.ctx, p.deadline, p.req = ctx, deadline, req
	t := getTimer(time.Until(deadline))
	defer putTimer(t)
	select {
	case st.queue <- p:
	case <-ctx.Done():
		return answer{}, ctx.Err()
	case <-t.C:
		return answer{}, context.DeadlineExceeded
	case <-st.ctx.Done():
		return answer{}, errClosed
	}
	select {
	case a := <-p.done:
		*p = pending{done: p.done}
		pendings.Put(p)
		if a.err == nil {
			st.checks.Add(1)
		}
		return a, a.err
	case <-ctx.Done():
		return answer{}, ctx.Err()
	case <-t.C:
		return answer{}, context.DeadlineExceeded
	case <-st.ctx.Done():
		return answer{}, errClosed
	}
}

// send is the sender goroutine: it forms batches from the queue and sends them.
func (st *streamer) send() {
	defer st.wg.Done()
	defer st.shutdown()
	batch := make([]*pending, 0, st.maxBatch)
	var enc encoder // the sender's buffers, reused message to message
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
		live, now := batch[:0], time.Now()
		for _, p := range batch {
			if p.ctx.Err() == nil && now.Before(p.deadline) { // else its caller gave up: do not charge it
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
		st.sendBatch(s, live, &enc)
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
	s := &stream{s: cs, cancel: cancel, inflight: make(map[uint64]*sentBatch)}
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

// encoder is the sender's buffers: the checks of a message and its bytes. SendMsg marshals the
// message (a copy of its bytes) before it returns, so both serve the next message.
type encoder struct {
	checks []checkwire.Check
	buf    []byte
	msg    emptypb.Empty
}

// sendBatch registers batch on s and sends it. A failed send leaves the batch to the receiver,
// which fails every batch of the stream when its Recv fails (as it then must).
func (st *streamer) sendBatch(s *stream, batch []*pending, enc *encoder) {
	enc.checks = enc.checks[:0]
	for _, p := range batch {
		enc.checks = append(enc.checks, p.req)
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
	id := s.nextID
	s.inflight[id] = &sentBatch{checks: batch, left: len(batch)}
	st.mu.Unlock()
	st.batches.Add(1)
	// Partial: a check decided at once does not wait for another check's refill. An agent that
	// predates it answers every message whole, which is read alike.
	enc.buf = checkwire.AppendRequest(enc.buf[:0], id, enc.checks, true)
	enc.msg.ProtoReflect().SetUnknown(enc.buf)
	clear(enc.checks) // keep no caller's strings alive
	if err := s.s.SendMsg(&enc.msg); err != nil {
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
	var (
		dec  checkwire.Decoder
		resp checkwire.Answer // reused: deliver copies each result out
	)
	for {
		m := new(emptypb.Empty) // the answer, all of it as unknown fields
		err := s.s.RecvMsg(m)
		if err == nil {
			if err = dec.Decode(m.ProtoReflect().GetUnknown(), &resp); err != nil {
				err = status.Errorf(codes.Internal, "agent stream: malformed answer: %v", err)
			}
		}
		if err != nil {
			st.streamFailed(s, err)
			return
		}
		st.mu.Lock()
		sb, ok := s.inflight[resp.ID]
		var answered []*pending
		lined, complete := false, false
		if ok {
			answered, lined = sb.take(&resp)
			if complete = sb.left == 0; complete {
				delete(s.inflight, resp.ID)
			}
		}
		st.backoff = reopenMin // the stream works
		st.mu.Unlock()
		if !ok {
			st.log.Warn("agent stream: answer to an unknown batch", zap.Uint64("id", resp.ID))
			continue
		}
		if complete {
			<-st.slots // the batch's slot is free once every check of it is answered
		}
		deliver(answered, &resp, lined, st.c.target)
	}
}

// take removes from sb the checks resp answers and returns them in the order of resp's results:
// every check left when resp lists no indexes, else the checks it lists. ok is false when resp
// names a check that is not waiting or does not list one index per result: then every check left
// is taken, to be failed.
func (sb *sentBatch) take(resp *checkwire.Answer) (checks []*pending, ok bool) {
	if n := len(resp.Indexes); n != 0 {
		ok = n == len(resp.Results)
		for _, i := range resp.Indexes {
			ok = ok && int(i) < len(sb.checks) && sb.checks[i] != nil
		}
		if ok {
			checks = make([]*pending, n)
			for k, i := range resp.Indexes {
				checks[k], sb.checks[i] = sb.checks[i], nil
			}
			sb.left -= n
			return checks, true
		}
	}
	if len(resp.Indexes) == 0 && sb.left == len(sb.checks) { // whole, the usual answer
		checks, sb.left = sb.checks, 0
		return checks, true
	}
	checks = make([]*pending, 0, sb.left)
	for i, p := range sb.checks {
		if p != nil {
			checks = append(checks, p)
			sb.checks[i] = nil
		}
	}
	sb.left = 0
	return checks, len(resp.Indexes) == 0
}

// deliver hands each check of batch its answer, resp's results in order; if the answer does not
// line up with its checks (!ok, or the counts differ), every check fails.
func deliver(batch []*pending, resp *checkwire.Answer, ok bool, target string) {
	if !ok || len(resp.Results) != len(batch) || (len(resp.Errors) != 0 && len(resp.Errors) != len(batch)) {
		err := &UnreachableError{Target: target, Err: fmt.Errorf("stream answered %d results, %d errors and indexes %v for %d checks",
			len(resp.Results), len(resp.Errors), resp.Indexes, len(batch))}
		for _, p := range batch {
			p.done <- answer{err: err}
		}
		return
	}
	for i, p := range batch {
		a := answer{res: resp.Results[i]}
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
	for _, sb := range batches {
		<-st.slots
		for _, p := range sb.checks {
			if p != nil { // not answered yet
				p.done <- ans
			}
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
