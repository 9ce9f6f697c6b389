package stackbench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
)

// Binaries are the programs the benchmark runs: cmd/agent, cmd/coordinator and the empty
// handler (emptyagent), built by proctest.Binaries.
type Binaries struct {
	Agent, Coordinator, Empty string
}

// Target is what a load runs against: a Stack or an EmptyServer.
type Target interface {
	// Sockets are the Unix sockets the checks go to: one per agent, the load's callers spread
	// evenly over them.
	Sockets() []string
	// Sample reads the target's counters. With procsFirst the processes' CPU times are read
	// before Redis and the metrics endpoints (the end of a phase), else after them (its start):
	// the probes' own work falls outside the CPU window.
	Sample(ctx context.Context, procsFirst bool) (Sample, error)
}

// Proc indexes the processes whose CPU a Sample holds.
type Proc int

// Processes.
const (
	ProcAgent       Proc = iota // cmd/agent, or the empty handler
	ProcCoordinator             // cmd/coordinator
	ProcRedis                   // redis-server
	ProcClient                  // this process: the load generator
	numProcs
)

// Sample is a reading of a target's counters.
type Sample struct {
	CPU      [numProcs]time.Duration // utime+stime so far; zero for a process the target lacks
	Redis    RedisStats
	StoreOps float64 // items of the coordinator's calls: each is one store operation
	Calls    float64 // the coordinator's Acquire and Return calls
	// Mallocs and Bytes are this process's heap allocations so far (runtime.MemStats).
	Mallocs, Bytes uint64
	AgentGC        GCCPU // the agents' garbage collectors, summed; zero for the empty handler
}

// GCCPU is what the Go runtime of a process estimates its garbage collector took of its CPU so
// far (go_cpu_classes_gc_total_cpu_seconds_total), and Busy all the CPU its goroutines and its
// runtime took (go_cpu_classes_total less go_cpu_classes_idle), in seconds: the runtime's own
// estimates, compared with each other only (internal/cli.RuntimeCollectors). The runtime brings
// them up to date when a collection ends, so between two readings they count the time between
// the last collections before each, and nothing when no collection ended in between.
type GCCPU struct{ GC, Busy float64 }

// gcMetrics are the counters GCCPU is read from: the collector's, the total and the idle.
var gcMetrics = []string{
	"go_cpu_classes_gc_total_cpu_seconds_total",
	"go_cpu_classes_total_cpu_seconds_total",
	"go_cpu_classes_idle_cpu_seconds_total",
}

// Percent is the collector's share of the busy CPU, in %; 0 over none.
func (g GCCPU) Percent() float64 {
	if g.Busy <= 0 {
		return 0
	}
	return 100 * g.GC / g.Busy
}

// agentGC reads the GCCPU of every agent of s, summed.
func (s *Stack) agentGC(ctx context.Context) (GCCPU, error) {
	v, err := s.agentSums(ctx, gcMetrics...)
	if err != nil {
		return GCCPU{}, err
	}
	return GCCPU{GC: v[0], Busy: v[1] - v[2]}, nil
}

// agentSums is the sum over the agents of s of each of names (ScrapeSums, one scrape an agent).
func (s *Stack) agentSums(ctx context.Context, names ...string) ([]float64, error) {
	sums := make([]float64, len(names))
	for _, addr := range s.agentMetrics {
		v, err := ScrapeSums(ctx, addr, names...)
		if err != nil {
			return nil, err
		}
		for i := range sums {
			sums[i] += v[i]
		}
	}
	return sums, nil
}

// Stack is one redis-server (its own, on a free port), one coordinator on it and one or more
// agents on that coordinator, all separate processes, with one policy file.
type Stack struct {
	dir          string
	sockets      []string // each agent's
	probe        *RedisProbe
	pids         procs
	coordMetrics string   // host:port of the coordinator's /metrics
	agentMetrics []string // host:port of each agent's /metrics
	coord        *proctest.Process
}

// StartStack starts a stack of one agent with the policy file policy. Everything is stopped when
// t ends.
func StartStack(t testing.TB, bin Binaries, policy []byte) *Stack {
	return StartStackAgents(t, bin, policy, 1)
}

// StartStackAgents starts a stack of agents agents (at least one), each on a Unix socket of its
// own, all on the one coordinator, as the nodes of a fleet share their coordinators and Redis.
func StartStackAgents(t testing.TB, bin Binaries, policy []byte, agents int) *Stack {
	t.Helper()
	s := &Stack{dir: socketDir(t)}
	polFile := filepath.Join(s.dir, "policy.yaml")
	if err := os.WriteFile(polFile, policy, 0o600); err != nil {
		t.Fatal(err)
	}
	srv := redistest.Start(t)
	probe, redisPid, err := NewRedisProbe(context.Background(), srv.Options())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = probe.Close() })
	s.probe = probe
	s.pids[ProcRedis] = []int{redisPid}

	listen := proctest.FreeAddr(t)
	s.coordMetrics = proctest.FreeAddr(t)
	// Runtime overrides are not part of what is measured: the coordinator's poll of them (one
	// script run every --overrides-interval) is put off beyond any run, so every script Redis runs
	// is a store operation of the checks.
	s.coord = proctest.Start(t, bin.Coordinator, "--listen", listen, "--metrics-listen", s.coordMetrics,
		"--policy", polFile, "--redis-addrs", srv.Addr(), "--overrides-interval", "1h")
	proctest.WaitTCP(t, listen)
	proctest.WaitTCP(t, s.coordMetrics)
	s.pids[ProcCoordinator] = []int{s.coord.Pid()}

	for i := range max(1, agents) {
		socket := filepath.Join(s.dir, "agent"+strconv.Itoa(i)+".sock")
		metrics := proctest.FreeAddr(t)
		a := proctest.Start(t, bin.Agent, "--socket", socket, "--coordinators", listen,
			"--policy", polFile, "--metrics-listen", metrics, "--overrides-interval", "0")
		a.LogField(t, "agent serving", "policy_version")
		s.sockets = append(s.sockets, socket)
		s.agentMetrics = append(s.agentMetrics, metrics)
		s.pids[ProcAgent] = append(s.pids[ProcAgent], a.Pid())
	}
	return s
}

// Sockets are the agents' Unix sockets.
func (s *Stack) Sockets() []string { return s.sockets }

// AgentMetric is the sum over the agents of their metric name's samples labelled with match.
func (s *Stack) AgentMetric(ctx context.Context, name string, match ...string) (float64, error) {
	var sum float64
	for i := range s.agentMetrics {
		v, err := s.AgentMetricAt(ctx, i, name, match...)
		if err != nil {
			return 0, err
		}
		sum += v
	}
	return sum, nil
}

// AgentMetricAt is AgentMetric of the i-th agent alone (Sockets()[i]'s).
func (s *Stack) AgentMetricAt(ctx context.Context, i int, name string, match ...string) (float64, error) {
	return ScrapeSum(ctx, s.agentMetrics[i], name, match...)
}

// Quiet waits until no agent of the stack has a refill queued, a lease queued to be handed
// back or a coordinator call in flight, polling every 10 ms, for at most limit. A warm pass whose
// checks outran the stack leaves such work behind (its checks gave up after the agents' wait and
// were answered unavailable); a measurement begun before it is done would count its store
// operations and wait behind it.
func (s *Stack) Quiet(ctx context.Context, limit time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	busy := -1.0 // the last reading: refills, hand-backs and calls over the agents
	for {
		v, err := s.agentSums(ctx, quietMetrics...)
		if err == nil {
			busy = 0
			for _, n := range v {
				busy += n
			}
			if busy == 0 {
				return nil
			}
			err = sleep(ctx, 10*time.Millisecond)
		}
		if err != nil {
			if ctx.Err() != nil {
				return fmt.Errorf("stackbench: agents still busy after %v (%.0f refills, hand-backs and calls at the last reading)", limit, busy)
			}
			return err
		}
	}
}

// quietMetrics are the agent's gauges of work left: refills queued, leases queued to be handed
// back, coordinator calls in flight.
var quietMetrics = []string{"leasebucket_agent_queued_refills", "leasebucket_agent_queued_returns", "leasebucket_agent_coordinator_calls_in_flight"}

// CoordinatorMetric is the sum of the coordinator's metric name over the samples labelled with
// match.
func (s *Stack) CoordinatorMetric(ctx context.Context, name string, match ...string) (float64, error) {
	return ScrapeSum(ctx, s.coordMetrics, name, match...)
}

// storeOpsMetric counts, by method and status, the items of the coordinator's calls: each item
// the coordinator accepts is one store operation (one script run in Redis). Items it rejects
// before the store (unknown route, malformed) are counted too; a benchmark sends none.
const storeOpsMetric = "leasebucket_coordinator_items_total"

// callsMetric counts the coordinator's Acquire and Return calls (the batch-size histogram's count).
const callsMetric = "leasebucket_coordinator_batch_items_count"

// Sample reads the counters of the three processes and this one.
func (s *Stack) Sample(ctx context.Context, procsFirst bool) (Sample, error) {
	var out Sample
	var errs [4]error
	others := func() {
		out.StoreOps, errs[0] = s.CoordinatorMetric(ctx, storeOpsMetric)
		out.Calls, errs[2] = s.CoordinatorMetric(ctx, callsMetric)
		out.Redis, errs[1] = s.probe.Stats(ctx)
		out.AgentGC, errs[3] = s.agentGC(ctx)
	}
	if !procsFirst {
		others()
	}
	err := readProcs(&out, s.pids)
	if procsFirst {
		others()
	}
	return out, errors.Join(err, errs[0], errs[1], errs[2], errs[3])
}

// procs are the process ids of each Proc a target runs (several agents of a fleet are one
// ProcAgent); ProcClient's is this process, whatever the list holds.
type procs [numProcs][]int

// readProcs reads the CPU time of the processes of pids, summed by Proc, this process's as
// ProcClient, and this process's allocations.
func readProcs(out *Sample, pids procs) error {
	pids[ProcClient] = []int{0} // ProcCPU(0): this process
	var errs []error
	for p, list := range pids {
		for _, pid := range list {
			cpu, err := ProcCPU(pid)
			out.CPU[p] += cpu
			errs = append(errs, err)
		}
	}
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	out.Mallocs, out.Bytes = ms.Mallocs, ms.TotalAlloc
	return errors.Join(errs...)
}

// EmptyServer is the empty handler (emptyagent) on a Unix socket of its own.
type EmptyServer struct {
	socket string
	pids   procs
}

// StartEmpty starts the empty handler; it is stopped when t ends.
func StartEmpty(t testing.TB, bin Binaries) *EmptyServer {
	t.Helper()
	e := &EmptyServer{socket: filepath.Join(socketDir(t), "empty.sock")}
	p := proctest.Start(t, bin.Empty, "--socket", e.socket)
	p.LogField(t, "serving", "socket")
	e.pids[ProcAgent] = []int{p.Pid()}
	return e
}

// Sockets is the empty handler's Unix socket.
func (e *EmptyServer) Sockets() []string { return []string{e.socket} }

// Sample reads the empty handler's CPU time (as ProcAgent) and this process's.
func (e *EmptyServer) Sample(context.Context, bool) (Sample, error) {
	var out Sample
	err := readProcs(&out, e.pids)
	return out, err
}

// socketDir is a new directory with a short path (a Unix socket's path has at most 108 bytes),
// removed when t ends.
func socketDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "lbsb")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}

// Settle is how long the benchmark lets a stack rest after its warm pass, for the leases the pass
// took to expire and be returned: four lease lifetimes of the benchmark's rules (250 ms).
const Settle = time.Second
