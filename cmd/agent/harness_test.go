package main

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/redisstore"
	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
	"github.com/leasebucket/leasebucket/policy"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

// The end-to-end tests run real processes (internal/testkit/proctest): agents built from this package,
// coordinators built from cmd/coordinator when it exists (otherwise coordinator.Server in process,
// on real TCP), a real redis-server (internal/testkit/redistest). Binaries are built once per test binary.

// hasCoordinator: cmd/coordinator exists, and its binary runs the coordinators.
var hasCoordinator = fileExists("../coordinator/main.go")

// bins are cmd/agent and, if it exists, cmd/coordinator, built on first use.
var bins = proctest.NewBinaries(func() map[string]string {
	pkgs := map[string]string{"agent": "."}
	if hasCoordinator {
		pkgs["coordinator"] = "../coordinator"
	}
	return pkgs
}())

// binaries returns the paths of the agent and coordinator binaries ("" without cmd/coordinator).
func binaries(t testing.TB) (agentBin, coordinatorBin string) {
	t.Helper()
	agentBin = bins.Path(t, "agent")
	if hasCoordinator {
		coordinatorBin = bins.Path(t, "coordinator")
	}
	return agentBin, coordinatorBin
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// e2ePolicy: shared is the admission test's bucket (C = 20, r = 10/s, τ = 0.5 s); writes and
// reads fail closed and to an emergency bucket (leases of 15 s, long enough to outlive an
// outage's first checks, on buckets that the tests' checks never run low, so the agent is not paced
// when an outage begins); ledger barely refills (1 token a day), so its level in Redis is a
// ledger of what was granted. quota is the quota service's (C = 200, r = 20/s, τ = 2.5 s: a
// fresh lease backs one-second assignments).
const e2ePolicy = `
version: "e2e-1"
rules:
  - name: shared
    routes: ["/shared"]
    operations: [read]
    limit: 600/minute
    burst: 20
  - name: shared-direct
    routes: ["/shared-direct"]
    operations: [read]
    limit: 600/minute
    burst: 20
    lease: off
  - name: writes
    routes: ["/w/{id}"]
    operations: [write]
    limit: 60/second
    burst: 3600
    on_failure: deny
    retry_after_on_failure: 2s
  - name: reads
    routes: ["/r/{id}"]
    operations: [read]
    limit: 60/second
    burst: 3600
    on_failure: emergency
    emergency:
      limit: 6/minute
      burst: 3
  - name: ledger
    routes: ["/ledger"]
    operations: [read]
    limit: 1/day
    burst: 1000
  - name: quota
    routes: ["/quota/{id}"]
    operations: [read]
    limit: 20/second
    burst: 200
    on_failure: deny
default:
  limit: 60/minute
  burst: 10
`

func writePolicy(t testing.TB) (string, *policy.Set) {
	t.Helper()
	file := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(file, []byte(e2ePolicy), 0o600); err != nil {
		t.Fatal(err)
	}
	set, err := policy.Parse(file, []byte(e2ePolicy))
	if err != nil {
		t.Fatal(err)
	}
	return file, set
}

// coordinatorNode is one coordinator: a process, or a server in this process.
type coordinatorNode struct {
	addr string
	kill func()
}

// startCoordinator runs a coordinator on the Redis at redisAddr.
func startCoordinator(t testing.TB, policyFile, redisAddr string) *coordinatorNode {
	t.Helper()
	if _, bin := binaries(t); bin != "" {
		return startCoordinatorProcess(t, bin, policyFile, redisAddr)
	}
	set, err := policy.Parse(policyFile, mustRead(t, policyFile))
	if err != nil {
		t.Fatal(err)
	}
	client := redis.NewClient(&redis.Options{Addr: redisAddr, ContextTimeoutEnabled: true, MaxRetries: -1,
		DialTimeout: 200 * time.Millisecond, ReadTimeout: 500 * time.Millisecond})
	svc := coordinator.NewService(redisstore.New(client), set, coordinator.WithStoreTimeout(500*time.Millisecond))
	srv := coordinator.NewServer(svc, coordinator.ServerOptions{
		Probe:         func(ctx context.Context) error { return client.Ping(ctx).Err() },
		ProbeInterval: 100 * time.Millisecond,
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan struct{})
	go func() { _ = srv.Serve(ctx, ln); close(served) }()
	var once sync.Once
	n := &coordinatorNode{addr: ln.Addr().String(), kill: func() {
		once.Do(func() {
			cancel()
			<-served
			client.Close()
		})
	}}
	t.Cleanup(n.kill)
	return n
}

func startCoordinatorProcess(t testing.TB, bin, policyFile, redisAddr string) *coordinatorNode {
	t.Helper()
	addr := proctest.FreeAddr(t)
	p := proctest.Start(t, bin, "--listen", addr, "--policy", policyFile, "--redis-addrs", redisAddr,
		"--metrics-listen", "", "--health-interval", "100ms", "--store-timeout", "500ms", "--redis-timeout", "500ms",
		"--redis-dial-timeout", "200ms")
	proctest.WaitTCP(t, addr)
	return &coordinatorNode{addr: addr, kill: p.Kill}
}

// agentNode is a running agent process with a client on its socket.
type agentNode struct {
	*proctest.Process
	socket  string
	metrics string // host:port of /metrics
	client  agentv1.AgentServiceClient
}

// startAgent runs an agent against the coordinators.
func startAgent(t testing.TB, policyFile string, coordinators []*coordinatorNode, extra ...string) *agentNode {
	t.Helper()
	bin, _ := binaries(t)
	dir, err := os.MkdirTemp("", "lba")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	addrs := make([]string, len(coordinators))
	for i, c := range coordinators {
		addrs[i] = c.addr
	}
	socket := filepath.Join(dir, "agent.sock")
	args := append([]string{"--socket", socket, "--coordinators", strings.Join(addrs, ","), "--policy", policyFile,
		"--metrics-listen", "127.0.0.1:0", "--log-level", "info"}, extra...)
	if !slices.Contains(extra, "--max-wait") {
		// A check on a key without a lease waits for a refill: on a loaded test machine that can
		// outlast the production default, which would answer with the failure mode.
		args = append(args, "--max-wait", "1s")
	}
	p := proctest.Start(t, bin, args...)
	a := &agentNode{Process: p, socket: socket, metrics: p.LogField(t, "metrics", "addr")}
	p.Await(t, "socket "+socket, func() bool { return fileExists(socket) })
	conn, err := grpc.NewClient("unix:"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	a.client = agentv1.NewAgentServiceClient(conn)
	return a
}

func (a *agentNode) check(t testing.TB, tenant, route, op string) *agentv1.CheckResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := a.client.Check(ctx, &agentv1.CheckRequest{Tenant: tenant, Route: route, Operation: op})
	if err != nil {
		t.Fatalf("check %s %s %s: %v", tenant, route, op, err)
	}
	return resp
}

// metric reads one unlabelled metric from the agent's /metrics.
func (a *agentNode) metric(t testing.TB, name string) float64 {
	t.Helper()
	return proctest.Metric(t, a.metrics, name)
}

// settle waits until the agent has no call in flight and nothing queued (read twice in a row).
func (a *agentNode) settle(t testing.TB) {
	t.Helper()
	quiet := 0
	deadline := time.Now().Add(10 * time.Second)
	for quiet < 2 {
		if a.metric(t, "leasebucket_agent_coordinator_calls_in_flight") == 0 &&
			a.metric(t, "leasebucket_agent_queued_refills") == 0 && a.metric(t, "leasebucket_agent_queued_returns") == 0 {
			quiet++
		} else {
			quiet = 0
		}
		if time.Now().After(deadline) {
			t.Fatal("agent does not settle")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func mustRead(t testing.TB, file string) []byte {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
