package agent_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/agent/audit"
	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/policy"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

// benchServerEnv makes the test binary a benchmark's server process (see TestMain): it serves
// the agent and an empty handler on two Unix sockets in the directory the variable names.
const benchServerEnv = "LEASEBUCKET_BENCH_SERVER_DIR"

// benchPolicy never denies at the rates a benchmark reaches: every check is a lease spend.
const benchPolicy = `
version: "bench"
rules:
  - name: api
    routes: ["/api/*"]
    operations: [read]
    limit: 60000000/minute
    burst: 10000000
default:
  limit: 60/minute
  burst: 10
`

// emptyAgent answers every Check with an allow and nothing else: the cost of gRPC itself.
type emptyAgent struct {
	agentv1.UnimplementedAgentServiceServer
}

func (emptyAgent) Check(context.Context, *agentv1.CheckRequest) (*agentv1.CheckResponse, error) {
	return &agentv1.CheckResponse{Decision: agentv1.Decision_DECISION_ALLOW}, nil
}

// benchServerMain is the server process: the real agent (Limiter, Refresher, Server; its
// coordinator a Service on an in-memory store, in process) on agent.sock, the empty handler on
// empty.sock, both on the same kind of listener and gRPC server. It says "ready" on stdout and
// exits when stdin closes.
func benchServerMain() int {
	dir := os.Getenv(benchServerEnv)
	set, err := policy.Parse("bench.yaml", []byte(benchPolicy))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	clk := clock.NewCoarse(time.Millisecond)
	// Warnings (a failed refill) go to stderr: a benchmark that meets one fails, and says why.
	log, _ := zap.NewProduction(zap.IncreaseLevel(zap.WarnLevel))
	ref := agent.NewRefresher(agent.RefresherConfig{Coordinator: coordinator.NewService(memstore.New(), set), Clock: clk, Logger: log})
	lim := agent.New(agent.Config{AgentID: "bench", Guard: clock.Guard}, set)
	ref.Start(lim)
	// Audit as the agent runs by default: allows sampled at 0.1 %, everything else written, as
	// JSON (here to io.Discard).
	q, err := audit.New(audit.Config{SampleAllow: audit.DefaultSampleAllow, Sink: audit.NewJSONSink(zapcore.AddSync(io.Discard), "bench"), Clock: clk})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	q.Start()
	defer func() { _ = q.Close(context.Background()) }()
	srv := agent.NewServer(agent.ServerConfig{Limiter: lim, Clock: clk, Metrics: agent.NewMetrics(), Audit: q})
	var servers []*grpc.Server
	for _, name := range []string{"agent.sock", "empty.sock"} {
		ln, err := agent.ListenUnix(filepath.Join(dir, name), 0, -1)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		g := grpc.NewServer()
		if name == "agent.sock" {
			srv.Register(g)
		} else {
			agentv1.RegisterAgentServiceServer(g, emptyAgent{})
		}
		servers = append(servers, g)
		go func() { _ = g.Serve(ln) }()
	}
	fmt.Println("ready")
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	for _, g := range servers {
		g.Stop()
	}
	_ = ref.Stop(context.Background())
	clk.Close()
	return 0
}

// benchServer is a running server process.
type benchServer struct {
	cmd   *exec.Cmd
	stdin interface{ Close() error }
	dir   string
}

func startBenchServer(b *testing.B) *benchServer {
	b.Helper()
	exe, err := os.Executable()
	if err != nil {
		b.Fatal(err)
	}
	dir := shortTempDir(b)
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), benchServerEnv+"="+dir)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	s := &benchServer{cmd: cmd, stdin: stdin, dir: dir}
	b.Cleanup(func() {
		s.stdin.Close()
		_ = s.cmd.Wait()
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil || strings.TrimSpace(line) != "ready" {
		b.Fatalf("bench server: %q, %v", line, err)
	}
	return s
}

// cpu is the server process's user+system CPU time so far, from /proc/<pid>/stat (clock ticks,
// 100 per second on Linux).
func (s *benchServer) cpu(b *testing.B) time.Duration {
	b.Helper()
	return procCPU(b, fmt.Sprintf("/proc/%d/stat", s.cmd.Process.Pid))
}

// procCPU is the user+system CPU time in stat, a /proc/<pid>/stat file (clock ticks, 100 per
// second on Linux).
func procCPU(b *testing.B, stat string) time.Duration {
	b.Helper()
	data, err := os.ReadFile(stat)
	if err != nil {
		b.Fatal(err)
	}
	// Fields after the command name (in parentheses, which may hold spaces): state is field 3,
	// utime field 14, stime field 15.
	f := strings.Fields(string(data[strings.LastIndexByte(string(data), ')')+2:]))
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(utime+stime) * 10 * time.Millisecond
}

// dial connects to the server's Unix socket name; the connection is closed when b ends.
func (s *benchServer) dial(b *testing.B, name string) *grpc.ClientConn {
	b.Helper()
	conn, err := grpc.NewClient("unix:"+filepath.Join(s.dir, name), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { conn.Close() })
	return conn
}

// benchAudit is a started audit queue writing JSON to io.Discard, allows sampled at sample; it is
// closed when b ends.
func benchAudit(b *testing.B, sample float64, clk clock.Clock) *audit.Queue {
	b.Helper()
	q, err := audit.New(audit.Config{SampleAllow: sample, Sink: audit.NewJSONSink(zapcore.AddSync(io.Discard), "bench"), Clock: clk})
	if err != nil {
		b.Fatal(err)
	}
	q.Start()
	b.Cleanup(func() { _ = q.Close(context.Background()) })
	return q
}

// drive sends n checks over conn from c goroutines and returns the wall time.
func drive(b *testing.B, conn *grpc.ClientConn, n, c int) time.Duration {
	b.Helper()
	client := agentv1.NewAgentServiceClient(conn)
	var wg sync.WaitGroup
	start := time.Now()
	for g := range c {
		count := n / c
		if g < n%c {
			count++
		}
		req := &agentv1.CheckRequest{Tenant: fmt.Sprintf("tenant-%d", g), Route: "/api/items", Operation: "GET"}
		wg.Go(func() {
			for range count {
				resp, err := client.Check(context.Background(), req)
				if err != nil || resp.Decision != agentv1.Decision_DECISION_ALLOW {
					b.Errorf("Check = %v, %v", resp, err)
					return
				}
			}
		})
	}
	wg.Wait()
	return time.Since(start)
}

// BenchmarkUnixCheck compares the agent's Check over its Unix socket with an empty gRPC handler
// on the same kind of socket, served by one separate process, at concurrency 1, 16 and 64 (one
// client connection, as a gateway holds). Both run b.N calls in the same sub-benchmark, in
// alternating slices (so load from elsewhere on the machine falls on both alike), and the ratio
// compares the two throughputs of that run. ns/op is the agent's wall time per check; server CPU
// is the server process's utime+stime (/proc/<pid>/stat, 10 ms resolution) over each phase's
// slices, divided by its calls.
func BenchmarkUnixCheck(b *testing.B) {
	srv := startBenchServer(b)
	agentConn, emptyConn := srv.dial(b, "agent.sock"), srv.dial(b, "empty.sock")
	// Warm up both (connections, the agent's leases) before measuring.
	drive(b, agentConn, 2000, 64)
	drive(b, emptyConn, 2000, 64)
	for _, c := range []int{1, 16, 64} {
		b.Run(fmt.Sprintf("c=%d", c), func(b *testing.B) {
			const slices = 5
			n := b.N
			var emptyWall, agentWall, emptyCPU, agentCPU time.Duration
			for i := range slices {
				k := n / slices
				if i < n%slices {
					k++
				}
				cpu0 := srv.cpu(b)
				emptyWall += drive(b, emptyConn, k, c)
				cpu1 := srv.cpu(b)
				agentWall += drive(b, agentConn, k, c)
				cpu2 := srv.cpu(b)
				emptyCPU += cpu1 - cpu0
				agentCPU += cpu2 - cpu1
			}
			b.ReportMetric(float64(agentWall.Nanoseconds())/float64(n), "ns/op")
			b.ReportMetric(float64(n)/emptyWall.Seconds(), "empty-calls/s")
			b.ReportMetric(float64(n)/agentWall.Seconds(), "check-calls/s")
			b.ReportMetric(emptyWall.Seconds()/agentWall.Seconds(), "ratio")
			b.ReportMetric(float64(emptyCPU.Microseconds())/float64(n), "empty-srv-µs/call")
			b.ReportMetric(float64(agentCPU.Microseconds())/float64(n), "check-srv-µs/call")
		})
	}
}

// BenchmarkServerCheck is the agent's Check handler in process, without gRPC: the check path
// (Decide), its metrics and the response, on a live lease. The difference to the empty handler in
// BenchmarkUnixCheck is this, plus marshalling the larger response.
func BenchmarkServerCheck(b *testing.B) {
	benchServerCheck(b, benchPolicy)
}

// benchTwoLimitsPolicy is benchPolicy's rule with a second limit that never binds either: every
// check spends from two leases, all or nothing.
const benchTwoLimitsPolicy = `
version: "bench"
rules:
  - name: api
    routes: ["/api/*"]
    operations: [read]
    limits:
      - {limit: 60000000/minute, burst: 10000000}
      - {limit: 6000000000/hour, burst: 10000000}
default:
  limit: 60/minute
  burst: 10
`

// BenchmarkServerCheckTwoLimits is BenchmarkServerCheck on a rule of two limits: the agent's CPU
// for a check that charges two buckets, against one (the target: at most 1.3 times).
func BenchmarkServerCheckTwoLimits(b *testing.B) {
	benchServerCheck(b, benchTwoLimitsPolicy)
}

func benchServerCheck(b *testing.B, pol string) {
	s := newStack(b, parsePolicy(b, pol), stackOptions{})
	req := &agentv1.CheckRequest{Tenant: "acme", Route: "/api/items", Operation: "GET"}
	ctx := context.Background()
	for range 3 { // the first check of each bucket waits for its first lease
		if resp, err := s.srv.Check(ctx, req); err != nil {
			b.Fatal(err)
		} else if resp.Decision == agentv1.Decision_DECISION_ALLOW {
			break
		}
	}
	b.ReportAllocs()
	for b.Loop() {
		if resp, err := s.srv.Check(ctx, req); err != nil || resp.Decision != agentv1.Decision_DECISION_ALLOW {
			b.Fatal(resp, err)
		}
	}
}
