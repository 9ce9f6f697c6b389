package agent_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/leasebucket/leasebucket/agent"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

// TestCheckBatch: one batch carries the card's example and malformed checks; results and errors
// come back in request order, one each per check.
func TestCheckBatch(t *testing.T) {
	s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{})
	client, _, _, _ := s.serve(t)
	req := &agentv1.CheckBatchRequest{}
	for i := range 27 {
		c := &agentv1.CheckRequest{Tenant: "acme", Route: "/orders/7", Operation: "GET"}
		switch i {
		case 3:
			c.Tenant = "" // malformed
		case 11:
			c.Cost = 21 // above the burst
		}
		req.Checks = append(req.Checks, c)
	}
	resp, err := client.CheckBatch(ctxTimeout(t, 5*time.Second), req)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Results) != 27 || len(resp.Errors) != 27 {
		t.Fatalf("%d results and %d errors for 27 checks", len(resp.Results), len(resp.Errors))
	}
	allowed := 0
	for i, r := range resp.Results {
		switch {
		case i == 3 || i == 11:
			if r.Decision != agentv1.Decision_DECISION_UNSPECIFIED || !strings.Contains(resp.Errors[i], "invalid") {
				t.Fatalf("check %d: %v %q, want an error and no decision", i, r, resp.Errors[i])
			}
		case resp.Errors[i] != "":
			t.Fatalf("check %d: error %q", i, resp.Errors[i])
		case r.Decision == agentv1.Decision_DECISION_ALLOW:
			if i != allowed+countBelow(i, 3, 11) {
				t.Fatalf("check %d allowed after a denial", i)
			}
			allowed++
		case r.Decision == agentv1.Decision_DECISION_DENY:
			if r.RetryAfterMs <= 0 || r.Rule != "orders-read" {
				t.Fatalf("check %d: %v", i, r)
			}
		default:
			t.Fatalf("check %d: %v", i, r)
		}
	}
	if allowed != 20 {
		t.Fatalf("%d allowed, want the burst of 20", allowed)
	}
	// A batch with no malformed check has no errors list.
	clean := &agentv1.CheckBatchRequest{Checks: req.Checks[:3]}
	if resp, err := client.CheckBatch(ctxTimeout(t, 5*time.Second), clean); err != nil || len(resp.Results) != 3 || len(resp.Errors) != 0 {
		t.Fatalf("batch of 3 well-formed checks = %v, %v; want 3 results and no errors", resp, err)
	}
	// An empty batch is answered empty; an oversized one is refused whole.
	if resp, err := client.CheckBatch(ctxTimeout(t, 5*time.Second), &agentv1.CheckBatchRequest{}); err != nil || len(resp.Results) != 0 {
		t.Fatalf("empty batch = %v, %v", resp, err)
	}
	big := &agentv1.CheckBatchRequest{Checks: make([]*agentv1.CheckRequest, agent.MaxBatchChecks+1)}
	for i := range big.Checks {
		big.Checks[i] = &agentv1.CheckRequest{Tenant: "other", Route: "/orders/7", Operation: "GET"}
	}
	if _, err := client.CheckBatch(ctxTimeout(t, 5*time.Second), big); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("batch of %d = %v, want INVALID_ARGUMENT", len(big.Checks), err)
	}
	if lvl := s.level(t, "/orders/7", "GET", "other"); lvl != 20_000_000 {
		t.Fatalf("the refused batch charged its tenant: bucket at %d µ", lvl)
	}
}

// countBelow counts the indexes in xs below i.
func countBelow(i int, xs ...int) int {
	n := 0
	for _, x := range xs {
		if x < i {
			n++
		}
	}
	return n
}

func openStream(t testing.TB, client agentv1.AgentServiceClient) (agentv1.AgentService_CheckStreamClient, context.CancelFunc) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	st, err := client.CheckStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return st, cancel
}

func streamMsg(id uint64, n int, tenant, route, op string) *agentv1.CheckStreamRequest {
	m := &agentv1.CheckStreamRequest{Id: id}
	for range n {
		m.Checks = append(m.Checks, &agentv1.CheckRequest{Tenant: tenant, Route: route, Operation: op})
	}
	return m
}

// TestCheckStream: messages are answered by id, one result per check, and one error entry per
// check when a check of the message has one (none otherwise); a message that waits for a refill
// does not hold back the messages after it.
func TestCheckStream(t *testing.T) {
	s := newStack(t, parsePolicy(t, benchPolicy), stackOptions{maxWait: 5 * time.Second})
	client, _, _, _ := s.serve(t)
	st, _ := openStream(t, client)
	// Warm tenant a's lease; then make refills slow and send a message for a new tenant (it waits
	// for its refill) before one for a (answered from the lease).
	if err := st.Send(streamMsg(1, 3, "a", "/api/x", "GET")); err != nil {
		t.Fatal(err)
	}
	if resp, err := st.Recv(); err != nil || resp.Id != 1 || len(resp.Results) != 3 || len(resp.Errors) != 0 {
		t.Fatalf("first answer = %v, %v", resp, err)
	}
	s.warm(t, agent.Query{Tenant: "a", Path: "/api/x", Operation: "GET"})
	s.coord.setFault(slow)
	waiting := streamMsg(2, 5, "b", "/api/x", "GET")
	waiting.Checks = append(waiting.Checks, &agentv1.CheckRequest{Tenant: "b", Route: "no-slash", Operation: "GET"})
	if err := st.Send(waiting); err != nil {
		t.Fatal(err)
	}
	if err := st.Send(streamMsg(3, 4, "a", "/api/x", "GET")); err != nil {
		t.Fatal(err)
	}
	if err := st.CloseSend(); err != nil {
		t.Fatal(err)
	}
	var order []uint64
	for {
		resp, err := st.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		order = append(order, resp.Id)
		want := map[uint64]int{2: 6, 3: 4}[resp.Id]
		wantErrs := map[uint64]int{2: 6, 3: 0}[resp.Id] // message 3 has no malformed check
		if len(resp.Results) != want || len(resp.Errors) != wantErrs {
			t.Fatalf("message %d: %d results, %d errors; want %d and %d", resp.Id, len(resp.Results), len(resp.Errors), want, wantErrs)
		}
		for i, r := range resp.Results {
			bad := resp.Id == 2 && i == 5
			errText := ""
			if len(resp.Errors) > 0 {
				errText = resp.Errors[i]
			}
			if bad != (errText != "") || bad != (r.Decision == agentv1.Decision_DECISION_UNSPECIFIED) {
				t.Fatalf("message %d check %d: %v %q", resp.Id, i, r, errText)
			}
			if !bad && r.Decision != agentv1.Decision_DECISION_ALLOW {
				t.Fatalf("message %d check %d: %v", resp.Id, i, r)
			}
		}
	}
	if fmt.Sprint(order) != "[3 2]" {
		t.Fatalf("answers in order %v, want [3 2]: the message waiting for a refill answered last", order)
	}
}

// TestCheckStreamPartial: a message sent with partial has the checks decided at once (a lease on
// hand, a malformed check) answered at once with their indexes, and the checks waiting for a
// refill answered by a second response; a message whose checks all decide at once, or all wait,
// gets one whole answer; without partial the mixed message gets one whole answer too.
func TestCheckStreamPartial(t *testing.T) {
	s := newStack(t, parsePolicy(t, benchPolicy), stackOptions{maxWait: 5 * time.Second})
	client, _, _, _ := s.serve(t)
	st, _ := openStream(t, client)
	s.warm(t, agent.Query{Tenant: "a", Path: "/api/x", Operation: "GET"})
	s.coord.setFault(slow)
	check := func(tenant, route string) *agentv1.CheckRequest {
		return &agentv1.CheckRequest{Tenant: tenant, Route: route, Operation: "GET"}
	}
	mixed := func(id uint64, partial bool, tenant string) *agentv1.CheckStreamRequest {
		return &agentv1.CheckStreamRequest{Id: id, Partial: partial, Checks: []*agentv1.CheckRequest{
			check("a", "/api/x"), check(tenant, "/api/x"), check("a", "/api/x"), check("a", "no-slash"), check(tenant, "/api/x"),
		}}
	}
	recv := func() *agentv1.CheckStreamResponse {
		t.Helper()
		resp, err := st.Recv()
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	// wantAnswer checks one response: its id, the indexes it lists, and which of its results is
	// the malformed check (an error, no decision) while the others are allowed.
	wantAnswer := func(resp *agentv1.CheckStreamResponse, id uint64, indexes []uint32, malformed int) {
		t.Helper()
		n := len(indexes)
		if n == 0 {
			n = 5
		}
		if resp.Id != id || fmt.Sprint(resp.Indexes) != fmt.Sprint(indexes) || len(resp.Results) != n {
			t.Fatalf("answer %d indexes %v with %d results; want %d, %v and %d", resp.Id, resp.Indexes, len(resp.Results), id, indexes, n)
		}
		if (malformed >= 0) != (len(resp.Errors) == n) || (malformed < 0 && len(resp.Errors) != 0) {
			t.Fatalf("answer %d: errors %q, want one per result only with the malformed check", resp.Id, resp.Errors)
		}
		for i, r := range resp.Results {
			if i == malformed {
				if r.Decision != agentv1.Decision_DECISION_UNSPECIFIED || resp.Errors[i] == "" {
					t.Fatalf("answer %d result %d (malformed): %v %q", resp.Id, i, r, resp.Errors[i])
				}
				continue
			}
			if r.Decision != agentv1.Decision_DECISION_ALLOW || (len(resp.Errors) > 0 && resp.Errors[i] != "") {
				t.Fatalf("answer %d result %d: %v", resp.Id, i, r)
			}
		}
	}
	// Partial: tenant b's two checks wait for their refill; the other three are answered first.
	if err := st.Send(mixed(1, true, "b")); err != nil {
		t.Fatal(err)
	}
	wantAnswer(recv(), 1, []uint32{0, 2, 3}, 2)
	wantAnswer(recv(), 1, []uint32{1, 4}, -1)
	// Without partial: one answer of five, in order, once tenant c's refill came.
	if err := st.Send(mixed(2, false, "c")); err != nil {
		t.Fatal(err)
	}
	wantAnswer(recv(), 2, nil, 3)
	// Partial, every check decided at once (tenant a's lease): one answer.
	if err := st.Send(mixed(3, true, "a")); err != nil {
		t.Fatal(err)
	}
	wantAnswer(recv(), 3, nil, 3)
	// Partial, every check waits: one answer, when they are decided.
	if err := st.Send(&agentv1.CheckStreamRequest{Id: 4, Partial: true, Checks: []*agentv1.CheckRequest{check("d", "/api/x"), check("e", "/api/x")}}); err != nil {
		t.Fatal(err)
	}
	if resp := recv(); resp.Id != 4 || len(resp.Indexes) != 0 || len(resp.Results) != 2 {
		t.Fatalf("answer %d indexes %v with %d results; want 4, none, 2", resp.Id, resp.Indexes, len(resp.Results))
	}
}

// TestCheckStreamDeadlines: a message waiting for a refill from a coordinator that hangs is
// answered by the rule's failure mode when the agent's max wait has passed; the stream's context
// ends every wait at once.
func TestCheckStreamDeadlines(t *testing.T) {
	const maxWait = 100 * time.Millisecond
	s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{maxWait: maxWait, callTimeout: 3 * maxWait})
	s.lossOK = true
	client, _, _, _ := s.serve(t)
	s.coord.setFault(hang)
	st, _ := openStream(t, client)
	start := time.Now()
	if err := st.Send(streamMsg(7, 3, "acme", "/orders/7", "POST")); err != nil {
		t.Fatal(err)
	}
	resp, err := st.Recv()
	took := time.Since(start)
	if err != nil || resp.Id != 7 || len(resp.Results) != 3 {
		t.Fatalf("answer = %v, %v", resp, err)
	}
	for _, r := range resp.Results {
		if r.Decision != agentv1.Decision_DECISION_UNAVAILABLE || r.RetryAfterMs != 1000 {
			t.Fatalf("check with a hanging coordinator = %v, want unavailable, retry after 1000 ms", r)
		}
	}
	// Answered by the wait bound: not before it, and by its fallback (counted per check).
	if took < maxWait {
		t.Fatalf("answered after %v, before the wait bound %v", took, maxWait)
	}
	if n := metricValues(t, s.reg)["leasebucket_agent_wait_fallbacks_total"]; n != 3 {
		t.Fatalf("%v checks answered by the wait bound, want the 3 of the message", n)
	}

	// With a long wait bound, cancelling the stream ends the waits: the server's handler returns
	// long before the refill's call times out (goleak in TestMain checks that nothing is left
	// behind).
	s2 := newStack(t, loadPolicy(t, examplePolicy), stackOptions{maxWait: time.Minute, callTimeout: time.Second})
	s2.lossOK = true
	client2, _, _, _ := s2.serve(t)
	s2.coord.setFault(hang)
	st2, cancel := openStream(t, client2)
	if err := st2.Send(streamMsg(1, 2, "acme", "/orders/7", "POST")); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "the check waits", func() bool { n, _ := s2.lim.Pending(); return n > 0 || s2.ref.InFlight() > 0 })
	cancel()
	if _, err := st2.Recv(); status.Code(err) != codes.Canceled {
		t.Fatalf("Recv after cancel = %v, want Canceled", err)
	}
	eventually(t, 500*time.Millisecond, "the stream ends on the server", func() bool {
		return metricValues(t, s2.reg)["leasebucket_agent_check_streams"] == 0
	})
}

// TestCheckStreamBackpressure: a caller that sends without reading answers is stopped by gRPC
// flow control: the agent answers (and so reads) no more than its flow-control windows and its
// per-stream bound hold, then the caller's sends block; once it reads, every message is answered.
func TestCheckStreamBackpressure(t *testing.T) {
	s := newStack(t, parsePolicy(t, benchPolicy), stackOptions{})
	// Fixed windows (64 KiB, gRPC's initial ones) on both sides keep the bound independent of
	// gRPC's BDP estimation, which may grow them.
	path := filepath.Join(shortTempDir(t), "agent.sock")
	ln, err := agent.ListenUnix(path, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer(grpc.InitialWindowSize(64<<10), grpc.InitialConnWindowSize(64<<10))
	s.srv.Register(g)
	served := make(chan struct{})
	go func() { _ = g.Serve(ln); close(served) }()
	defer func() { g.Stop(); <-served; ln.Close() }()
	conn, err := grpc.NewClient("unix:"+path, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithInitialWindowSize(64<<10), grpc.WithInitialConnWindowSize(64<<10))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	st, _ := openStream(t, agentv1.NewAgentServiceClient(conn))
	const checks = 64 // ~1.3 KiB per answer
	var sent atomic.Int64
	sendErr := make(chan error, 1)
	stop := make(chan struct{})
	go func() {
		for i := uint64(1); ; i++ {
			select {
			case <-stop:
				sendErr <- st.CloseSend()
				return
			default:
			}
			if err := st.Send(streamMsg(i, checks, fmt.Sprintf("t%d", i%4), "/api/x", "GET")); err != nil {
				sendErr <- err
				return
			}
			sent.Add(1)
		}
	}()
	// Sends stall: the count stops moving while nobody reads.
	var stalled int64
	deadline := time.Now().Add(10 * time.Second)
	for last := int64(-1); ; {
		time.Sleep(200 * time.Millisecond)
		n := sent.Load()
		if n == last {
			stalled = n
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("sends never stalled: %d messages sent without a read", n)
		}
		last = n
	}
	// What the windows and buffers hold (two 64 KiB windows, the agent's 8 waiting messages, the
	// one it handles, transport buffers): a few hundred messages, not an unbounded queue.
	if stalled > 2000 {
		t.Fatalf("%d messages (%d checks) accepted without a read", stalled, stalled*checks)
	}
	t.Logf("sends stalled after %d messages", stalled)
	close(stop)
	got := map[uint64]bool{}
	for {
		resp, err := st.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if got[resp.Id] || len(resp.Results) != checks {
			t.Fatalf("answer %d: duplicate or %d results", resp.Id, len(resp.Results))
		}
		got[resp.Id] = true
	}
	if err := <-sendErr; err != nil {
		t.Fatal(err)
	}
	if int64(len(got)) != sent.Load() {
		t.Fatalf("%d answers for %d messages", len(got), sent.Load())
	}
}

// TestCheckStreamEnds: an oversized message ends the stream with INVALID_ARGUMENT after the
// messages before it are answered; Drain ends open streams with UNAVAILABLE, and a stream opened
// after it ends at once.
func TestCheckStreamEnds(t *testing.T) {
	s := newStack(t, parsePolicy(t, benchPolicy), stackOptions{})
	client, _, _, _ := s.serve(t)
	st, _ := openStream(t, client)
	if err := st.Send(streamMsg(1, 2, "a", "/api/x", "GET")); err != nil {
		t.Fatal(err)
	}
	if err := st.Send(streamMsg(2, agent.MaxBatchChecks+1, "a", "/api/x", "GET")); err != nil {
		t.Fatal(err)
	}
	if resp, err := st.Recv(); err != nil || resp.Id != 1 {
		t.Fatalf("answer = %v, %v; want message 1's", resp, err)
	}
	if _, err := st.Recv(); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "1025 checks") {
		t.Fatalf("after an oversized message: %v, want INVALID_ARGUMENT", err)
	}

	// A message that is not a CheckStreamRequest (a tenant of invalid UTF-8, as a client that
	// does not validate would send it) ends the stream with INVALID_ARGUMENT and why.
	st, _ = openStream(t, client)
	check := protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), "a\xff")
	raw := &emptypb.Empty{}
	raw.ProtoReflect().SetUnknown(protowire.AppendBytes(protowire.AppendTag(nil, 2, protowire.BytesType), check))
	if err := st.SendMsg(raw); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "UTF-8") {
		t.Fatalf("after a malformed message: %v, want INVALID_ARGUMENT", err)
	}

	st, _ = openStream(t, client)
	if err := st.Send(streamMsg(1, 2, "a", "/api/x", "GET")); err != nil {
		t.Fatal(err)
	}
	if resp, err := st.Recv(); err != nil || resp.Id != 1 {
		t.Fatalf("answer = %v, %v", resp, err)
	}
	s.srv.Drain()
	if _, err := st.Recv(); status.Code(err) != codes.Unavailable {
		t.Fatalf("after Drain: %v, want UNAVAILABLE", err)
	}
	st, _ = openStream(t, client)
	if _, err := st.Recv(); status.Code(err) != codes.Unavailable {
		t.Fatalf("a stream opened after Drain: %v, want UNAVAILABLE", err)
	}
}

// onePolicy's rule one is a bucket of one token that never refills in a test: the refill of a
// check that was given up is the lease that decides the next check of its key.
const onePolicy = `
version: "one"
rules:
  - name: one
    routes: ["/api/*"]
    operations: [read]
    limit: 1/hour
    burst: 1
default:
  limit: 60/minute
  burst: 10
`

// TestCheckStreamAbandoned: the checks of a message whose stream ends before it can be answered
// leave their keys' queues, so the grant their refill brings is not spent on them. The stream
// ends while its ninth message waits for a pending slot (eight messages wait for refills held
// at the coordinator); the refill of its only check, one token of a bucket of one that never
// refills, is then the lease that allows the next check of that key. Spent on the abandoned
// check, it would leave that check denied.
func TestCheckStreamAbandoned(t *testing.T) {
	s := newStack(t, parsePolicy(t, onePolicy), stackOptions{maxWait: 10 * time.Second, callTimeout: 10 * time.Second})
	client, _, _, _ := s.serve(t)
	s.coord.gate = make(chan struct{})
	s.coord.setFault(gated)
	st, cancel := openStream(t, client)
	for i := range agent.MaxStreamPending {
		if err := st.Send(streamMsg(uint64(i), 1, fmt.Sprintf("filler-%d", i), "/api/x", "GET")); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.Send(streamMsg(99, 1, "victim", "/api/x", "GET")); err != nil {
		t.Fatal(err)
	}
	const batches = "leasebucket_agent_batch_checks,api=stream"
	eventually(t, 5*time.Second, "the ninth message read", func() bool {
		return metricValues(t, s.reg)[batches] == agent.MaxStreamPending+1
	})
	cancel()
	eventually(t, 5*time.Second, "the stream ended", func() bool {
		return metricValues(t, s.reg)["leasebucket_agent_check_streams"] == 0
	})
	victimAllowed(t, s)
}

// failingSendStream is a CheckStream whose client went away after sending its messages: every
// message is read, every Send fails. Only what the handler uses is implemented.
type failingSendStream struct {
	grpc.ServerStream
	ctx   context.Context
	msgs  chan *agentv1.CheckStreamRequest
	sends atomic.Int32
}

func (f *failingSendStream) Context() context.Context { return f.ctx }

func (f *failingSendStream) RecvMsg(m any) error {
	select {
	case req := <-f.msgs:
		b, err := proto.Marshal(req)
		if err != nil {
			return err
		}
		return proto.Unmarshal(b, m.(proto.Message))
	case <-f.ctx.Done():
		return f.ctx.Err()
	}
}

func (f *failingSendStream) Recv() (*agentv1.CheckStreamRequest, error) {
	m := new(agentv1.CheckStreamRequest)
	return m, f.RecvMsg(m)
}

func (f *failingSendStream) Send(*agentv1.CheckStreamResponse) error {
	f.sends.Add(1)
	return status.Error(codes.Canceled, "the client went away")
}

// TestCheckStreamPartialSendFails: a partial message whose first answer (the checks decided at
// once) cannot be sent ends the stream with that error, and its waiting check leaves its key's
// queue: the grant its refill brings, one token of a bucket of one that never refills, is then
// the lease that allows the next check of that key. Spent on the abandoned check, it would leave
// that check denied.
func TestCheckStreamPartialSendFails(t *testing.T) {
	s := newStack(t, parsePolicy(t, onePolicy), stackOptions{maxWait: 10 * time.Second, callTimeout: 10 * time.Second})
	warm := agent.Query{Tenant: "warm", Path: "/other", Operation: "GET"}
	s.warm(t, warm) // a lease on the default rule: its check is decided at once
	s.coord.gate = make(chan struct{})
	s.coord.setFault(gated)
	msg := &agentv1.CheckStreamRequest{Id: 1, Partial: true, Checks: []*agentv1.CheckRequest{
		{Tenant: "warm", Route: "/other", Operation: "GET"},
		{Tenant: "victim", Route: "/api/x", Operation: "GET"},
	}}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	st := &failingSendStream{ctx: ctx, msgs: make(chan *agentv1.CheckStreamRequest, 1)}
	st.msgs <- msg
	err := s.srv.CheckStream(st)
	if status.Code(err) != codes.Canceled || st.sends.Load() != 1 {
		t.Fatalf("CheckStream = %v after %d sends; want the failed Send's error after one", err, st.sends.Load())
	}
	victimAllowed(t, s)
}

// victimAllowed opens the coordinator's gate and checks the victim's key again: the refill of its
// abandoned check, the one token of onePolicy's bucket, must be the lease that allows it.
func victimAllowed(t *testing.T, s *stack) {
	t.Helper()
	close(s.coord.gate)
	v, err := s.srv.Decide(ctxTimeout(t, 10*time.Second), agent.Query{Tenant: "victim", Path: "/api/x", Operation: "GET"})
	if err != nil || v.Outcome != agent.Allow {
		t.Fatalf("the next check of the abandoned check's key: %+v, %v; want allowed by the token its refill brought", v, err)
	}
}
