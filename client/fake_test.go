package client_test

import (
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/leasebucket/leasebucket/agent"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

// streamMode is how fakeAgent serves CheckStream.
type streamMode int32

const (
	streamServe         streamMode = iota // answer every batch, out of order
	streamUnimplemented                   // UNIMPLEMENTED, as an agent without CheckStream answers
	streamBreak                           // read one batch, then fail the stream without answering
	streamPartial                         // answer a partial batch a check at a time, out of order
	streamBadIndexes                      // answer a partial batch with an index it does not have
	streamMalformed                       // answer each batch with a message that does not decode
)

// fakeAgent is an AgentService whose answers are a function of the check, so each caller can
// verify it got its own answer: the rule is "r-" + tenant, remaining is the cost. Tenants with a
// meaning: "deny" is denied (Retry-After 1.5 s), "down" is unavailable, "degraded" is allowed
// degraded, "bad" is malformed, "pending" is a repeat of an idempotency key still being decided
// (as the agent answers it: ABORTED, or its error text in a batch), "hang" is never answered
// (until the caller's deadline).
type fakeAgent struct {
	agentv1.UnimplementedAgentServiceServer
	mode atomic.Int32

	unary   atomic.Int64
	opens   atomic.Int64
	mu      sync.Mutex
	batches []int // sizes of the stream batches received
	partial int   // stream batches received with partial set
	hangs   []int // the other checks of each stream batch received with a "hang" check
	accepts atomic.Int64
}

func decide(req *agentv1.CheckRequest) (*agentv1.CheckResponse, string) {
	resp := &agentv1.CheckResponse{Decision: agentv1.Decision_DECISION_ALLOW, Rule: "r-" + req.Tenant,
		Remaining: req.Cost, Limit: 100, WindowMs: 60_000, ResetMs: 1200, Replayed: req.IdempotencyKey != ""}
	switch req.Tenant {
	case "deny":
		resp.Decision, resp.RetryAfterMs = agentv1.Decision_DECISION_DENY, 1500
	case "down":
		resp.Decision, resp.RetryAfterMs = agentv1.Decision_DECISION_UNAVAILABLE, 2000
	case "degraded":
		resp.Degraded = true
	case "bad":
		return &agentv1.CheckResponse{}, "tenant is bad"
	case "pending":
		return &agentv1.CheckResponse{}, agent.ErrIdempotencyPending.Error() // the agent's own text
	}
	return resp, ""
}

func (f *fakeAgent) Check(ctx context.Context, req *agentv1.CheckRequest) (*agentv1.CheckResponse, error) {
	f.unary.Add(1)
	if req.Tenant == "hang" {
		<-ctx.Done()
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	resp, errMsg := decide(req)
	switch {
	case req.Tenant == "pending":
		return nil, status.Error(codes.Aborted, errMsg)
	case errMsg != "":
		return nil, status.Error(codes.InvalidArgument, errMsg)
	}
	return resp, nil
}

func (f *fakeAgent) CheckStream(s agentv1.AgentService_CheckStreamServer) error {
	f.opens.Add(1)
	switch streamMode(f.mode.Load()) {
	case streamUnimplemented:
		return status.Error(codes.Unimplemented, "method CheckStream not implemented")
	case streamBreak:
		if _, err := s.Recv(); err != nil {
			return err
		}
		return status.Error(codes.Unavailable, "stream reset")
	case streamMalformed:
		for {
			req, err := s.Recv()
			if err != nil {
				return nil
			}
			// A result whose rule is not UTF-8: no protobuf decoder accepts it.
			res := protowire.AppendString(protowire.AppendTag(nil, 8, protowire.BytesType), "r-\xff")
			b := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), req.Id)
			b = protowire.AppendBytes(protowire.AppendTag(b, 2, protowire.BytesType), res)
			m := &emptypb.Empty{}
			m.ProtoReflect().SetUnknown(b)
			if err := s.SendMsg(m); err != nil {
				return err
			}
		}
	}
	var sendMu sync.Mutex
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		req, err := s.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		f.mu.Lock()
		f.batches = append(f.batches, len(req.Checks))
		if req.Partial {
			f.partial++
		}
		hangs := 0
		for _, c := range req.Checks {
			if c.Tenant == "hang" {
				hangs++
			}
		}
		if hangs > 0 {
			f.hangs = append(f.hangs, len(req.Checks)-hangs)
		}
		f.mu.Unlock()
		mode := streamMode(f.mode.Load())
		if req.Partial && (mode == streamPartial || mode == streamBadIndexes) {
			// A response per check, each on its own goroutine after a jitter (a "hang" check
			// never answered): the client puts the batch together from the indexes.
			for i, c := range req.Checks {
				wg.Go(func() {
					if c.Tenant == "hang" {
						<-s.Context().Done()
						return
					}
					r, e := decide(c)
					resp := &agentv1.CheckStreamResponse{Id: req.Id, Results: []*agentv1.CheckResponse{r}, Indexes: []uint32{uint32(i)}}
					if e != "" {
						resp.Errors = []string{e}
					}
					if mode == streamBadIndexes {
						resp.Indexes[0] = uint32(len(req.Checks))
					}
					time.Sleep(time.Duration(rand.IntN(200)) * time.Microsecond)
					sendMu.Lock()
					defer sendMu.Unlock()
					_ = s.Send(resp)
				})
			}
			continue
		}
		wg.Add(1)
		go func() { // answer each batch on its own goroutine, after a jitter: out of order
			defer wg.Done()
			resp := &agentv1.CheckStreamResponse{Id: req.Id}
			anyErr := false
			for _, c := range req.Checks {
				if c.Tenant == "hang" {
					<-s.Context().Done()
					return
				}
				r, e := decide(c)
				resp.Results = append(resp.Results, r)
				resp.Errors = append(resp.Errors, e)
				anyErr = anyErr || e != ""
			}
			if !anyErr {
				resp.Errors = nil
			}
			time.Sleep(time.Duration(rand.IntN(200)) * time.Microsecond)
			sendMu.Lock()
			defer sendMu.Unlock()
			_ = s.Send(resp)
		}()
	}
}

// partialBatches is how many stream batches were sent with partial, and for each batch that
// carried a "hang" check, its other checks.
func (f *fakeAgent) partialBatches() (int, []int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.partial, append([]int(nil), f.hangs...)
}

func (f *fakeAgent) batchSizes() []int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]int(nil), f.batches...)
}

// countingListener counts accepted connections.
type countingListener struct {
	net.Listener
	n *atomic.Int64
}

func (l countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.n.Add(1)
	}
	return c, err
}

// fakeServer is a fakeAgent served on a Unix socket.
type fakeServer struct {
	*fakeAgent
	socket string
	g      *grpc.Server
	served chan struct{}
}

// startFake serves a new fakeAgent in mode on a socket in a fresh directory.
func startFake(t testing.TB, mode streamMode) *fakeServer {
	t.Helper()
	return serveFake(t, &fakeAgent{}, filepath.Join(shortTempDir(t), "agent.sock"), mode)
}

func serveFake(t testing.TB, f *fakeAgent, socket string, mode streamMode) *fakeServer {
	t.Helper()
	f.mode.Store(int32(mode))
	ln, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	s := &fakeServer{fakeAgent: f, socket: socket, g: grpc.NewServer(), served: make(chan struct{})}
	agentv1.RegisterAgentServiceServer(s.g, f)
	go func() { _ = s.g.Serve(countingListener{ln, &f.accepts}); close(s.served) }()
	t.Cleanup(s.stop)
	return s
}

// stop ends the server (and its streams) at once.
func (s *fakeServer) stop() {
	s.g.Stop()
	<-s.served
}

// shortTempDir is a temporary directory with a path short enough for a Unix socket (108 bytes).
func shortTempDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "lbc")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func tenantN(i int) string { return "t" + strconv.Itoa(i) }
