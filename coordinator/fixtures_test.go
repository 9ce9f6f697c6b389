package coordinator_test

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/policy"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

func TestMain(m *testing.M) {
	redis.SetLogger(quiet{}) // dial failures are what the failure tests cause; they report their own
	goleak.VerifyTestMain(m, redisDialProbe)
}

// redisDialProbe ignores go-redis' dial probe: after dials to a dead server fail, a pool probes
// the server once a second until it answers or the pool is closed, so a probe may outlive its
// client's Close by up to a second.
var redisDialProbe = goleak.IgnoreAnyFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).tryDial")

type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}

var _ coordinator.Store = (*memstore.Store)(nil)

const tok = bucket.PerToken

// testPolicy is the policy of these tests, under version:
//
//	hot     200 tokens/s, burst 50: the budget tests' contended buckets
//	big     10^9 tokens/s, burst 10^9: never runs dry (benchmarks)
//	slow    100 tokens/day, burst 100000: refills less than a token per ten minutes, so a test
//	        can account for every microtoken
//	search  a regional rule with two slices
func testPolicy(version string) string {
	return fmt.Sprintf(`version: %q
rules:
  - name: hot
    routes: [/hot]
    operations: [read]
    limit: 200/second
    burst: 50
  - name: big
    routes: [/big]
    operations: [read]
    limit: 1000000000/second
    burst: 1000000000
  - name: slow
    routes: [/slow]
    operations: [read, write]
    limit: 100/day
    burst: 100000
  - name: search
    routes: [/search]
    operations: [read]
    limit: 300/minute
    burst: 30
    scope: regional
    regions:
      eu-west: {limit: 180/minute, burst: 18}
      us-east: {limit: 120/minute, burst: 12}
  - name: monthly
    routes: [/monthly]
    operations: [read]
    quota: 1000/month
default:
  limit: 60/minute
  burst: 10
`, version)
}

func mustPolicy(t testing.TB, version string) *policy.Set {
	t.Helper()
	set, err := policy.Parse("test-policy.yaml", []byte(testPolicy(version)))
	if err != nil {
		t.Fatal(err)
	}
	return set
}

// ref names the bucket of rule (a rule of testPolicy, routed at "/"+rule) for tenant.
func ref(rule, tenant string) *coordinatorv1.BucketRef {
	return &coordinatorv1.BucketRef{Rule: rule, Route: "/" + rule, Operation: "read", Tenant: tenant}
}

// key is the bucket key of ref under set.
func key(t testing.TB, set *policy.Set, r *coordinatorv1.BucketRef) string {
	t.Helper()
	route, ok := set.Lookup(r.Rule, r.Route, r.Operation)
	if !ok {
		t.Fatalf("no route %v", r)
	}
	k, err := set.Key(route, r.Tenant, r.Region)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// limit is the bucket limit of ref under set.
func limit(t testing.TB, set *policy.Set, r *coordinatorv1.BucketRef) bucket.Limit {
	t.Helper()
	route, ok := set.Lookup(r.Rule, r.Route, r.Operation)
	if !ok {
		t.Fatalf("no route %v", r)
	}
	l, err := set.Limits(route, r.Tenant, r.Region)
	if err != nil {
		t.Fatal(err)
	}
	return l.Bucket
}

func ctxFor(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// replica is one coordinator serving on loopback TCP.
type replica struct {
	svc    *coordinator.Service
	addr   string
	client coordinatorv1.CoordinatorServiceClient
	conn   *grpc.ClientConn
	stop   func() error // shuts the server down gracefully and returns Serve's error
}

// startReplica serves svc on a loopback port until the test ends (or stop) and dials it.
func startReplica(t testing.TB, svc *coordinator.Service, opts coordinator.ServerOptions, dial ...grpc.DialOption) *replica {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if opts.Logger == nil {
		opts.Logger = zaptest.NewLogger(t)
	}
	srv := coordinator.NewServer(svc, opts)
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx, lis) }()
	var stopped bool
	var stopErr error
	stop := func() error {
		if !stopped {
			stopped = true
			cancel()
			stopErr = <-served
		}
		return stopErr
	}
	r := &replica{svc: svc, addr: lis.Addr().String(), stop: stop}
	if len(dial) == 0 {
		dial = []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	}
	r.conn, err = grpc.NewClient(r.addr, dial...)
	if err != nil {
		t.Fatal(err)
	}
	r.client = coordinatorv1.NewCoordinatorServiceClient(r.conn)
	t.Cleanup(func() {
		_ = r.conn.Close()
		if err := stop(); err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return r
}

// acquire is an AcquireRequest of one agent.
func acquire(agent string, seq uint64, version string, items ...*coordinatorv1.AcquireItem) *coordinatorv1.AcquireRequest {
	return &coordinatorv1.AcquireRequest{AgentId: agent, Seq: seq, PolicyVersion: version, Items: items}
}

func item(r *coordinatorv1.BucketRef, want, least bucket.Micro) *coordinatorv1.AcquireItem {
	return &coordinatorv1.AcquireItem{Bucket: r, NeededMicro: int64(want), MinMicro: int64(least)}
}
