package agent

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	_ "google.golang.org/grpc/health" // client-side health checking (healthCheckConfig below)
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"

	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// Coordinator is what the Refresher needs of the coordinators: the two calls of
// CoordinatorService. CoordinatorClient adapts a gRPC connection; the coordinator's Service
// implements it in process (the simulator and the benchmarks use that).
type Coordinator interface {
	Acquire(context.Context, *coordinatorv1.AcquireRequest) (*coordinatorv1.AcquireResponse, error)
	Return(context.Context, *coordinatorv1.ReturnRequest) (*coordinatorv1.ReturnResponse, error)
}

// CoordinatorClient is the Coordinator behind a gRPC connection (usually from DialCoordinators).
func CoordinatorClient(cc grpc.ClientConnInterface) Coordinator {
	return grpcCoordinator{coordinatorv1.NewCoordinatorServiceClient(cc)}
}

type grpcCoordinator struct {
	c coordinatorv1.CoordinatorServiceClient
}

func (g grpcCoordinator) Acquire(ctx context.Context, req *coordinatorv1.AcquireRequest) (*coordinatorv1.AcquireResponse, error) {
	return g.c.Acquire(ctx, req)
}

func (g grpcCoordinator) Return(ctx context.Context, req *coordinatorv1.ReturnRequest) (*coordinatorv1.ReturnResponse, error) {
	return g.c.Return(ctx, req)
}

// coordinatorServiceConfig spreads calls over every healthy coordinator (round_robin), watches
// each one with grpc.health.v1 (a coordinator reporting NOT_SERVING for CoordinatorService — it
// lost its store — or one whose connection failed gets no calls until it recovers; one without the
// health service counts as healthy), and
// retries a call that failed with UNAVAILABLE on another coordinator. Retrying is safe: Acquire
// and Return are idempotent per (agent, seq), and a retry carries the same seq.
const coordinatorServiceConfig = `{
  "loadBalancingConfig": [{"round_robin": {}}],
  "healthCheckConfig": {"serviceName": "leasebucket.coordinator.v1.CoordinatorService"},
  "methodConfig": [{
    "name": [{"service": "leasebucket.coordinator.v1.CoordinatorService"}],
    "retryPolicy": {
      "maxAttempts": 3,
      "initialBackoff": "0.005s",
      "maxBackoff": "0.05s",
      "backoffMultiplier": 2,
      "retryableStatusCodes": ["UNAVAILABLE"]
    }
  }]
}`

// keepaliveTime is how often an idle connection to a coordinator is pinged, so a coordinator that
// vanished without closing its connections (a partition, a dead host) is noticed within
// keepaliveTime + keepaliveTimeout rather than at the next call's timeout. Coordinators accept a
// ping every 10 s at most.
const (
	keepaliveTime    = 20 * time.Second
	keepaliveTimeout = 5 * time.Second
)

// reconnectBackoff is how an agent reconnects to a coordinator it lost: gRPC's default backoff
// (1 s, growing to 120 s) would keep an agent in its failure modes for up to two minutes after
// the coordinators came back from an outage. Reconnecting every 2 s at most costs a failed dial
// per coordinator each 2 s while they are down.
var reconnectBackoff = grpc.ConnectParams{
	Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 2 * time.Second},
	MinConnectTimeout: time.Second,
}

// coordinatorScheme names the resolver of an explicit list of coordinator addresses.
const coordinatorScheme = "leasebucket-coordinators"

// DialCoordinators returns a client connection to the coordinators. targets is either a list of
// host:port addresses (every one is used) or a single target: host:port is resolved through DNS
// (every address of the name is used, re-resolved when connections fail), and a target with a
// scheme ("dns:///coordinator.svc:7000", "unix:///run/coordinator.sock") is passed to gRPC as is.
// tlsConfig nil means plaintext (a local stack); otherwise see tlsconfig.Client for mutual TLS.
func DialCoordinators(targets []string, tlsConfig *tls.Config, opts ...grpc.DialOption) (*grpc.ClientConn, error) {
	var clean []string
	for _, t := range targets {
		if t = strings.TrimSpace(t); t != "" {
			clean = append(clean, t)
		}
	}
	if len(clean) == 0 {
		return nil, errors.New("agent: no coordinator address")
	}
	creds := insecure.NewCredentials()
	if tlsConfig != nil {
		creds = credentials.NewTLS(tlsConfig)
	}
	opts = append([]grpc.DialOption{
		grpc.WithTransportCredentials(creds),
		grpc.WithDefaultServiceConfig(coordinatorServiceConfig),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: keepaliveTime, Timeout: keepaliveTimeout, PermitWithoutStream: true}),
		grpc.WithConnectParams(reconnectBackoff),
	}, opts...)
	var target string
	switch {
	case len(clean) == 1 && strings.Contains(clean[0], ":///"):
		target = clean[0]
	case len(clean) == 1:
		target = "dns:///" + clean[0]
	default:
		r := manual.NewBuilderWithScheme(coordinatorScheme)
		addrs := make([]resolver.Address, len(clean))
		for i, a := range clean {
			if strings.Contains(a, "://") {
				return nil, fmt.Errorf("agent: coordinator %q: a list takes host:port addresses; give a single target for a scheme", a)
			}
			addrs[i] = resolver.Address{Addr: a}
		}
		r.InitialState(resolver.State{Addresses: addrs})
		target = coordinatorScheme + ":///coordinators"
		opts = append(opts, grpc.WithResolvers(r))
	}
	cc, err := grpc.NewClient(target, opts...)
	if err != nil {
		return nil, fmt.Errorf("agent: coordinators %v: %w", clean, err)
	}
	return cc, nil
}
