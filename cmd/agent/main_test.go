package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/coordinator/storetest"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
	"github.com/leasebucket/leasebucket/policy"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

func TestMain(m *testing.M) {
	code := m.Run()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			os.Stderr.WriteString("goroutines left behind: " + err.Error() + "\n")
			code = 1
		}
	}
	bins.Remove()
	os.Exit(code)
}

func noEnv(string) string { return "" }

// TestHelp: --help succeeds and documents every flag with its environment variable.
func TestHelp(t *testing.T) {
	var out bytes.Buffer
	if err := run(context.Background(), []string{"--help"}, noEnv, &out); err != nil {
		t.Fatalf("--help: %v", err)
	}
	if !strings.HasPrefix(out.String(), "Usage: agent [flags]\n") {
		t.Errorf("--help does not start with the usage line:\n%s", out.String())
	}
	for _, want := range []string{"\n  --socket string  (LEASEBUCKET_AGENT_SOCKET, default /run/leasebucket/agent.sock)\n",
		"--coordinators", "--policy", "--max-wait duration  (LEASEBUCKET_AGENT_MAX_WAIT, default 50ms)", "--max-keys", "--region",
		"--metrics-listen", "--health-listen", "LEASEBUCKET_AGENT_HEALTH_LISTEN", "--tls-ca", "--tls-cert", "--tls-key",
		"--listen", "--shutdown-timeout", "--policy-interval duration  (LEASEBUCKET_POLICY_INTERVAL, default 2s)",
		"--log-level", "--log-format", "--calls-in-flight int  (LEASEBUCKET_AGENT_CALLS_IN_FLIGHT, default 4)"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("--help does not mention %q", want)
		}
	}
}

func TestFlagErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{nil, nil, "--coordinators is required"},
		{[]string{"--coordinators", "x:1"}, nil, "--policy is required"},
		{[]string{"--coordinators", "x:1", "--policy", "p"}, map[string]string{"LEASEBUCKET_AGENT_MAX_WAIT": "soon"}, "LEASEBUCKET_AGENT_MAX_WAIT"},
		{[]string{"--coordinators", "x:1", "--policy", "p", "--max-keys", "0"}, nil, "--max-keys must be positive"},
		{[]string{"--coordinators", "x:1", "--policy", "p", "--calls-in-flight", "0"}, nil, "--calls-in-flight must be positive"},
		{[]string{"--coordinators", "x:1", "--policy", "p"}, map[string]string{"LEASEBUCKET_AGENT_CALLS_IN_FLIGHT": "-1"}, "--calls-in-flight must be positive"},
		{[]string{"--coordinators", "x:1", "--policy", "p", "extra"}, nil, "unexpected arguments"},
	} {
		getenv := func(k string) string { return tc.env[k] }
		err := run(context.Background(), tc.args, getenv, &bytes.Buffer{})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("run(%q) = %v, want an error about %q", tc.args, err, tc.want)
		}
	}
}

// TestCallsInFlight: --calls-in-flight defaults to the Refresher's DefaultMaxInFlight, is read
// from its environment variable, and the flag wins over the variable.
func TestCallsInFlight(t *testing.T) {
	base := []string{"--coordinators", "x:1", "--policy", "p"}
	for _, tc := range []struct {
		args []string
		env  string
		want int
	}{
		{nil, "", agent.DefaultMaxInFlight},
		{nil, "3", 3},
		{[]string{"--calls-in-flight", "1"}, "3", 1},
	} {
		getenv := func(k string) string {
			if k == "LEASEBUCKET_AGENT_CALLS_IN_FLIGHT" {
				return tc.env
			}
			return ""
		}
		cfg, err := parseFlags(append(base, tc.args...), getenv, io.Discard)
		if err != nil || cfg.callsInFlight != tc.want {
			t.Errorf("%q with $LEASEBUCKET_AGENT_CALLS_IN_FLIGHT=%q: %d calls in flight (%v), want %d", tc.args, tc.env, cfg.callsInFlight, err, tc.want)
		}
	}
}

// TestRunServesAndShutsDown runs the agent in process against a coordinator on an in-memory store
// whose clock stands still, from the environment alone: it answers on its socket, and on
// cancellation removes the socket, returns every lease (the bucket is back to its capacity less
// what was allowed) and leaves no goroutine behind (TestMain).
func TestRunServesAndShutsDown(t *testing.T) {
	policyFile := filepath.Join("..", "..", "examples", "policy.yaml")
	set, err := policy.Parse(policyFile, mustRead(t, policyFile))
	if err != nil {
		t.Fatal(err)
	}
	store := storetest.NewLevels(memstore.New(memstore.WithClock(func() bucket.Millis { return 1_000_000 })))
	csrv := coordinator.NewServer(coordinator.NewService(store, set), coordinator.ServerOptions{})
	cln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cctx, stopCoordinator := context.WithCancel(context.Background())
	coordinatorDone := make(chan struct{})
	go func() { _ = csrv.Serve(cctx, cln); close(coordinatorDone) }()
	defer func() { stopCoordinator(); <-coordinatorDone }()

	dir, err := os.MkdirTemp("", "lba")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	socket := filepath.Join(dir, "agent.sock")
	env := map[string]string{
		"LEASEBUCKET_AGENT_SOCKET":         socket,
		"LEASEBUCKET_COORDINATORS":         cln.Addr().String(),
		"LEASEBUCKET_POLICY":               policyFile,
		"LEASEBUCKET_AGENT_METRICS_LISTEN": "127.0.0.1:0",
		"LEASEBUCKET_AGENT_HEALTH_LISTEN":  "127.0.0.1:0",
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var logs proctest.Buffer
	done := make(chan error, 1)
	go func() { done <- run(ctx, nil, func(k string) string { return env[k] }, &logs) }()
	deadline := time.Now().Add(10 * time.Second)
	for !fileExists(socket) {
		if time.Now().After(deadline) {
			t.Fatalf("no socket:\n%s", logs.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	// A second agent on the same socket refuses to start; the first keeps serving.
	second := run(context.Background(), nil, func(k string) string { return env[k] }, &bytes.Buffer{})
	if !errors.Is(second, agent.ErrSocketInUse) {
		t.Fatalf("a second agent on the socket: %v, want ErrSocketInUse", second)
	}
	// The health port answers what the socket's health service says.
	var healthAddr string
	proctest.WaitFor(t, 10*time.Second, "the health port", func() bool {
		for _, r := range logs.Records() {
			if r["msg"] == "health serving" {
				healthAddr, _ = r["addr"].(string)
			}
		}
		return healthAddr != ""
	})
	hconn, err := grpc.NewClient(healthAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	hctx, hcancel := context.WithTimeout(context.Background(), 5*time.Second)
	hresp, err := healthpb.NewHealthClient(hconn).Check(hctx, &healthpb.HealthCheckRequest{Service: agentv1.AgentService_ServiceDesc.ServiceName})
	hcancel()
	hconn.Close()
	if err != nil || hresp.Status != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health on --health-listen %q: %v, %v; want SERVING", healthAddr, hresp, err)
	}
	conn, err := grpc.NewClient("unix:"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	client := agentv1.NewAgentServiceClient(conn)
	allowed := 0
	for range 10 {
		cctx, ccancel := context.WithTimeout(context.Background(), 5*time.Second)
		resp, err := client.Check(cctx, &agentv1.CheckRequest{Tenant: "acme", Route: "/products/9", Operation: "GET"})
		ccancel()
		if err != nil {
			t.Fatal(err)
		}
		if resp.Decision == agentv1.Decision_DECISION_ALLOW {
			allowed++
		}
	}
	conn.Close()
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run: %v\n%s", err, logs.String())
		}
	case <-time.After(15 * time.Second):
		t.Fatalf("run did not return after cancel:\n%s", logs.String())
	}
	if fileExists(socket) {
		t.Fatal("socket left behind")
	}
	if c, err := net.DialTimeout("tcp", healthAddr, time.Second); err == nil {
		c.Close()
		t.Fatal("the health port is still open after run returned")
	}
	if !strings.Contains(logs.String(), "leases returned") {
		t.Fatalf("no \"leases returned\" in the log:\n%s", logs.String())
	}
	r, _ := set.Match("/products/9", "GET")
	key, _ := set.Key(r, "acme", "")
	lvl, ok := store.Level(key)
	want := 60*bucket.PerToken - bucket.Micro(allowed)*bucket.PerToken
	if !ok || lvl != want {
		t.Fatalf("bucket holds %d µ after shutdown, want %d (capacity less %d allowed)", lvl, want, allowed)
	}
}
