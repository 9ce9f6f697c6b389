package main

import (
	"bytes"
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
	"github.com/leasebucket/leasebucket/policy"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

func TestHelpOverrides(t *testing.T) {
	var out bytes.Buffer
	if err := run(context.Background(), []string{"--help"}, noEnv, &out); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"-overrides-interval", "LEASEBUCKET_AGENT_OVERRIDES_INTERVAL, default 2s)"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("--help does not mention %q", want)
		}
	}
	err := run(context.Background(), []string{"--coordinators", "x:1", "--policy", "p", "--overrides-interval", "-1s"}, noEnv, &bytes.Buffer{})
	if err == nil || !strings.Contains(err.Error(), "--overrides-interval must not be negative") {
		t.Errorf("negative --overrides-interval: %v", err)
	}
}

// TestRunFetchesOverrides: an agent started against a coordinator that holds a runtime override
// enforces it from its first check, under the coordinator's policy version.
func TestRunFetchesOverrides(t *testing.T) {
	policyFile := filepath.Join("..", "..", "examples", "policy.yaml")
	set, err := policy.Parse(policyFile, mustRead(t, policyFile))
	if err != nil {
		t.Fatal(err)
	}
	ovs := memstore.NewOverrides()
	var pol *coordinator.Policies
	svc := coordinator.NewService(memstore.New(), set, coordinator.WithUnknownVersion(func(v string) bool { return pol.Miss(v) }))
	pol = coordinator.NewPolicies(svc, set, ovs, nil, time.Second)
	o, err := set.CheckOverride("orders-read", "newco", "{limit: 6/1m, burst: 3}")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ovs.PutOverride(context.Background(), o, coordinator.DefaultOverridesBounds); err != nil {
		t.Fatal(err)
	}
	if err := pol.Refresh(context.Background()); err != nil {
		t.Fatal(err)
	}
	csrv := coordinator.NewServer(svc, coordinator.ServerOptions{Overrides: coordinator.NewOverridesServer(pol)})
	cln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cctx, stopCoordinator := context.WithCancel(context.Background())
	coordinatorDone := make(chan struct{})
	go func() { _ = csrv.Serve(cctx, cln); close(coordinatorDone) }()
	defer func() { stopCoordinator(); <-coordinatorDone }()

	dir, err := os.MkdirTemp("", "lbo")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	socket := filepath.Join(dir, "agent.sock")
	args := []string{"--socket", socket, "--coordinators", cln.Addr().String(), "--policy", policyFile,
		"--metrics-listen", "", "--audit-log", "off", "--overrides-interval", "50ms"}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	lw := &proctest.Buffer{}
	done := make(chan error, 1)
	go func() { done <- run(ctx, args, noEnv, lw) }()
	deadline := time.Now().Add(10 * time.Second)
	for !fileExists(socket) {
		if time.Now().After(deadline) {
			t.Fatalf("no socket:\n%s", lw.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	conn, err := grpc.NewClient("unix:"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := agentv1.NewAgentServiceClient(conn)
	var decisions []string
	for range 5 {
		cctx, ccancel := context.WithTimeout(context.Background(), 5*time.Second)
		resp, err := client.Check(cctx, &agentv1.CheckRequest{Tenant: "newco", Route: "/orders/7", Operation: "GET"})
		ccancel()
		if err != nil {
			t.Fatal(err)
		}
		decisions = append(decisions, resp.Decision.String())
	}
	allow, deny := agentv1.Decision_DECISION_ALLOW.String(), agentv1.Decision_DECISION_DENY.String()
	if want := []string{allow, allow, allow, deny, deny}; strings.Join(decisions, " ") != strings.Join(want, " ") {
		t.Errorf("newco with burst 3: %v, want %v\n%s", decisions, want, lw.String())
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run: %v\n%s", err, lw.String())
		}
	case <-time.After(15 * time.Second):
		t.Fatalf("run did not return after cancel:\n%s", lw.String())
	}
	if !strings.Contains(lw.String(), `"policy_version":"`+svc.Policy().Version()+`"`) {
		t.Errorf("the agent's log does not name the coordinator's version %s:\n%s", svc.Policy().Version(), lw.String())
	}
}
