package coordinator_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/coordinator/redisstore"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
	"github.com/leasebucket/leasebucket/internal/testkit/stackbench"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// batchSizes are the Acquire batches benchmarked: one key, and the batches of a busy agent.
var batchSizes = []int{1, 10, 100}

// benchItems is a batch of n distinct keys of the "big" rule, which never runs dry: every item
// is a grant.
func benchItems(n int) []*coordinatorv1.AcquireItem {
	items := make([]*coordinatorv1.AcquireItem, n)
	for i := range items {
		items[i] = item(ref("big", fmt.Sprintf("tenant-%03d", i)), tok, tok)
	}
	return items
}

// roundTrips counts the client's trips to Redis: one per command sent alone, one per pipeline.
type roundTrips struct{ n atomic.Int64 }

func (h *roundTrips) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *roundTrips) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmd)
	}
}

func (h *roundTrips) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmds)
	}
}

// cpuTime is the CPU time (user and system) this process has used: the coordinator and, in
// these benchmarks, its clients too.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkAcquireRedis measures Acquire through the gRPC service on loopback TCP against a real
// Redis, with concurrent agents. Metrics: grants/s (key-grants per second), grants/cpu-s
// (key-grants per second of CPU of this process, which runs the agents' gRPC clients as well:
// a lower bound of what one coordinator core serves) and round-trips/grant (Redis round trips
// counted by a go-redis hook). ns/op is per batch. batch=100/per-key-scripts runs the batches of
// 100 with one script per key (redisstore.WithBatchKeys(1)) instead of batch.lua: what running a
// batch's keys in one script saves Redis.
func BenchmarkAcquireRedis(b *testing.B) {
	srv := redistest.Start(b)
	probe, pid, err := stackbench.NewRedisProbe(context.Background(), srv.Options())
	if err != nil {
		b.Fatal(err)
	}
	defer probe.Close()
	set := mustPolicy(b, "bench")
	// seq grows across every run of every sub-benchmark: the agents' names repeat from run to run
	// (so keys hold a bounded number of idempotency records), and a seq that went back would be stale.
	var seq atomic.Int64
	type run struct {
		name string
		n    int
		opts []redisstore.Option
	}
	var runs []run
	for _, n := range batchSizes {
		runs = append(runs, run{fmt.Sprintf("batch=%d", n), n, nil})
	}
	runs = append(runs, run{"batch=100/per-key-scripts", 100, []redisstore.Option{redisstore.WithBatchKeys(1)}})
	for _, rn := range runs {
		n := rn.n
		b.Run(rn.name, func(b *testing.B) {
			c := redis.NewClient(srv.Options())
			defer c.Close()
			trips := &roundTrips{}
			c.AddHook(trips)
			store := redisstore.New(c, rn.opts...)
			if err := store.Load(context.Background()); err != nil {
				b.Fatal(err)
			}
			r := startReplica(b, coordinator.NewService(store, set, coordinator.WithStoreTimeout(5*time.Second)),
				coordinator.ServerOptions{Logger: zap.NewNop()})
			items := benchItems(n)
			var agents, grants atomic.Int64
			trips.n.Store(0)
			cpu, redis0 := cpuTime(b), redisUse(b, probe, pid)
			b.ReportAllocs()
			b.SetParallelism(8) // agents in flight per GOMAXPROCS: enough to keep Redis and the server busy
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				agent := fmt.Sprintf("bench-agent-%d", agents.Add(1))
				for pb.Next() {
					resp, err := r.client.Acquire(context.Background(),
						acquire(agent, uint64(seq.Add(1)), "bench", items...))
					if err != nil {
						b.Error(err)
						return
					}
					for _, res := range resp.Results {
						if res.Status != coordinatorv1.Status_STATUS_OK {
							b.Errorf("item: %v", res)
							return
						}
					}
					grants.Add(int64(len(resp.Results)))
				}
			})
			b.StopTimer()
			reportGrants(b, grants.Load(), cpuTime(b)-cpu)
			b.ReportMetric(float64(trips.n.Load())/float64(grants.Load()), "round-trips/grant")
			redis1 := redisUse(b, probe, pid)
			b.ReportMetric((redis1.script-redis0.script)/float64(grants.Load()), "redis-µs/grant")
			b.ReportMetric((redis1.cpu-redis0.cpu)/float64(grants.Load()), "redis-cpu-µs/grant")
			r.stop()
		})
	}
}

// BenchmarkAcquireMemory measures Acquire in process on the memory store (the embedded
// default and the simulator's path): the service's own cost per batch, without gRPC or Redis.
func BenchmarkAcquireMemory(b *testing.B) {
	set := mustPolicy(b, "bench")
	for _, n := range batchSizes {
		b.Run(fmt.Sprintf("batch=%d", n), func(b *testing.B) {
			svc := coordinator.NewService(memstore.New(), set)
			req := acquire("bench-agent", 0, "bench", benchItems(n)...)
			ctx := context.Background()
			var grants int64
			cpu := cpuTime(b)
			b.ReportAllocs()
			for b.Loop() {
				req.Seq++
				resp, err := svc.Acquire(ctx, req)
				if err != nil {
					b.Fatal(err)
				}
				for _, res := range resp.Results {
					if res.Status != coordinatorv1.Status_STATUS_OK {
						b.Fatalf("item: %v", res)
					}
				}
				grants += int64(len(resp.Results))
			}
			reportGrants(b, grants, cpuTime(b)-cpu)
		})
	}
}

// redisUsage is what the Redis server has used so far, in microseconds: CPU (its process's,
// every thread: reading, parsing and answering each command besides the scripts) and time in
// scripts (INFO commandstats, wall time).
type redisUsage struct{ cpu, script float64 }

func redisUse(b *testing.B, probe *stackbench.RedisProbe, pid int) redisUsage {
	cpu, err := stackbench.ProcCPU(pid)
	if err != nil {
		b.Fatal(err)
	}
	st, err := probe.Stats(context.Background())
	if err != nil {
		b.Fatal(err)
	}
	return redisUsage{cpu: float64(cpu.Microseconds()), script: st.ScriptMicros}
}

func reportGrants(b *testing.B, grants int64, cpu time.Duration) {
	if grants == 0 {
		b.Fatal("no grants")
	}
	b.ReportMetric(float64(grants)/b.Elapsed().Seconds(), "grants/s")
	b.ReportMetric(float64(grants)/cpu.Seconds(), "grants/cpu-s")
}
