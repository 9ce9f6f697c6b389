package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/redisstore"
	"github.com/leasebucket/leasebucket/policy"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

// The end-to-end tests run real processes: agents built from this package, coordinators built
// from cmd/coordinator when it exists (otherwise coordinator.Server in process, on real TCP), a
// real redis-server (internal/redistest). Binaries are built once per test binary.

var (
	buildOnce sync.Once
	buildDir  string
	buildErr  error
)

// binaries builds cmd/agent (and cmd/coordinator if present) into a temporary directory.
func binaries(t testing.TB) (agentBin, coordinatorBin string) {
	t.Helper()
	buildOnce.Do(func() {
		buildDir, buildErr = os.MkdirTemp("", "lb-e2e-bin")
		if buildErr != nil {
			return
		}
		buildErr = goBuild(filepath.Join(buildDir, "agent"), ".")
		if buildErr == nil && fileExists("../coordinator/main.go") {
			buildErr = goBuild(filepath.Join(buildDir, "coordinator"), "../coordinator")
		}
	})
	if buildErr != nil {
		t.Fatalf("build: %v", buildErr)
	}
	agentBin = filepath.Join(buildDir, "agent")
	if fileExists(filepath.Join(buildDir, "coordinator")) {
		coordinatorBin = filepath.Join(buildDir, "coordinator")
	}
	return agentBin, coordinatorBin
}

func goBuild(out, pkg string) error {
	cmd := exec.Command("go", "build", "-o", out, pkg)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build %s: %w\n%s", pkg, err, b)
	}
	return nil
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// e2ePolicy: shared is the admission test's bucket (C = 20, r = 10/s, τ = 0.5 s); writes and
// reads fail closed and to an emergency bucket (leases of 15 s, long enough to outlive an
// outage's first checks); ledger barely refills (1 token a day), so its level in Redis is a
// ledger of what was granted.
const e2ePolicy = `
version: "e2e-1"
rules:
  - name: shared
    routes: ["/shared"]
    operations: [read]
    limit: 600/minute
    burst: 20
  - name: writes
    routes: ["/w/{id}"]
    operations: [write]
    limit: 60/minute
    burst: 60
    on_failure: deny
    retry_after_on_failure: 2s
  - name: reads
    routes: ["/r/{id}"]
    operations: [read]
    limit: 60/minute
    burst: 60
    on_failure: emergency
    emergency:
      limit: 6/minute
      burst: 3
  - name: ledger
    routes: ["/ledger"]
    operations: [read]
    limit: 1/day
    burst: 1000
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
	port := freePort(t)
	addr := "127.0.0.1:" + strconv.Itoa(port)
	cmd := exec.Command(bin, "--listen", addr, "--policy", policyFile, "--redis-addrs", redisAddr,
		"--metrics-listen", "", "--health-interval", "100ms", "--store-timeout", "500ms", "--redis-timeout", "500ms",
		"--redis-dial-timeout", "200ms")
	p := startProcess(t, cmd, "coordinator")
	waitTCP(t, addr)
	return &coordinatorNode{addr: addr, kill: p.kill}
}

func freePort(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func waitTCP(t testing.TB, addr string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", addr, 100*time.Millisecond)
		if err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not listening: %v", addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// process is a child process whose stderr is kept for failure messages.
type process struct {
	name   string
	cmd    *exec.Cmd
	stderr *lockedBuffer
	done   chan struct{}
	err    error
	lines  chan string // stderr lines, for readiness
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func startProcess(t testing.TB, cmd *exec.Cmd, name string) *process {
	t.Helper()
	p := &process{name: name, cmd: cmd, stderr: &lockedBuffer{}, done: make(chan struct{}), lines: make(chan string, 1024)}
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} // never outlive the test binary
	pr, pw := io.Pipe()
	cmd.Stderr = pw
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			line := sc.Text()
			p.stderr.Write([]byte(line + "\n"))
			select {
			case p.lines <- line:
			default:
			}
		}
		close(p.lines)
	}()
	go func() {
		p.err = cmd.Wait()
		pw.Close()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.kill()
		if t.Failed() {
			t.Logf("%s stderr:\n%s", name, lastLines(p.stderr.String(), 40))
		}
	})
	return p
}

// kill sends SIGKILL and waits for the process to be gone.
func (p *process) kill() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Kill()
	<-p.done
}

// terminate sends SIGTERM and waits for a graceful exit.
func (p *process) terminate(t testing.TB) {
	t.Helper()
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		if p.err != nil {
			t.Fatalf("%s exited with %v", p.name, p.err)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("%s ignored SIGTERM", p.name)
	}
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// agentNode is a running agent process with a client on its socket.
type agentNode struct {
	*process
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
	a := &agentNode{process: startProcess(t, exec.Command(bin, args...), "agent"), socket: socket}
	deadline := time.After(20 * time.Second)
	for a.metrics == "" || !fileExists(socket) {
		select {
		case line, ok := <-a.lines:
			if !ok {
				t.Fatalf("agent exited: %v\n%s", a.err, a.stderr)
			}
			var rec struct {
				Msg  string `json:"msg"`
				Addr string `json:"addr"`
			}
			if json.Unmarshal([]byte(line), &rec) == nil && rec.Msg == "metrics" {
				a.metrics = rec.Addr
			}
		case <-deadline:
			t.Fatalf("agent not ready:\n%s", a.stderr)
		}
	}
	go func() {
		for range a.lines { // keep draining so the agent never blocks on its stderr
		}
	}()
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
	resp, err := http.Get("http://" + a.metrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	t.Fatalf("metric %s not found", name)
	return 0
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
