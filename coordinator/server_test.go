package coordinator_test

import (
	"context"
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/internal/tlsconfig"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// watchHealth follows a replica's health status for service; statuses arrive on the channel,
// which closes when the stream ends.
func watchHealth(t *testing.T, r *replica, service string) <-chan healthpb.HealthCheckResponse_ServingStatus {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	stream, err := healthpb.NewHealthClient(r.conn).Watch(ctx, &healthpb.HealthCheckRequest{Service: service})
	if err != nil {
		t.Fatal(err)
	}
	ch := make(chan healthpb.HealthCheckResponse_ServingStatus, 16)
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer close(ch)
		for {
			m, err := stream.Recv()
			if err != nil {
				return
			}
			ch <- m.Status
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return ch
}

// await reads statuses until want arrives.
func await(t *testing.T, ch <-chan healthpb.HealthCheckResponse_ServingStatus, want healthpb.HealthCheckResponse_ServingStatus) {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case got, ok := <-ch:
			if !ok {
				t.Fatalf("health stream ended before %v", want)
			}
			if got == want {
				return
			}
		case <-timeout:
			t.Fatalf("no health status %v within 10 s", want)
		}
	}
}

func TestHealthFollowsProbe(t *testing.T) {
	var down atomic.Bool
	probe := func(ctx context.Context) error {
		if down.Load() {
			return errors.New("store down")
		}
		return nil
	}
	svc := coordinator.NewService(memstore.New(), mustPolicy(t, "v1"))
	r := startReplica(t, svc, coordinator.ServerOptions{Probe: probe, ProbeInterval: 10 * time.Millisecond})
	overall := watchHealth(t, r, "")
	named := watchHealth(t, r, coordinator.HealthService)
	await(t, overall, healthpb.HealthCheckResponse_SERVING)
	await(t, named, healthpb.HealthCheckResponse_SERVING)
	down.Store(true)
	await(t, overall, healthpb.HealthCheckResponse_NOT_SERVING)
	await(t, named, healthpb.HealthCheckResponse_NOT_SERVING)
	down.Store(false)
	await(t, overall, healthpb.HealthCheckResponse_SERVING)
	await(t, named, healthpb.HealthCheckResponse_SERVING)
}

// TestHealthStartsNotServing: a coordinator whose store does not answer at start never reports
// SERVING, even for an instant.
func TestHealthStartsNotServing(t *testing.T) {
	probe := func(ctx context.Context) error { return errors.New("store down") }
	svc := coordinator.NewService(memstore.New(), mustPolicy(t, "v1"))
	r := startReplica(t, svc, coordinator.ServerOptions{Probe: probe, ProbeInterval: time.Hour})
	resp, err := healthpb.NewHealthClient(r.conn).Check(ctxFor(t, 10*time.Second), &healthpb.HealthCheckRequest{Service: coordinator.HealthService})
	if err != nil || resp.Status != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf("Check = %v, %v, want NOT_SERVING", resp, err)
	}
}

// gateStore blocks every Take until released, and reports when one has started.
type gateStore struct {
	*memstore.Store
	started chan struct{}
	release chan struct{}
}

func (g *gateStore) Take(ctx context.Context, reqs []coordinator.TakeRequest) ([]coordinator.TakeResult, error) {
	g.started <- struct{}{}
	select {
	case <-g.release:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return g.Store.Take(ctx, reqs)
}

// TestGracefulShutdown: a batch in flight when the shutdown begins finishes and is answered; the
// health watch hears NOT_SERVING and ends; new calls are refused; Serve returns nil.
func TestGracefulShutdown(t *testing.T) {
	store := &gateStore{Store: memstore.New(), started: make(chan struct{}, 1), release: make(chan struct{})}
	svc := coordinator.NewService(store, mustPolicy(t, "v1"))
	r := startReplica(t, svc, coordinator.ServerOptions{ShutdownTimeout: time.Minute})
	health := watchHealth(t, r, coordinator.HealthService)
	await(t, health, healthpb.HealthCheckResponse_SERVING)

	type answer struct {
		resp *coordinatorv1.AcquireResponse
		err  error
	}
	inflight := make(chan answer, 1)
	go func() {
		resp, err := r.client.Acquire(context.Background(), acquire("a", 1, "v1", item(ref("hot", "a"), tok, tok)))
		inflight <- answer{resp, err}
	}()
	<-store.started
	stopped := make(chan error, 1)
	go func() { stopped <- r.stop() }()

	await(t, health, healthpb.HealthCheckResponse_NOT_SERVING)
	select {
	case _, ok := <-health:
		if ok {
			t.Fatal("health status after NOT_SERVING")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the health watch did not end at shutdown")
	}
	select {
	case err := <-stopped:
		t.Fatalf("Serve returned (%v) while a batch was in flight", err)
	case <-time.After(50 * time.Millisecond):
	}
	// A new connection is refused while the batch drains.
	conn, err := grpc.NewClient(r.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_, err = coordinatorv1.NewCoordinatorServiceClient(conn).Acquire(ctxFor(t, 2*time.Second), acquire("b", 1, "v1"))
	if status.Code(err) != codes.Unavailable {
		t.Errorf("Acquire on a new connection during shutdown: %v, want UNAVAILABLE", err)
	}

	close(store.release)
	a := <-inflight
	if a.err != nil || a.resp.Results[0].Status != coordinatorv1.Status_STATUS_OK {
		t.Fatalf("batch in flight at shutdown: %v, %v, want granted", a.resp, a.err)
	}
	if err := <-stopped; err != nil {
		t.Fatalf("Serve: %v", err)
	}
}

// TestShutdownTimeout: a batch that outlives ShutdownTimeout is cancelled and Serve returns.
func TestShutdownTimeout(t *testing.T) {
	store := &gateStore{Store: memstore.New(), started: make(chan struct{}, 1), release: make(chan struct{})}
	svc := coordinator.NewService(store, mustPolicy(t, "v1"))
	r := startReplica(t, svc, coordinator.ServerOptions{ShutdownTimeout: 100 * time.Millisecond})
	inflight := make(chan error, 1)
	go func() {
		_, err := r.client.Acquire(context.Background(), acquire("a", 1, "v1", item(ref("hot", "a"), tok, tok)))
		inflight <- err
	}()
	<-store.started
	start := time.Now()
	if err := r.stop(); err != nil {
		t.Fatalf("Serve: %v", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("shutdown took %v with a 100 ms timeout", d)
	}
	if err := <-inflight; err == nil {
		t.Error("the batch cut off by the shutdown timeout succeeded")
	}
}

func TestServeListenerFailure(t *testing.T) {
	svc := coordinator.NewService(memstore.New(), mustPolicy(t, "v1"))
	srv := coordinator.NewServer(svc, coordinator.ServerOptions{Logger: zaptest.NewLogger(t)})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	_ = lis.Close()
	if err := srv.Serve(context.Background(), lis); err == nil {
		t.Fatal("Serve on a closed listener returned nil")
	}
	if err := srv.Serve(context.Background(), lis); err == nil {
		t.Fatal("a second Serve returned nil")
	}
}

// TestMutualTLS: with a client CA configured only agents presenting a certificate of that CA are
// served; no certificate, another CA's certificate or plaintext are refused.
func TestMutualTLS(t *testing.T) {
	pki, err := tlsconfig.WriteTestPKI(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	serverTLS, err := tlsconfig.Server(pki.ServerCert, pki.ServerKey, pki.CA)
	if err != nil {
		t.Fatal(err)
	}
	svc := coordinator.NewService(memstore.New(), mustPolicy(t, "v1"))
	r := startReplica(t, svc, coordinator.ServerOptions{TLS: serverTLS})
	call := func(dial grpc.DialOption) error {
		conn, err := grpc.NewClient(r.addr, dial)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		_, err = coordinatorv1.NewCoordinatorServiceClient(conn).Acquire(ctxFor(t, 10*time.Second),
			acquire("a", 1, "v1", item(ref("hot", "a"), tok, tok)))
		return err
	}
	client := func(cert, key string) grpc.DialOption {
		cfg, err := tlsconfig.Client(pki.CA, cert, key, "")
		if err != nil {
			t.Fatal(err)
		}
		return grpc.WithTransportCredentials(credentials.NewTLS(cfg))
	}
	if err := call(client(pki.ClientCert, pki.ClientKey)); err != nil {
		t.Fatalf("agent with a certificate of the client CA: %v", err)
	}
	for name, dial := range map[string]grpc.DialOption{
		"no certificate":       client("", ""),
		"another CA":           client(pki.OtherCert, pki.OtherKey),
		"plaintext":            grpc.WithTransportCredentials(insecure.NewCredentials()),
		"server's certificate": client(pki.ServerCert, pki.ServerKey), // not for client authentication
	} {
		if err := call(dial); status.Code(err) != codes.Unavailable {
			t.Errorf("%s: %v, want the connection refused (UNAVAILABLE)", name, err)
		}
	}
}
