package stackbench_test

import (
	"context"
	"flag"
	"fmt"
	"os"
	"runtime"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/leasebucket/leasebucket/client"
	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
	sb "github.com/leasebucket/leasebucket/internal/testkit/stackbench"
)

var (
	measure = flag.Duration("stackbench.measure", 3*time.Second, "measured time of each run of BenchmarkStack")
	warmup  = flag.Duration("stackbench.warmup", time.Second, "warm-up of each run of BenchmarkStack, load running, nothing counted")
	rounds  = flag.Int("stackbench.rounds", 3, "BenchmarkStack: slices each run's measured time is cut into, the modes of a case and API taking turns")
	full    = flag.Bool("stackbench.full", false, "BenchmarkStack: native checks not sent brief, their allows answered with every RateLimit field (as for a rule with RateLimit headers on)")
	aa      = flag.Bool("stackbench.aa", false, "BenchmarkStack: A/A control, a second direct rule (mode control) on the same stack beside direct and lease, its ratios to direct the comparison's own noise; in the hot-key case a second empty handler too (mode empty-control)")
)

// bins are the programs the stacks run, built on first use.
var bins = proctest.NewBinaries(map[string]string{
	"agent": "../../../cmd/agent", "coordinator": "../../../cmd/coordinator", "emptyagent": "./emptyagent",
})

func TestMain(m *testing.M) {
	flag.Parse()
	code := m.Run()
	bins.Remove()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "stackbench: goroutines left behind:", err)
			code = 1
		}
	}
	os.Exit(code)
}

func binaries(tb testing.TB) sb.Binaries {
	return sb.Binaries{Agent: bins.Path(tb, "agent"), Coordinator: bins.Path(tb, "coordinator"), Empty: bins.Path(tb, "emptyagent")}
}

// benchLoad is the benchmark's closed loop for api: 64 callers on one connection. 64 checks in
// flight is what a busy gateway node keeps outstanding, and it saturates the two cores of the
// development machine with the empty handler (agent's BenchmarkUnixCheck: the unary ceiling
// grows little beyond 64), so a check's cost shows as lost throughput rather than idle time;
// a cold check waits a round trip to Redis through a coordinator, and 64 of them give the agent
// refills to batch. Streams: one stream, batched as the Go client package batches with its
// defaults (at most 128 checks a message, a 50 µs linger under load), so a message carries what
// the callers have queued. Native checks are sent brief, as the gateway sends them for the
// benchmark policy's rules (RateLimit headers off), unless -stackbench.full.
func benchLoad(api sb.API) sb.Load {
	return sb.Load{API: api, Callers: 64, Streams: 1, MaxBatch: client.DefaultMaxBatch, Linger: client.DefaultLinger, Brief: !*full}
}

// benchSetup is what a whole-stack benchmark needs first: Redis, the programs, the timing of a run.
func benchSetup(b *testing.B) (sb.Binaries, sb.Timing) {
	redistest.Require(b)
	return binaries(b), sb.Timing{Warmup: *warmup, Measure: *measure}
}

// seed makes the key draws of every run the same sequence per caller.
const seed = 13

// apis are the agent APIs every case runs through.
var apis = []sb.API{sb.Unary, sb.Stream, sb.Envoy}

// BenchmarkStack measures the whole stack over the agent's Unix socket: for each case
// (sb.Cases: one hot key; 10,000 and 100,000 uniform keys, each colder than its lease; Zipf
// s=1.1 over 100,000 keys) one stack (its own redis-server, cmd/coordinator and cmd/agent) is
// started with two rules of the case's limit on two routes, one in direct mode (`lease: off`)
// and one in lease mode (`lease: on`), and warmed (every key checked once on each route); then
// each API (native unary Check, native CheckStream, Envoy's ShouldRateLimit) is measured on both
// rules (the hot-key case on the empty handler, emptyagent, too), the modes taking turns: each
// run's -stackbench.measure is cut into -stackbench.rounds slices, each warmed up for
// -stackbench.warmup, and the slices of the modes alternate, so that a busy moment of a shared
// machine falls on all of them rather than on one. Both modes are served by the same processes,
// so the comparison does not depend on how two sets of processes happen to settle on the
// machine's cores. The lease rows report their ratios to the direct and empty rows, and a
// Markdown table of every run is printed at the end. With -stackbench.aa a third rule, a second
// direct one (mode control), takes its turns too: two rules doing the same work, whose ratios
// show how far the comparison itself strays from 1.0 on the machine; and in the hot-key case a
// second empty handler (mode empty-control), whose ratio to the first shows the same of a
// comparison between two processes, as every ×empty figure is. What the metrics mean: the
// README's Performance section. Run it with the default -benchtime (or 1x): each run is
// time-bound (the first mode's sub-benchmark measures every slice but the others' last ones).
func BenchmarkStack(b *testing.B) {
	bin, tm := benchSetup(b)
	var sum sb.Summary
	for _, c := range sb.Cases {
		b.Run(c.Name, func(b *testing.B) { runCase(b, bin, tm, c, 1, apis, &sum) })
	}
	control := ""
	if *aa {
		control = "; A/A control: a second direct rule on the same stack, and a second empty handler"
	}
	fmt.Printf("\nStack benchmark summary: %d CPUs, GOMAXPROCS %d, %s; each run %v measured in %d slices, each after %v of warm-up, the modes taking turns; %d callers%s\n\n",
		runtime.NumCPU(), runtime.GOMAXPROCS(0), time.Now().UTC().Format("2006-01-02"), tm.Measure, max(1, *rounds), tm.Warmup, benchLoad(sb.Unary).Callers, control)
	sum.Write(os.Stdout)
	fmt.Println()
}

// fleet is how many agents BenchmarkStackAgents runs on one coordinator.
var fleet = flag.Int("stackbench.agents", 4, "BenchmarkStackAgents: agents on the one coordinator, the callers spread evenly over them")

// fleetAPIs are the APIs BenchmarkStackAgents runs: a node's native clients and Envoy's, one
// call per check (the stream's edge costs a fraction of theirs, BenchmarkStack).
var fleetAPIs = []sb.API{sb.Unary, sb.Envoy}

// BenchmarkStackAgents is BenchmarkStack's cases on a fleet: -stackbench.agents agents (cmd/agent,
// each its own process and socket) on one coordinator and one Redis, the benchmark's 64 callers
// spread evenly over them, every agent drawing its tenants from the whole case's distribution
// (a fleet behind a load balancer: each key's checks spread over every node). Each agent keeps
// its own leases, so a key's checks on one agent are a fraction of its checks, and a key shared
// by agents is the many-agents case of docs/leases.md. CPU per check sums every agent's. Unary
// and RLS, lease and direct mode taking turns as in BenchmarkStack; no empty handler (its floor
// is BenchmarkStack's). The summary names each case with its agents.
func BenchmarkStackAgents(b *testing.B) {
	bin, tm := benchSetup(b)
	n := max(1, *fleet)
	var sum sb.Summary
	for _, c := range sb.Cases {
		b.Run(c.Name, func(b *testing.B) { runCase(b, bin, tm, c, n, fleetAPIs, &sum) })
	}
	fmt.Printf("\nFleet benchmark summary: %d agents on one coordinator; %d CPUs, GOMAXPROCS %d, %s; each run %v measured in %d slices, each after %v of warm-up, the modes taking turns; %d callers over the agents\n\n",
		n, runtime.NumCPU(), runtime.GOMAXPROCS(0), time.Now().UTC().Format("2006-01-02"), tm.Measure, max(1, *rounds), tm.Warmup, benchLoad(sb.Unary).Callers)
	sum.Write(os.Stdout)
	fmt.Println()
}

// quiet waits, after a stack's warm passes, until its agents have no refill, hand-back or call
// left (Stack.Quiet), then lets it rest Settle for the leases the passes took to expire: each
// measurement starts on a stack that does only the load's work.
func quiet(b *testing.B, stack *sb.Stack) {
	start := time.Now()
	if err := stack.Quiet(context.Background(), 2*time.Minute); err != nil {
		b.Fatal(err)
	}
	dropped, err := stack.AgentMetric(context.Background(), "leasebucket_agent_refills_dropped_total")
	if err != nil {
		b.Fatal(err)
	}
	b.Logf("agents quiet %v after the warm passes; refills dropped, their checks gone: %.0f", time.Since(start).Round(time.Millisecond), dropped)
	time.Sleep(sb.Settle)
}

// runCase is one case of BenchmarkStack (agents 1) or BenchmarkStackAgents: a stack of agents
// agents with the case's rules, warmed, then each API of apis measured on each mode, the modes
// taking turns, each run reported and added to sum.
func runCase(b *testing.B, bin sb.Binaries, tm sb.Timing, c sb.Case, agents int, apis []sb.API, sum *sb.Summary) {
	ctx := context.Background()
	name := c.Name
	if agents > 1 {
		name = fmt.Sprintf("%s ×%d agents", c.Name, agents)
	}
	rules := []sb.Mode{sb.Direct, sb.Lease}
	if *aa {
		rules = append(rules, sb.Control)
	}
	modes := rules
	targets := map[sb.Mode]sb.Target{}
	keys := map[sb.Mode]*sb.Keys{}
	if c.Keys.Kind == sb.Hot && agents == 1 {
		bare := []sb.Mode{sb.Empty}
		if *aa {
			bare = append(bare, sb.EmptyControl)
		}
		for _, m := range bare {
			targets[m] = sb.StartEmpty(b, bin)
		}
		modes = append(bare, modes...)
	}
	stack := sb.StartStackAgents(b, bin, sb.PolicyYAML(c, rules...), agents)
	for _, m := range rules {
		targets[m] = stack
		keys[m] = c.Keys.New(seed)
		if _, err := sb.Warm(ctx, stack.Sockets(), keys[m], m.Path()); err != nil {
			b.Fatal(err)
		}
	}
	quiet(b, stack)
	for _, api := range apis {
		b.Run(string(api), func(b *testing.B) {
			for _, m := range modes {
				if m.Bare() {
					keys[m] = c.Keys.New(seed) // each API's empty runs from the start of the draws
				}
			}
			n := max(1, *rounds)
			slice := sb.Timing{Warmup: tm.Warmup, Measure: tm.Measure / time.Duration(n)}
			got := map[sb.Mode]*sb.Result{}
			measure := func(b *testing.B, m sb.Mode) {
				runtime.GC() // every slice's load generator starts from the same clean heap
				load := benchLoad(api)
				load.Path = m.Path()
				res, err := sb.Measure(ctx, targets[m], keys[m], load, slice)
				if err != nil {
					b.Fatal(err)
				}
				if got[m] == nil {
					got[m] = &res
				} else {
					got[m].Merge(res)
				}
			}
			for i, m := range modes {
				b.Run(string(m), func(b *testing.B) {
					if i == 0 {
						// Every slice but the last of each mode, the modes taking turns
						// (sb.Turns); each mode's last slice runs in its own sub-benchmark,
						// in the modes' order, which is the last round's.
						for r := range n - 1 {
							for _, m := range sb.Turns(modes, r, n) {
								measure(b, m)
							}
						}
					}
					measure(b, m)
					res := *got[m]
					if res.Outcomes[sb.Failed] > 0 {
						b.Errorf("%d of %d checks failed; the first: %v", res.Outcomes[sb.Failed], res.Checks(), res.Err)
					}
					res.Case, res.Mode = name, m
					sum.Add(res)
					res.Report(b)
					if m != sb.Empty {
						var direct *sb.Result
						if m.Compared() {
							direct = sum.Find(name, api, sb.Direct)
						}
						sb.RatiosOf(&res, direct, sum.EmptyOf(api)).Report(b)
					}
				})
			}
		})
	}
}

// quotaEnvoys is how many Envoy-faithful filters the RLQS load runs: four Envoys on the node, each
// with its own connection to the agent.
const quotaEnvoys = 4

// quotaPause is an RLQS caller's pause between requests: 64 callers offer at most 64,000 requests
// a second, more than RLS admits on the development machine, on the same two cores. 0 makes them
// decide back to back: what the filters can decide, bounded by the load generator's CPU.
var quotaPause = flag.Duration("stackbench.quota-pause", time.Millisecond, "BenchmarkQuota: each RLQS caller's pause between requests")

// BenchmarkQuota measures Envoy's two ways to the agent in the same run, on the same stack: RLS
// (ShouldRateLimit, a call to the agent per request, 64 callers on one connection) and RLQS (four
// Envoy-faithful rate_limit_quota filters, each its own connection, 64 callers deciding requests
// locally from the assignments the agent gives them; reports every second). For each case
// (sb.QuotaCases: one hot key, 1,000 tenants) one stack is started and warmed (every key checked
// once), then RLS and RLQS are measured back to back; each warms up for -stackbench.warmup (RLQS
// at least six reporting intervals) and measures for -stackbench.measure. RLQS callers pause
// -stackbench.quota-pause between requests (quotaPause). It reports admitted requests a second and the agent's CPU per
// admitted request (agent-cpu-µs/admitted), and for RLQS the ratio of requests admitted per agent
// CPU-second to RLS's (x-rls-admitted-per-agent-cpu). A table of every run is printed at the end.
func BenchmarkQuota(b *testing.B) {
	bin, tm := benchSetup(b)
	ctx := context.Background()
	var sum sb.Summary
	for _, c := range sb.QuotaCases {
		b.Run(c.Name, func(b *testing.B) {
			stack := sb.StartStack(b, bin, sb.QuotaPolicyYAML())
			keys := c.Keys.New(seed)
			if _, err := sb.Warm(ctx, stack.Sockets(), keys, sb.Lease.Path()); err != nil {
				b.Fatal(err)
			}
			quiet(b, stack)
			for _, api := range []sb.API{sb.Envoy, sb.Quota} {
				b.Run(string(api), func(b *testing.B) {
					load := benchLoad(api)
					load.Path, load.Envoys, load.Pause = sb.Lease.Path(), quotaEnvoys, *quotaPause
					t := tm
					if api == sb.Quota {
						// Six reports: each bucket's first assignment is sized from one request, the
						// next ones from a report's interval of demand, and the leases grow to it.
						t.Warmup = max(t.Warmup, 6*sb.QuotaReporting)
					}
					res, err := sb.Measure(ctx, stack, keys, load, t)
					if err != nil {
						b.Fatal(err)
					}
					if res.Outcomes[sb.Failed] > 0 {
						b.Errorf("%d of %d requests failed; the first: %v", res.Outcomes[sb.Failed], res.Checks(), res.Err)
					}
					res.Case, res.Mode = c.Name, sb.Lease
					sum.Add(res)
					res.Report(b)
					b.ReportMetric(res.Admitted(), "admitted/s")
					b.ReportMetric(res.AgentCPUPerAdmitted(), "agent-cpu-µs/admitted")
					if rls := sum.Find(c.Name, sb.Envoy, sb.Lease); api == sb.Quota && rls != nil {
						b.ReportMetric(res.AdmittedPerAgentSecond()/rls.AdmittedPerAgentSecond(), "x-rls-admitted-per-agent-cpu")
						b.ReportMetric(res.Admitted()/rls.Admitted(), "x-rls-admitted/s")
					}
				})
			}
		})
	}
	fmt.Printf("\nQuota benchmark summary (RLS against RLQS): %d CPUs, GOMAXPROCS %d, %s; each run %v measured after %v of warm-up (RLQS %v); %d callers, RLQS through %d Envoy-faithful filters, pausing %v between requests\n\n",
		runtime.NumCPU(), runtime.GOMAXPROCS(0), time.Now().UTC().Format("2006-01-02"), tm.Measure, tm.Warmup, max(tm.Warmup, 6*sb.QuotaReporting),
		benchLoad(sb.Envoy).Callers, quotaEnvoys, *quotaPause)
	sum.WriteQuota(os.Stdout)
	fmt.Println()
}
