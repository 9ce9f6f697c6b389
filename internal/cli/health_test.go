package cli

import (
	"context"
	"net"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// TestServeHealth: the health port answers the command's status as it changes, and nothing else;
// stop closes it.
func TestServeHealth(t *testing.T) {
	hs := health.NewServer()
	hs.SetServingStatus("svc", healthpb.HealthCheckResponse_SERVING)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	stop := ServeHealth(ln, hs, zaptest.NewLogger(t))
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := healthpb.NewHealthClient(conn)
	check := func(service string) (healthpb.HealthCheckResponse_ServingStatus, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		resp, err := client.Check(ctx, &healthpb.HealthCheckRequest{Service: service})
		return resp.GetStatus(), err
	}
	if st, err := check("svc"); err != nil || st != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("Check(svc) = %v, %v; want SERVING", st, err)
	}
	hs.SetServingStatus("svc", healthpb.HealthCheckResponse_NOT_SERVING)
	if st, err := check("svc"); err != nil || st != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf("Check(svc) after the change = %v, %v; want NOT_SERVING", st, err)
	}
	if _, err := check("other"); err == nil {
		t.Error("Check(other): no error for a service the command does not report")
	}
	stop()
	if c, err := net.DialTimeout("tcp", ln.Addr().String(), time.Second); err == nil {
		c.Close()
		t.Error("the health port accepts connections after stop")
	}
}
