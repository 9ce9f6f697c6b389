package main

import (
	"context"
	"fmt"
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
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// slowCoordinator answers every Acquire unavailable after 30 ms, and counts the Acquires it holds
// at once.
type slowCoordinator struct {
	coordinatorv1.UnimplementedCoordinatorServiceServer
	in, peak, calls atomic.Int64
}

func (c *slowCoordinator) Acquire(ctx context.Context, _ *coordinatorv1.AcquireRequest) (*coordinatorv1.AcquireResponse, error) {
	n := c.in.Add(1)
	defer c.in.Add(-1)
	c.calls.Add(1)
	for p := c.peak.Load(); n > p && !c.peak.CompareAndSwap(p, n); p = c.peak.Load() {
	}
	select {
	case <-time.After(30 * time.Millisecond):
	case <-ctx.Done():
	}
	return nil, status.Error(codes.Unavailable, "slow coordinator")
}

// TestCallsInFlightBoundsCalls: the agent run with --calls-in-flight n (from its environment
// variable) never has more than n Acquires out to its coordinator, however many cold keys wait
// for a refill; with 1 its calls go one at a time, with 3 side by side.
func TestCallsInFlightBoundsCalls(t *testing.T) {
	for _, n := range []int{1, 3} {
		t.Run(strconv.Itoa(n), func(t *testing.T) {
			coord := &slowCoordinator{}
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
			defer g.Stop()

			dir, err := os.MkdirTemp("", "lba")
			if err != nil {
				t.Fatal(err)
			}
			defer os.RemoveAll(dir)
			socket := filepath.Join(dir, "agent.sock")
			env := map[string]string{
				"LEASEBUCKET_AGENT_SOCKET":             socket,
				"LEASEBUCKET_COORDINATORS":             ln.Addr().String(),
				"LEASEBUCKET_POLICY":                   filepath.Join("..", "..", "examples", "policy.yaml"),
				"LEASEBUCKET_AGENT_METRICS_LISTEN":     "",
				"LEASEBUCKET_AGENT_OVERRIDES_INTERVAL": "0",
				"LEASEBUCKET_AGENT_AUDIT_LOG":          "off",
				"LEASEBUCKET_AGENT_CALLS_IN_FLIGHT":    strconv.Itoa(n),
			}
			ctx, cancel := context.WithCancel(context.Background())
			var logs proctest.Buffer
			done := make(chan error, 1)
			go func() { done <- run(ctx, nil, func(k string) string { return env[k] }, &logs) }()
			defer func() {
				cancel()
				if err := <-done; err != nil {
					t.Errorf("run: %v\n%s", err, logs.String())
				}
			}()
			proctest.WaitFor(t, 10*time.Second, "the agent's socket", func() bool { return fileExists(socket) })

			conn, err := grpc.NewClient("unix:"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			client := agentv1.NewAgentServiceClient(conn)
			// Eight callers on keys of their own, each new: every check waits for a refill.
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
			if coord.calls.Load() < 2 {
				t.Fatalf("%d Acquires for 80 cold checks", coord.calls.Load())
			}
			if peak := coord.peak.Load(); peak > int64(n) || (n > 1 && peak < 2) {
				t.Errorf("at most %d Acquires out at once with --calls-in-flight %d (%d calls)", peak, n, coord.calls.Load())
			}
		})
	}
}
