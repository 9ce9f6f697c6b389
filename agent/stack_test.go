package agent_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/agent/audit"
	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/coordinator/storetest"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/policy"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// The coordinator's Service is an agent.Coordinator in process (the simulator wires them so).
var _ agent.Coordinator = (*coordinator.Service)(nil)

const examplePolicy = "../examples/policy.yaml"

func loadPolicy(t testing.TB, file string) *policy.Set {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	set, err := policy.Parse(file, data)
	if err != nil {
		t.Fatal(err)
	}
	return set
}

// parsePolicy parses a policy file's text (agent.ParseSet).
var parsePolicy = agent.ParseSet

// fault is what testCoordinator does to a call.
type fault int32

const (
	healthy     fault = iota
	unreachable       // UNAVAILABLE at once, as gRPC answers when no coordinator is connected
	hang              // no answer until the call's deadline
	hangOnce          // the next Acquire hangs, later ones are served
	slow              // every call takes slowCall
	lostAnswers       // Acquires are applied, but their answers are lost (the call times out)
	gated             // every call waits until the test closes testCoordinator.gate
)

// slowCall is how long a call takes under the slow fault.
const slowCall = 20 * time.Millisecond

// testCoordinator is a coordinator.Service in process with injected faults and a record of the
// Acquire calls it saw.
type testCoordinator struct {
	svc   *coordinator.Service
	fault atomic.Int32
	gate  chan struct{} // set before the gated fault

	mu          sync.Mutex
	seqs        []uint64 // seq of every Acquire attempt, in order
	batches     []int    // items of every Acquire attempt
	inflight    int
	maxInflight int
	returned    int64 // µ of unspent tokens in Returns that reached the service
	// ops counts the items of every call, by "rule call": each Acquire item (acquire), and each
	// lease handed back apart from them, in an Acquire's returns or a Return (return).
	ops map[string]int
}

// count records the items of a call (an Acquire's items and returns, or a Return's items).
func (c *testCoordinator) count(items []*coordinatorv1.AcquireItem, returns []*coordinatorv1.ReturnItem) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ops == nil {
		c.ops = map[string]int{}
	}
	for _, it := range items {
		c.ops[it.Bucket.GetRule()+" acquire"]++
	}
	for _, it := range returns {
		c.ops[it.Bucket.GetRule()+" return"]++
	}
}

func (c *testCoordinator) setFault(f fault) { c.fault.Store(int32(f)) }

func (c *testCoordinator) enter(seq uint64, items int) {
	c.mu.Lock()
	c.seqs = append(c.seqs, seq)
	c.batches = append(c.batches, items)
	c.inflight++
	c.maxInflight = max(c.maxInflight, c.inflight)
	c.mu.Unlock()
}

func (c *testCoordinator) leave() {
	c.mu.Lock()
	c.inflight--
	c.mu.Unlock()
}

func (c *testCoordinator) injected(ctx context.Context, acquire bool) error {
	switch fault(c.fault.Load()) {
	case unreachable:
		return status.Error(codes.Unavailable, "connection refused")
	case hang:
		<-ctx.Done()
		return status.FromContextError(ctx.Err()).Err()
	case slow:
		select {
		case <-time.After(slowCall):
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		}
	case gated:
		select {
		case <-c.gate:
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		}
	case hangOnce:
		if acquire && c.fault.CompareAndSwap(int32(hangOnce), int32(healthy)) {
			<-ctx.Done()
			return status.FromContextError(ctx.Err()).Err()
		}
	}
	return nil
}

func (c *testCoordinator) Acquire(ctx context.Context, req *coordinatorv1.AcquireRequest) (*coordinatorv1.AcquireResponse, error) {
	c.enter(req.Seq, len(req.Items))
	defer c.leave()
	c.count(req.Items, req.Returns)
	if err := c.injected(ctx, true); err != nil {
		return nil, err
	}
	if fault(c.fault.Load()) == lostAnswers {
		if _, err := c.svc.Acquire(ctx, req); err != nil {
			return nil, err
		}
		return nil, status.Error(codes.DeadlineExceeded, "the answer was lost")
	}
	return c.svc.Acquire(ctx, req)
}

func (c *testCoordinator) Return(ctx context.Context, req *coordinatorv1.ReturnRequest) (*coordinatorv1.ReturnResponse, error) {
	c.count(nil, req.Items)
	if err := c.injected(ctx, false); err != nil {
		return nil, err
	}
	resp, err := c.svc.Return(ctx, req)
	if err == nil {
		c.mu.Lock()
		for _, it := range req.Items {
			c.returned += it.UnspentMicro
		}
		c.mu.Unlock()
	}
	return resp, err
}

func (c *testCoordinator) acquireSeqs() []uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]uint64(nil), c.seqs...)
}

type stackOptions struct {
	maxWait     time.Duration
	callTimeout time.Duration
	maxKeys     int
	reload      func(s *stack)
	idemWindow  time.Duration // agent.ServerConfig.IdempotencyWindow
	idemKeys    int
	audit       *audit.Queue
	quotaIdle   time.Duration // agent.ServerConfig.QuotaIdle
}

// stack is one agent in process: Limiter, Refresher and Server over a coordinator Service on an
// in-memory store whose clock stands still unless a test moves it (so a bucket holds exactly
// what the test expects).
type stack struct {
	set     *policy.Set
	storeMs atomic.Int64
	store   *storetest.Levels // a memstore
	coord   *testCoordinator
	clk     *clock.Coarse
	lim     *agent.Limiter
	ref     *agent.Refresher
	srv     *agent.Server
	reg     *prometheus.Registry
	reloads atomic.Int32
	lossOK  bool // the test makes Stop lose tokens on purpose
	// storeDown makes the store fail: storeBatchDown every batch (Redis unreachable),
	// storeKeysDown every key (the Cluster node of the key is down).
	storeDown atomic.Int32
}

const (
	storeUp int32 = iota
	storeBatchDown
	storeKeysDown
)

// faultStore is a coordinator.Store that fails on demand.
type faultStore struct {
	coordinator.Store
	mode *atomic.Int32
}

var errStoreDown = errors.New("dial tcp 10.0.0.7:6379: connection refused")

func (f *faultStore) Take(ctx context.Context, reqs []coordinator.TakeRequest) ([]coordinator.TakeResult, error) {
	switch f.mode.Load() {
	case storeBatchDown:
		return nil, errStoreDown
	case storeKeysDown:
		res := make([]coordinator.TakeResult, len(reqs))
		for i := range res {
			res[i].Err = errStoreDown
		}
		return res, nil
	}
	return f.Store.Take(ctx, reqs)
}

func (f *faultStore) Return(ctx context.Context, reqs []coordinator.ReturnRequest) ([]coordinator.ReturnResult, error) {
	if f.mode.Load() != storeUp {
		return nil, errStoreDown
	}
	return f.Store.Return(ctx, reqs)
}

func newStack(t testing.TB, set *policy.Set, o stackOptions) *stack {
	t.Helper()
	s := &stack{set: set}
	s.storeMs.Store(1_000_000)
	s.store = storetest.NewLevels(memstore.New(memstore.WithClock(func() bucket.Millis { return bucket.Millis(s.storeMs.Load()) })))
	s.coord = &testCoordinator{svc: coordinator.NewService(&faultStore{Store: s.store, mode: &s.storeDown}, set)}
	s.clk = clock.NewCoarse(time.Millisecond)
	t.Cleanup(s.clk.Close)
	metrics := agent.NewMetrics()
	log := zaptest.NewLogger(t)
	s.ref = agent.NewRefresher(agent.RefresherConfig{
		Coordinator: s.coord,
		Clock:       s.clk,
		CallTimeout: o.callTimeout,
		ReloadPolicy: func() {
			s.reloads.Add(1)
			if o.reload != nil {
				o.reload(s)
			}
		},
		Metrics: metrics,
		Logger:  log,
	})
	s.lim = agent.New(agent.Config{AgentID: "agent-test", Guard: clock.Guard, MaxKeys: o.maxKeys}, set)
	s.ref.Start(s.lim)
	t.Cleanup(func() { s.stop(t) })
	if o.maxWait == 0 {
		// A check on a key without a lease waits for a refill: on a loaded test machine that can
		// take longer than the production default, which would answer with the failure mode.
		// Tests of the wait bound set their own.
		o.maxWait = 2 * time.Second
	}
	s.srv = agent.NewServer(agent.ServerConfig{Limiter: s.lim, Clock: s.clk, MaxWait: o.maxWait, Metrics: metrics, Logger: log,
		IdempotencyWindow: o.idemWindow, IdempotencyKeys: o.idemKeys, Audit: o.audit, QuotaIdle: o.quotaIdle})
	s.reg = prometheus.NewRegistry()
	if err := metrics.Register(s.reg, s.lim, s.ref); err != nil {
		t.Fatal(err)
	}
	return s
}

// awaitAllow checks q until it is allowed (within 5 s): one allowed check.
func (s *stack) awaitAllow(t testing.TB, q agent.Query) {
	t.Helper()
	eventually(t, 5*time.Second, "an allow once answers arrive", func() bool {
		v, err := s.srv.Decide(ctxTimeout(t, 5*time.Second), q)
		return err == nil && v.Outcome == agent.Allow
	})
}

// stop shuts the Refresher down (returning the leases) and fails the test if that failed.
func (s *stack) stop(t testing.TB) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.ref.Stop(ctx); err != nil && !s.lossOK {
		t.Errorf("Refresher.Stop: %v", err)
	}
}

// serve serves the stack's Server on a Unix socket in a temporary directory and returns a client.
func (s *stack) serve(t testing.TB) (agentv1.AgentServiceClient, *grpc.ClientConn, *health.Server, string) {
	t.Helper()
	path := filepath.Join(shortTempDir(t), "agent.sock")
	ln, err := agent.ListenUnix(path, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	hs := s.srv.Register(g)
	served := make(chan struct{})
	go func() { _ = g.Serve(ln); close(served) }()
	conn, err := grpc.NewClient("unix:"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close()
		g.Stop()
		<-served
		ln.Close()
	})
	return agentv1.NewAgentServiceClient(conn), conn, hs, path
}

// shortTempDir is a temporary directory with a path short enough for a Unix socket (108 bytes).
func shortTempDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "lb")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// level is the global bucket's level of (route, tenant), in µ, as the store left it after the last
// operation on it (not refilled since).
func (s *stack) level(t testing.TB, path, op, tenant string) bucket.Micro {
	t.Helper()
	r, err := s.set.Match(path, op)
	if err != nil {
		t.Fatal(err)
	}
	key, err := s.set.Key(r, tenant, "")
	if err != nil {
		t.Fatal(err)
	}
	lvl, ok := s.store.Level(key)
	if !ok {
		lim, _ := s.set.Limits(r, tenant, "")
		return lim.Bucket.Capacity() // never used: full
	}
	return lvl
}

func ctxTimeout(t testing.TB, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// eventually polls cond every few milliseconds until it holds or d passes.
func eventually(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after %v: %s", d, what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func mustRead(t testing.TB, file string) []byte {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// warm checks q until its key holds a lease: a key with no demand holds none, so the checks are
// spread over more than a demand sample (lease.MinSample). Each check must be allowed.
func (s *stack) warm(t testing.TB, q agent.Query) {
	t.Helper()
	before := s.lim.Outstanding()
	for i := 0; ; i++ {
		if i == 20 {
			t.Fatalf("%v: no lease after %d checks", q, i)
		}
		if v, err := s.srv.Decide(ctxTimeout(t, 5*time.Second), q); err != nil || v.Outcome != agent.Allow {
			t.Fatalf("warming %v: check %d = %v, %v", q, i, v.Outcome, err)
		}
		eventually(t, 5*time.Second, "refills settle", func() bool {
			refills, returns := s.lim.Pending()
			return refills == 0 && returns == 0 && s.ref.InFlight() == 0
		})
		if s.lim.Outstanding() > before {
			return
		}
		time.Sleep(lease.MinSample / 2)
	}
}
