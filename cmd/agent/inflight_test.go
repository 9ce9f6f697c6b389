package main

import (
	"context"
	"fmt"
	"maps"
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
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// slowCoordinator answers every Acquire after 30 ms: unavailable, or with grant, every item
// granted what its checks need. It counts the Acquires it holds at once and notes when the last
// call the agent built arrived (gRPC's retries of a call aside).
type slowCoordinator struct {
	coordinatorv1.UnimplementedCoordinatorServiceServer
	grant           bool
	in, peak, calls atomic.Int64
	last            atomic.Int64 // time.Now().UnixNano() of the last Acquire's first attempt
}

func (c *slowCoordinator) Acquire(ctx context.Context, req *coordinatorv1.AcquireRequest) (*coordinatorv1.AcquireResponse, error) {
	if md, _ := metadata.FromIncomingContext(ctx); len(md.Get("grpc-previous-rpc-attempts")) == 0 {
		c.last.Store(time.Now().UnixNano())
	}
	n := c.in.Add(1)
	defer c.in.Add(-1)
	c.calls.Add(1)
	for p := c.peak.Load(); n > p && !c.peak.CompareAndSwap(p, n); p = c.peak.Load() {
	}
	select {
	case <-time.After(30 * time.Millisecond):
	case <-ctx.Done():
	}
	if !c.grant {
		return nil, status.Error(codes.Unavailable, "slow coordinator")
	}
	resp := &coordinatorv1.AcquireResponse{}
	for _, it := range req.Items {
		resp.Results = append(resp.Results, &coordinatorv1.AcquireResult{Status: coordinatorv1.Status_STATUS_OK,
			GrantedMicro: max(it.NeededMicro, it.MinMicro), TtlMs: 250, RemainingMicro: 1e9, GrantedAtMs: time.Now().UnixMilli()})
	}
	return resp, nil
}

// startSlow runs the agent in process, with the environment variables env besides its socket,
// the example policy and no metrics, audit log or overrides, against coord, and returns a client
// of the agent's socket. Everything stops when the test ends.
func startSlow(t *testing.T, coord *slowCoordinator, env map[string]string) agentv1.AgentServiceClient {
	g := grpc.NewServer()
	coordinatorv1.RegisterCoordinatorServiceServer(g, coord)
	hs := health.NewServer() // the agent's client checks the service's health
	hs.SetServingStatus(coordinatorv1.CoordinatorService_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(g, hs)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = g.Serve(ln) }()
	t.Cleanup(g.Stop)

	dir, err := os.MkdirTemp("", "lba")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	socket := filepath.Join(dir, "agent.sock")
	all := map[string]string{
		"LEASEBUCKET_AGENT_SOCKET":             socket,
		"LEASEBUCKET_COORDINATORS":             ln.Addr().String(),
		"LEASEBUCKET_POLICY":                   filepath.Join("..", "..", "examples", "policy.yaml"),
		"LEASEBUCKET_AGENT_METRICS_LISTEN":     "",
		"LEASEBUCKET_AGENT_OVERRIDES_INTERVAL": "0",
		"LEASEBUCKET_AGENT_AUDIT_LOG":          "off",
	}
	maps.Copy(all, env)
	ctx, cancel := context.WithCancel(context.Background())
	var logs proctest.Buffer
	done := make(chan error, 1)
	go func() { done <- run(ctx, nil, func(k string) string { return all[k] }, &logs) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("run: %v\n%s", err, logs.String())
		}
	})
	proctest.WaitFor(t, 10*time.Second, "the agent's socket", func() bool { return fileExists(socket) })

	conn, err := grpc.NewClient("unix:"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return agentv1.NewAgentServiceClient(conn)
}

// coldChecks has eight callers check ten keys of their own each, every key new, so every check
// waits for a refill; it returns once every check was answered.
func coldChecks(t *testing.T, client agentv1.AgentServiceClient) {
	var wg sync.WaitGroup
	for c := range 8 {
		wg.Go(func() {
			for i := range 10 {
				cctx, ccancel := context.WithTimeout(context.Background(), 5*time.Second)
				_, err := client.Check(cctx, &agentv1.CheckRequest{Tenant: fmt.Sprintf("t%d-%d", c, i), Route: "/products/9", Operation: "GET"})
				ccancel()
				if err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
}

// TestCallsInFlightBoundsCalls: the agent run with --calls-in-flight n (from its environment
// variable) never has more than n Acquires out to its coordinator, however many cold keys wait
// for a refill; with 1 its calls go one at a time, with 3 side by side.
func TestCallsInFlightBoundsCalls(t *testing.T) {
	for _, n := range []int{1, 3} {
		t.Run(strconv.Itoa(n), func(t *testing.T) {
			coord := &slowCoordinator{}
			client := startSlow(t, coord, map[string]string{"LEASEBUCKET_AGENT_CALLS_IN_FLIGHT": strconv.Itoa(n)})
			coldChecks(t, client)
			if coord.calls.Load() < 2 {
				t.Fatalf("%d Acquires for 80 cold checks", coord.calls.Load())
			}
			if peak := coord.peak.Load(); peak > int64(n) || (n > 1 && peak < 2) {
				t.Errorf("at most %d Acquires out at once with --calls-in-flight %d (%d calls)", peak, n, coord.calls.Load())
			}
		})
	}
}

// TestOverloadSendsOnlyWaitedRefills: with a coordinator slower than --max-wait, one call at a
// time, cold checks give up (their rule's failure mode answers them) while their refills queue.
// Once every check has been answered, no refill is left for the agent to send: a refill is sent
// only while a check waits for it (or its key refills ahead of need), so under overload the queue
// does not outgrow what the coordinators answer and later checks do not wait behind it.
func TestOverloadSendsOnlyWaitedRefills(t *testing.T) {
	coord := &slowCoordinator{grant: true}
	client := startSlow(t, coord, map[string]string{
		"LEASEBUCKET_AGENT_CALLS_IN_FLIGHT": "1",
		"LEASEBUCKET_AGENT_MAX_WAIT":        "10ms",
	})
	coldChecks(t, client)
	answered := time.Now()
	time.Sleep(150 * time.Millisecond) // the call in flight ends within 30 ms; a backlog would go on
	if last := time.Unix(0, coord.last.Load()); last.After(answered.Add(5 * time.Millisecond)) {
		t.Errorf("an Acquire arrived %v after every check had been answered (%d calls for 80 checks): refills no check waited for were sent",
			last.Sub(answered).Round(time.Millisecond), coord.calls.Load())
	}
}
