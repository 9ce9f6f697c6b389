package agent

import (
	"context"
	"errors"
	"io"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/leasebucket/leasebucket/internal/clock"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

const (
	// MaxBatchChecks bounds the checks of one CheckBatch request or CheckStream message. Past a
	// few hundred checks a message no longer gets cheaper per check (gRPC's per-message cost is
	// spread thin), while one message still has to be decided and answered as a whole; a larger
	// one is INVALID_ARGUMENT.
	MaxBatchChecks = 1024

	// MaxStreamPending bounds the messages of one stream that wait for refills at once. A message
	// whose checks all decide at once is answered on the receive loop; one that waits (a new key,
	// a lease running dry) is handed to a goroutine so later messages are not held behind it.
	// With this many waiting the stream is not read until one is answered: gRPC flow control
	// then stops the caller's sends. Each wait ends within MaxWait.
	MaxStreamPending = 8
)

// CheckBatch implements AgentService.CheckBatch: the checks are decided together under one wait
// bound; results and errors are in request order (errors is empty when no check has an error,
// else it has one entry per check, "" for none; a check with an error has DECISION_UNSPECIFIED).
func (s *Server) CheckBatch(ctx context.Context, req *agentv1.CheckBatchRequest) (*agentv1.CheckBatchResponse, error) {
	if n := len(req.Checks); n > MaxBatchChecks {
		s.metrics.invalidRequest()
		return nil, status.Errorf(codes.InvalidArgument, "agent: %d checks in a batch, at most %d", n, MaxBatchChecks)
	}
	s.metrics.batch(apiBatch, len(req.Checks))
	slots := batchSlots(req.Checks)
	s.decide(ctx, apiBatch, slots)
	results, errs, err := s.answers(slots)
	if err != nil {
		return nil, err
	}
	return &agentv1.CheckBatchResponse{Results: results, Errors: errs}, nil
}

// anyError reports whether a decided slot has an error: only then does an answer list them.
func anyError(slots []slot) bool {
	for i := range slots {
		if slots[i].err != nil {
			return true
		}
	}
	return false
}

func batchSlots(checks []*agentv1.CheckRequest) []slot {
	slots := make([]slot, len(checks))
	for i, c := range checks {
		slots[i].q = Query{Tenant: c.GetTenant(), Path: c.GetRoute(), Operation: c.GetOperation(), Cost: c.GetCost(), Settle: c.GetSettle()}
		slots[i].key, slots[i].brief = c.GetIdempotencyKey(), c.GetBrief()
	}
	return slots
}

// answers turns decided slots into the response's lists. The responses of one message share one
// allocation. They are not reused across messages: grpc-go allows tracing and stats handlers to
// keep a sent message (ServerStream.SendMsg: "It is not safe to modify the message after calling
// SendMsg"). A shutdown or a caller gone away fails the whole message.
func (s *Server) answers(slots []slot) ([]*agentv1.CheckResponse, []string, error) {
	slab := make([]agentv1.CheckResponse, len(slots))
	results := make([]*agentv1.CheckResponse, len(slots))
	var errs []string // none unless a check has an error
	if anyError(slots) {
		errs = make([]string, len(slots))
	}
	for i := range slots {
		sl := &slots[i]
		r := &slab[i]
		results[i] = r
		if sl.err != nil {
			if !invalidCheck(sl.err) && !errors.Is(sl.err, ErrIdempotencyPending) {
				return nil, nil, s.statusError(sl.err)
			}
			errs[i] = sl.err.Error()
			continue
		}
		fillResponse(r, sl.v, sl.brief)
		r.Replayed = sl.replayed
	}
	return results, errs, nil
}

// CheckStream implements AgentService.CheckStream: each message is a batch, answered by a
// message with its id. Messages that wait for refills are answered when they are decided, so
// answers may come out of order. The stream's context ends every wait; Drain ends the stream
// after the messages read so far are answered.
func (s *Server) CheckStream(stream grpc.BidiStreamingServer[agentv1.CheckStreamRequest, agentv1.CheckStreamResponse]) error {
	s.metrics.stream(1)
	defer s.metrics.stream(-1)
	st := &checkStream{
		s: s, stream: stream, ctx: stream.Context(),
		pending: make(chan struct{}, MaxStreamPending),
		failed:  make(chan struct{}),
	}
	// The receive loop runs on its own goroutine so that Drain can end the stream while the loop
	// waits in Recv: returning from the handler cancels the stream, which ends that Recv.
	received := make(chan error, 1)
	go func() { received <- st.receive() }()
	var err error
	select {
	case err = <-received:
	case <-s.draining:
		st.stop()
		err = status.Error(codes.Unavailable, "agent: shutting down")
	case <-st.failed:
		st.stop()
	}
	st.wg.Wait() // every message read is answered (or its answer failed) before the stream ends
	if ferr := st.failure(); ferr != nil {
		err = ferr
	}
	return err
}

// checkStream is one CheckStream call.
type checkStream struct {
	s       *Server
	stream  grpc.BidiStreamingServer[agentv1.CheckStreamRequest, agentv1.CheckStreamResponse]
	ctx     context.Context
	pending chan struct{} // a token per message waiting for refills
	wg      sync.WaitGroup

	mu      sync.Mutex // held by the receive loop while it handles a message
	stopped bool       // the receive loop takes no further message

	sendMu sync.Mutex // one Send at a time (grpc-go streams allow one sender)

	failOnce sync.Once
	failed   chan struct{} // closed on the first failure of an answer
	failErr  error
}

func (st *checkStream) receive() error {
	var dec streamDecoder
	for {
		m := new(emptypb.Empty) // the message, all of it as unknown fields (decodeCheckStream)
		err := st.stream.RecvMsg(m)
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		st.mu.Lock()
		if st.stopped {
			st.mu.Unlock()
			return nil
		}
		err = st.handle(&dec, m.ProtoReflect().GetUnknown())
		st.mu.Unlock()
		if err != nil {
			return err
		}
	}
}

// stop makes the receive loop take no further message, once it finished the one it handles.
func (st *checkStream) stop() {
	st.mu.Lock()
	st.stopped = true
	st.mu.Unlock()
}

func (st *checkStream) fail(err error) {
	st.failOnce.Do(func() {
		st.failErr = err
		close(st.failed)
	})
}

func (st *checkStream) failure() error {
	select {
	case <-st.failed:
		return st.failErr
	default:
		return nil
	}
}

// handle decides one message: at once when nothing waits, else on a goroutine (at most
// MaxStreamPending per stream; the loop blocks, and stops reading, while that many wait). A
// message sent with partial has the checks decided at once answered at once, and the others
// when they are decided.
func (st *checkStream) handle(dec *streamDecoder, msg []byte) error {
	s := st.s
	m, err := dec.decodeCheckStream(msg)
	switch {
	case err != nil:
		s.metrics.invalidRequest()
		return status.Errorf(codes.InvalidArgument, "agent: a CheckStreamRequest that does not decode: %v", err)
	case m.n > MaxBatchChecks:
		s.metrics.invalidRequest()
		return status.Errorf(codes.InvalidArgument, "agent: message %d has %d checks, at most %d", m.id, m.n, MaxBatchChecks)
	}
	s.metrics.batch(apiStream, m.n)
	slots := m.slots
	now := s.now()
	if !s.startAll(now, slots) {
		s.recordAll(apiStream, now, slots)
		if err := st.answer(m.id, slots, nil); err != nil {
			return err
		}
		dec.release(slots) // decided, counted, audited (a copy) and encoded: nothing holds them
		return nil
	}
	var later []uint32 // with partial and some checks decided: the checks that wait
	if m.partial {
		var done []uint32
		done, later = splitDone(slots)
		if len(done) == 0 {
			later = nil // nothing to answer first: one answer, when all are decided
		} else {
			s.recordSome(apiStream, now, slots, done)
			if err := st.answer(m.id, slots, done); err != nil {
				s.abandon(slots, err)
				return err
			}
		}
	}
	select {
	case st.pending <- struct{}{}:
	case <-st.ctx.Done():
		s.abandon(slots, st.ctx.Err())
		return status.FromContextError(st.ctx.Err()).Err()
	}
	st.wg.Go(func() {
		defer func() { <-st.pending }()
		s.settle(st.ctx, slots)
		s.recordSome(apiStream, now, slots, later)
		if err := st.answer(m.id, slots, later); err != nil {
			st.fail(err)
		}
	})
	return nil
}

// recordSome counts and audits the slots idx names, or (nil) every slot.
func (s *Server) recordSome(api string, now clock.Nanos, slots []slot, idx []uint32) {
	if idx == nil {
		s.recordAll(api, now, slots)
		return
	}
	for _, i := range idx {
		s.record(api, now, &slots[i])
	}
}

// splitDone lists the indexes of the slots decided (done) and of those that wait (later).
func splitDone(slots []slot) (done, later []uint32) {
	for i := range slots {
		if slots[i].state == slotDone {
			done = append(done, uint32(i))
		} else {
			later = append(later, uint32(i))
		}
	}
	return done, later
}

// answer sends the answer of message id, of the slots idx names or (nil) of all, encoded by
// appendStreamAnswer into a buffer of its own: grpc-go allows tracing and stats handlers to keep
// a sent message.
func (st *checkStream) answer(id uint64, slots []slot, idx []uint32) error {
	n := len(slots)
	if idx != nil {
		n = len(idx)
	}
	b, err := st.s.appendStreamAnswer(make([]byte, 0, 16+n*streamAnswerBytes+2*len(idx)), id, slots, idx)
	if err != nil {
		return err
	}
	resp := &agentv1.CheckStreamResponse{}
	resp.ProtoReflect().SetUnknown(b)
	st.sendMu.Lock()
	defer st.sendMu.Unlock()
	return st.stream.Send(resp)
}

// streamAnswerBytes is room for a usual answer and its error string: a decision, the RateLimit
// fields and a short rule name.
const streamAnswerBytes = 40
