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
// the callers have queued.
func benchLoad(api sb.API) sb.Load {
	return sb.Load{API: api, Callers: 64, Streams: 1, MaxBatch: client.DefaultMaxBatch, Linger: client.DefaultLinger}
}

// seed makes the key draws of every run the same sequence per caller.
const seed = 13

// apis are the agent APIs every case runs through.
var apis = []sb.API{sb.Unary, sb.Stream, sb.Envoy}

// BenchmarkStack measures the whole stack over the agent's Unix socket: for each case
// (sb.Cases: one hot key; 10,000 and 100,000 uniform keys, each colder than its lease; Zipf
// s=1.1 over 100,000 keys) a direct-mode stack (`lease: off`) and a lease-mode stack (`lease:
// on`), each its own redis-server, cmd/coordinator and cmd/agent, are started and warmed (every
// key checked once), then each API (native unary Check, native CheckStream, Envoy's
// ShouldRateLimit) is measured on both, direct first, back to back; the hot-key case measures
// the empty handler (emptyagent) first. Each run warms up for -stackbench.warmup, then measures
// for -stackbench.measure. The lease rows report their ratios to the direct and empty rows, and
// a Markdown table of every run is printed at the end. What the metrics mean: the README's
// Performance section. Run it with the default -benchtime (or 1x): each run is time-bound.
func BenchmarkStack(b *testing.B) {
	redistest.Require(b)
	bin := binaries(b)
	ctx := context.Background()
	tm := sb.Timing{Warmup: *warmup, Measure: *measure}
	var sum sb.Summary
	for _, c := range sb.Cases {
		b.Run(c.Name, func(b *testing.B) {
			var empty *sb.EmptyServer
			if c.Keys.Kind == sb.Hot {
				empty = sb.StartEmpty(b, bin)
			}
			stacks := map[sb.Mode]*sb.Stack{}
			keys := map[sb.Mode]*sb.Keys{}
			for _, m := range []sb.Mode{sb.Direct, sb.Lease} {
				stacks[m] = sb.StartStack(b, bin, sb.PolicyYAML(c, m))
				keys[m] = c.Keys.New(seed)
				if _, err := sb.Warm(ctx, stacks[m].Socket(), keys[m], sb.Settle); err != nil {
					b.Fatal(err)
				}
			}
			for _, api := range apis {
				b.Run(string(api), func(b *testing.B) {
					run := func(m sb.Mode, target sb.Target, k *sb.Keys) {
						b.Run(string(m), func(b *testing.B) {
							res, err := sb.Measure(ctx, target, k, benchLoad(api), tm)
							if err != nil {
								b.Fatal(err)
							}
							if res.Outcomes[sb.Failed] > 0 {
								b.Errorf("%d of %d checks failed; the first: %v", res.Outcomes[sb.Failed], res.Checks(), res.Err)
							}
							res.Case, res.Mode = c.Name, m
							sum.Add(res)
							res.Report(b)
							if m != sb.Empty {
								var direct *sb.Result
								if m == sb.Lease {
									direct = sum.Find(c.Name, api, sb.Direct)
								}
								sb.RatiosOf(&res, direct, sum.Find(c.Name, api, sb.Empty)).Report(b)
							}
						})
					}
					if empty != nil {
						run(sb.Empty, empty, c.Keys.New(seed))
					}
					run(sb.Direct, stacks[sb.Direct], keys[sb.Direct])
					run(sb.Lease, stacks[sb.Lease], keys[sb.Lease])
				})
			}
		})
	}
	fmt.Printf("\nStack benchmark summary: %d CPUs, GOMAXPROCS %d, %s; each run %v measured after %v of warm-up; %d callers\n\n",
		runtime.NumCPU(), runtime.GOMAXPROCS(0), time.Now().UTC().Format("2006-01-02"), tm.Measure, tm.Warmup, benchLoad(sb.Unary).Callers)
	sum.Write(os.Stdout)
	fmt.Println()
}
