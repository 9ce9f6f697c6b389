package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
	"github.com/leasebucket/leasebucket/policy"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

// TestHelpEdges: --help documents the edges' flags.
func TestHelpEdges(t *testing.T) {
	var out bytes.Buffer
	if err := run(context.Background(), []string{"--help"}, noEnv, &out); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"envoy.service.ratelimit.v3.RateLimitService", "-idempotency-window", "LEASEBUCKET_AGENT_IDEMPOTENCY_WINDOW",
		"default 2m0s)", "-idempotency-keys", "-audit-log", "default stdout)", "-audit-sample-allow", "default 0.001)",
		"-audit-queue", "-debug-listen", "LEASEBUCKET_AGENT_DEBUG_LISTEN"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("--help does not mention %q", want)
		}
	}
}

func TestEdgeFlagErrors(t *testing.T) {
	policyFile := filepath.Join("..", "..", "examples", "policy.yaml")
	dir := t.TempDir()
	base := []string{"--coordinators", "127.0.0.1:1", "--policy", policyFile, "--metrics-listen", "",
		"--socket", filepath.Join(shortDir(t), "a.sock"), "--audit-log", "off"}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--audit-sample-allow", "1.5"}, "--audit-sample-allow must be between 0 and 1"},
		{[]string{"--idempotency-window", "10ms"}, "--idempotency-window must be 0 (off) or at least 1s"},
		{[]string{"--idempotency-window", "2s", "--max-wait", "1500ms"}, "twice --max-wait"},
		{[]string{"--audit-queue", "0"}, "must be positive"},
		{[]string{"--debug-listen", "0.0.0.0:7073"}, "loopback address only"},
		{[]string{"--debug-listen", ":7073"}, "loopback address only"},
		{[]string{"--audit-log", filepath.Join(dir, "missing", "audit.log")}, "--audit-log"},
	} {
		err := run(context.Background(), append(append([]string(nil), base...), tc.args...), noEnv, &bytes.Buffer{})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("run(%q) = %v, want an error about %q", tc.args, err, tc.want)
		}
	}
}

// shortDir is a temporary directory with a path short enough for a Unix socket.
func shortDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "lbe")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// logField finds the first JSON log record with msg and returns its field.
func logField(logs *proctest.Buffer, msg, field string) (any, bool) {
	for _, m := range logs.Records() {
		if m["msg"] == msg {
			v, ok := m[field]
			return v, ok
		}
	}
	return nil, false
}

// TestRunEdges runs the agent in process with an audit file, the debug endpoint and a TCP
// listener: Envoy's rate limit service answers the card's example on the socket and over TCP,
// CheckStream answers, the debug endpoint lists the lease, and at shutdown the audit file holds
// every deny with its fields.
func TestRunEdges(t *testing.T) {
	policyFile := filepath.Join("..", "..", "examples", "policy.yaml")
	set, err := policy.Parse(policyFile, mustRead(t, policyFile))
	if err != nil {
		t.Fatal(err)
	}
	store := memstore.New(memstore.WithClock(func() bucket.Millis { return 1_000_000 }))
	csrv := coordinator.NewServer(coordinator.NewService(store, set), coordinator.ServerOptions{})
	cln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cctx, stopCoordinator := context.WithCancel(context.Background())
	coordinatorDone := make(chan struct{})
	go func() { _ = csrv.Serve(cctx, cln); close(coordinatorDone) }()
	defer func() { stopCoordinator(); <-coordinatorDone }()

	dir := shortDir(t)
	socket, auditLog := filepath.Join(dir, "agent.sock"), filepath.Join(dir, "audit.log")
	args := []string{"--socket", socket, "--coordinators", cln.Addr().String(), "--policy", policyFile,
		"--metrics-listen", "", "--listen", "127.0.0.1:0", "--debug-listen", "127.0.0.1:0",
		"--audit-log", auditLog, "--audit-sample-allow", "0", "--max-wait", "1s"}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var logs proctest.Buffer
	done := make(chan error, 1)
	go func() { done <- run(ctx, args, noEnv, &logs) }()
	var listen, debugAddr any
	deadline := time.Now().Add(10 * time.Second)
	for {
		var ok1, ok2 bool
		listen, ok1 = logField(&logs, "agent serving", "listen")
		debugAddr, ok2 = logField(&logs, "debug endpoint", "addr")
		if ok1 && ok2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the agent did not start:\n%s", logs.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	addrs, _ := listen.([]any)
	if len(addrs) != 2 {
		t.Fatalf("listen %v, want the socket and TCP", listen)
	}
	dial := func(target string) *grpc.ClientConn {
		conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return conn
	}
	unixConn, tcpConn := dial("unix:"+socket), dial("passthrough:///"+addrs[1].(string))
	req := &ratelimitv3.RateLimitRequest{Domain: "leasebucket", Descriptors: []*commonv3.RateLimitDescriptor{{Entries: []*commonv3.RateLimitDescriptor_Entry{
		{Key: "tenant", Value: "acme"}, {Key: "path", Value: "/orders/7"}, {Key: "method", Value: "GET"}}}}}
	codes := map[ratelimitv3.RateLimitResponse_Code]int{}
	for i := range 25 {
		conn := unixConn
		if i%2 == 1 {
			conn = tcpConn
		}
		cctx, ccancel := context.WithTimeout(context.Background(), 5*time.Second)
		resp, err := ratelimitv3.NewRateLimitServiceClient(conn).ShouldRateLimit(cctx, req)
		ccancel()
		if err != nil {
			t.Fatalf("request %d: %v", i+1, err)
		}
		codes[resp.OverallCode]++
	}
	if codes[ratelimitv3.RateLimitResponse_OK] != 20 || codes[ratelimitv3.RateLimitResponse_OVER_LIMIT] != 5 {
		t.Fatalf("codes %v, want 20 OK then 5 OVER_LIMIT", codes)
	}

	sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer scancel()
	st, err := agentv1.NewAgentServiceClient(unixConn).CheckStream(sctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(&agentv1.CheckStreamRequest{Id: 9, Checks: []*agentv1.CheckRequest{{Tenant: "acme", Route: "/products/1", Operation: "GET"}}}); err != nil {
		t.Fatal(err)
	}
	if resp, err := st.Recv(); err != nil || resp.Id != 9 || resp.Results[0].Decision != agentv1.Decision_DECISION_ALLOW {
		t.Fatalf("stream answer = %v, %v", resp, err)
	}
	_ = st.CloseSend()

	// A key holds a lease once its demand shows over a sample (lease.MinSample): check it a few
	// times, then the debug endpoint lists the lease.
	var body []byte
	for i := 0; ; i++ {
		resp, err := agentv1.NewAgentServiceClient(unixConn).Check(sctx, &agentv1.CheckRequest{Tenant: "acme", Route: "/products/1", Operation: "GET"})
		if err != nil || resp.Decision != agentv1.Decision_DECISION_ALLOW {
			t.Fatalf("check %d = %v, %v", i, resp, err)
		}
		hresp, err := http.Get("http://" + debugAddr.(string) + "/debug/leases?tenant=acme")
		if err != nil {
			t.Fatal(err)
		}
		body, _ = io.ReadAll(hresp.Body)
		hresp.Body.Close()
		if hresp.StatusCode == http.StatusOK && strings.Contains(string(body), `"rule": "catalog-read"`) {
			break
		}
		if i == 20 {
			t.Fatalf("debug leases: %d\n%s", hresp.StatusCode, body)
		}
		time.Sleep(lease.MinSample / 2)
	}

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run: %v\n%s", err, logs.String())
		}
	case <-time.After(15 * time.Second):
		t.Fatalf("run did not return after cancel:\n%s", logs.String())
	}
	data := mustRead(t, auditLog)
	denies := 0
	for _, line := range bytes.Split(bytes.TrimSpace(data), []byte("\n")) {
		var ev map[string]any
		if err := json.Unmarshal(line, &ev); err != nil {
			t.Fatalf("audit line %q: %v", line, err)
		}
		if ev["decision"] != "deny" {
			t.Fatalf("audit event %v: allows are not sampled at rate 0", ev)
		}
		if ev["api"] != "envoy" || ev["rule"] != "orders-read" || ev["route"] != "/orders/{id}" || ev["operation"] != "read" ||
			ev["tenant"] != "acme" || ev["agent_id"] == "" || ev["retry_after_ms"].(float64) <= 0 {
			t.Fatalf("audit event %v", ev)
		}
		denies++
	}
	if denies != 5 {
		t.Fatalf("%d deny events in the audit log, want 5:\n%s", denies, data)
	}
}
