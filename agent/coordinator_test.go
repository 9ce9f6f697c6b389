package agent_test

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// countingCoordinator serves CoordinatorService and counts the Acquires it answers.
type countingCoordinator struct {
	coordinatorv1.UnimplementedCoordinatorServiceServer
	svc      *coordinator.Service
	acquires atomic.Int64
}

func (c *countingCoordinator) Acquire(ctx context.Context, req *coordinatorv1.AcquireRequest) (*coordinatorv1.AcquireResponse, error) {
	c.acquires.Add(1)
	return c.svc.Acquire(ctx, req)
}

type testCoordinatorServer struct {
	addr   string
	health *health.Server
	calls  *countingCoordinator
	stop   func()
}

func serveCoordinator(t *testing.T, svc *coordinator.Service) *testCoordinatorServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	c := &countingCoordinator{svc: svc}
	coordinatorv1.RegisterCoordinatorServiceServer(g, c)
	h := health.NewServer()
	h.SetServingStatus(coordinatorv1.CoordinatorService_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(g, h)
	done := make(chan struct{})
	go func() { _ = g.Serve(ln); close(done) }()
	s := &testCoordinatorServer{addr: ln.Addr().String(), health: h, calls: c}
	stopped := false
	s.stop = func() {
		if !stopped {
			stopped = true
			g.Stop()
			<-done
		}
	}
	t.Cleanup(s.stop)
	return s
}

// TestDialCoordinators: calls are spread over the coordinators of the list (round robin); one
// that reports NOT_SERVING for CoordinatorService gets none; one that dies is routed around, the
// calls that met it retried on another.
func TestDialCoordinators(t *testing.T) {
	set := loadPolicy(t, examplePolicy)
	svc := coordinator.NewService(memstore.New(), set)
	a, b := serveCoordinator(t, svc), serveCoordinator(t, svc)
	conn, err := agent.DialCoordinators([]string{a.addr, " " + b.addr}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := agent.CoordinatorClient(conn)
	seq := uint64(0)
	acquire := func() error {
		seq++
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := client.Acquire(ctx, &coordinatorv1.AcquireRequest{AgentId: "dial-test", Seq: seq, PolicyVersion: set.Version(),
			Items: []*coordinatorv1.AcquireItem{{Bucket: &coordinatorv1.BucketRef{Rule: "orders-read", Route: "/orders/{id}", Operation: "read", Tenant: "acme"}, NeededMicro: 1, MinMicro: 1}}})
		return err
	}
	// Round robin starts with the first connection ready, and takes in the other when it is.
	eventually(t, 5*time.Second, "both coordinators used", func() bool {
		if err := acquire(); err != nil {
			t.Fatal(err)
		}
		return a.calls.acquires.Load() > 0 && b.calls.acquires.Load() > 0
	})

	a.health.SetServingStatus(coordinatorv1.CoordinatorService_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_NOT_SERVING)
	before := a.calls.acquires.Load()
	eventually(t, 5*time.Second, "the unhealthy coordinator out of the rotation", func() bool {
		n := a.calls.acquires.Load()
		for range 10 {
			if err := acquire(); err != nil {
				t.Fatal(err)
			}
		}
		return a.calls.acquires.Load() == n
	})
	settled := a.calls.acquires.Load()
	for range 20 {
		if err := acquire(); err != nil {
			t.Fatal(err)
		}
	}
	if got := a.calls.acquires.Load(); got != settled {
		t.Fatalf("the NOT_SERVING coordinator got %d more calls", got-settled)
	}
	t.Logf("%d calls reached the coordinator after it reported NOT_SERVING, before the agent noticed", settled-before)

	// Back to SERVING, then killed: every call still succeeds.
	a.health.SetServingStatus(coordinatorv1.CoordinatorService_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)
	eventually(t, 5*time.Second, "the coordinator back in the rotation", func() bool {
		if err := acquire(); err != nil {
			t.Fatal(err)
		}
		return a.calls.acquires.Load() > settled
	})
	a.stop()
	for i := range 50 {
		if err := acquire(); err != nil {
			t.Fatalf("call %d after a coordinator died: %v", i, err)
		}
	}
}
