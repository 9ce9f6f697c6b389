package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/policy"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// startAgent serves an agent in process on a socket, its coordinator a Service over an in-memory
// store whose clock stands still.
func startAgent(t *testing.T) string {
	t.Helper()
	file := filepath.Join("..", "..", "examples", "policy.yaml")
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	set, err := policy.Parse(file, data)
	if err != nil {
		t.Fatal(err)
	}
	store := memstore.New(memstore.WithClock(func() bucket.Millis { return 1_000_000 }))
	clk := clock.NewCoarse(time.Millisecond)
	ref := agent.NewRefresher(agent.RefresherConfig{Coordinator: coordinator.NewService(store, set), Clock: clk})
	lim := agent.New(agent.Config{AgentID: "lbcheck-test", Guard: clock.Guard}, set)
	ref.Start(lim)
	dir, err := os.MkdirTemp("", "lbc")
	if err != nil {
		t.Fatal(err)
	}
	socket := filepath.Join(dir, "agent.sock")
	ln, err := agent.ListenUnix(socket, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	agent.NewServer(agent.ServerConfig{Limiter: lim, Clock: clk}).Register(g)
	served := make(chan struct{})
	go func() { _ = g.Serve(ln); close(served) }()
	t.Cleanup(func() {
		g.Stop()
		<-served
		_ = ref.Stop(context.Background())
		clk.Close()
		os.RemoveAll(dir)
	})
	return socket
}

// TestCardExample: the README's command prints 20 allows, then 429s with a Retry-After: 1 s (a
// token per 600 ms), or up to the longest pace (three quarters of τ = 3 s, rounded up) when the
// checks outlasted the agent's first demand sample (100 ms, a loaded machine) and it competed for
// the low bucket.
func TestCardExample(t *testing.T) {
	socket := startAgent(t)
	var out, errs bytes.Buffer
	args := []string{"--agent-socket", socket, "-n", "25", "tenant=acme", "route=/orders/7", "op=GET"}
	if err := run(context.Background(), args, func(string) string { return "" }, &out, &errs); err != nil {
		t.Fatalf("run: %v\n%s", err, errs.String())
	}
	if errs.Len() != 0 {
		t.Errorf("stderr: %q", errs.String())
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 25 {
		t.Fatalf("%d lines, want 25:\n%s", len(lines), out.String())
	}
	allow := regexp.MustCompile(`^ ?\d+  allow +remaining=\d+ limit=100/1m rule=orders-read$`)
	deny := regexp.MustCompile(`^\d+  deny \(429\)  Retry-After: [1-3] \(\d+ms\)  remaining=0 limit=100/1m rule=orders-read$`)
	for i, line := range lines {
		re := allow
		if i >= 20 {
			re = deny
		}
		if !re.MatchString(line) {
			t.Fatalf("line %d: %q does not match %v\n%s", i+1, line, re, out.String())
		}
	}
}

func TestErrors(t *testing.T) {
	socket := startAgent(t)
	env := func(k string) string {
		if k == "LEASEBUCKET_AGENT_SOCKET" {
			return socket
		}
		return ""
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"route=/orders/7", "op=GET"}, "tenant=, route= and op= are required"},
		{[]string{"tenant=acme", "route=/orders/7", "op=GET", "colour=blue"}, `unknown key "colour"`},
		{[]string{"tenant=acme", "route=/orders/7", "op=GET", "cost=21"}, "InvalidArgument"},
	} {
		err := run(context.Background(), tc.args, env, &bytes.Buffer{}, &bytes.Buffer{})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("run(%q) = %v, want an error containing %q", tc.args, err, tc.want)
		}
	}
}

// TestOldFlagNames: -socket and -addr, the names before --agent-socket and --agent-addr, still
// work and print a warning; both names of one flag are an error.
func TestOldFlagNames(t *testing.T) {
	socket := startAgent(t)
	noEnv := func(string) string { return "" }
	var out, errs bytes.Buffer
	if err := run(context.Background(), []string{"-socket", socket, "tenant=acme", "route=/orders/7", "op=GET"}, noEnv, &out, &errs); err != nil {
		t.Fatalf("-socket: %v", err)
	}
	if !strings.Contains(out.String(), "allow") {
		t.Errorf("-socket: %q", out.String())
	}
	if want := "lbcheck: warning: --socket is deprecated and goes in the next release: use --agent-socket\n"; errs.String() != want {
		t.Errorf("-socket: stderr %q, want %q", errs.String(), want)
	}
	errs.Reset()
	// The old TCP flag: nothing listens on port 1, so the check fails after the warning.
	err := run(context.Background(), []string{"-addr", "127.0.0.1:1", "--timeout", "100ms", "tenant=acme", "route=/orders/7", "op=GET"}, noEnv, &out, &errs)
	if err == nil || !strings.Contains(errs.String(), "--addr is deprecated") || !strings.Contains(errs.String(), "use --agent-addr") {
		t.Errorf("-addr: %v, stderr %q", err, errs.String())
	}
	err = run(context.Background(), []string{"-socket", socket, "--agent-socket", socket, "tenant=acme", "route=/orders/7", "op=GET"}, noEnv, &out, &errs)
	if err == nil || !strings.Contains(err.Error(), "--socket and --agent-socket are one flag") {
		t.Errorf("both names: %v", err)
	}
}

func TestHelp(t *testing.T) {
	var out bytes.Buffer
	if err := run(context.Background(), []string{"--help"}, func(string) string { return "" }, &out, &out); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"Usage: lbcheck [flags] ", "\n  --agent-socket socket  (LEASEBUCKET_AGENT_SOCKET, default /run/leasebucket/agent.sock)\n",
		"\n  --agent-addr address\n", "\n  --n number  (default 1)\n", "Deprecated names", "--socket ", "--addr "} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("--help lacks %q:\n%s", want, out.String())
		}
	}
}

// TestHealth: --health prints the agent's health status and succeeds only when it is SERVING.
func TestHealth(t *testing.T) {
	socket := startAgent(t)
	noenv := func(string) string { return "" }
	var out bytes.Buffer
	if err := run(context.Background(), []string{"--health", "--agent-socket", socket}, noenv, &out, &bytes.Buffer{}); err != nil {
		t.Fatalf("--health: %v", err)
	}
	if got := strings.TrimSpace(out.String()); got != "SERVING" {
		t.Errorf("--health printed %q, want SERVING", got)
	}
	out.Reset()
	args := []string{"--health", "--agent-socket", socket, "--service", "leasebucket.agent.v1.AgentService"}
	if err := run(context.Background(), args, noenv, &out, &bytes.Buffer{}); err != nil || strings.TrimSpace(out.String()) != "SERVING" {
		t.Errorf("--health --service AgentService: %v, printed %q; want SERVING", err, out.String())
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--health", "--agent-socket", socket, "tenant=acme"}, "--health takes no arguments"},
		{[]string{"--health", "--agent-socket", socket, "--service", "no.such.Service"}, "NotFound"},
		{[]string{"--health", "--agent-socket", filepath.Join(t.TempDir(), "none.sock")}, "Unavailable"},
	} {
		err := run(context.Background(), tc.args, noenv, &bytes.Buffer{}, &bytes.Buffer{})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("run(%q) = %v, want an error containing %q", tc.args, err, tc.want)
		}
	}
}
