package redisstore_test

import (
	"context"
	"errors"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/redisstore"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
	"github.com/leasebucket/leasebucket/internal/testkit/stackbench"
)

// benchStore is a Store on a fresh redis-server with the script loaded, and a counter of its
// round trips.
func benchStore(b *testing.B) (*redisstore.Store, *redis.Client, *tripCounter) {
	s, rdb, counter, _ := countedStore(b)
	if err := s.Load(context.Background()); err != nil {
		b.Fatal(err)
	}
	return s, rdb, counter
}

// benchLimit never runs dry at benchmark rates: 10^9 tokens refilled every millisecond.
func benchLimit(b *testing.B) bucket.Limit {
	return mustLimit(b, 1_000_000_000*tok, 1_000_000_000*tok, 1)
}

// runTakes times batches of reqs and reports key-grants per wall second and round trips per grant.
func runTakes(b *testing.B, s *redisstore.Store, counter *tripCounter, reqs []coordinator.TakeRequest) {
	ctx := context.Background()
	if _, err := s.Take(ctx, reqs); err != nil { // open the connection first
		b.Fatal(err)
	}
	counter.reset()
	grants := 0
	b.ReportAllocs()
	for b.Loop() {
		res, err := s.Take(ctx, reqs)
		if err != nil {
			b.Fatal(err)
		}
		for _, r := range res {
			if r.Err != nil {
				b.Fatal(r.Err)
			}
			if r.Granted > 0 {
				grants++
			}
		}
	}
	trips, _ := counter.reset()
	b.ReportMetric(float64(grants)/b.Elapsed().Seconds(), "grants/s")
	b.ReportMetric(float64(sum(trips))/float64(max(grants, 1)), "roundtrips/grant")
}

// BenchmarkTakeSingleKey is one Take of one hot key per round trip.
func BenchmarkTakeSingleKey(b *testing.B) {
	s, _, counter := benchStore(b)
	runTakes(b, s, counter, []coordinator.TakeRequest{{Key: "hot", Limit: benchLimit(b), Want: tok, Min: tok}})
}

// BenchmarkTakeBatch100 is one pipelined batch of 100 keys per round trip.
func BenchmarkTakeBatch100(b *testing.B) {
	s, _, counter := benchStore(b)
	l := benchLimit(b)
	reqs := make([]coordinator.TakeRequest, 100)
	for i := range reqs {
		reqs[i] = coordinator.TakeRequest{Key: "tenant-" + strconv.Itoa(i), Limit: l, Want: tok, Min: tok}
	}
	runTakes(b, s, counter, reqs)
}

// BenchmarkTakeBatch100Agent is BenchmarkTakeBatch100 as an agent sends it: each take carries the
// agent's OpID, so each key keeps the agent's record, as in production. It reports what Redis did
// per take (INFO commandstats): the commands it ran, scripts and the commands they call alike,
// and the microseconds its script commands took.
func BenchmarkTakeBatch100Agent(b *testing.B) {
	s, rdb, _ := benchStore(b)
	l := benchLimit(b)
	reqs := make([]coordinator.TakeRequest, 100)
	for i := range reqs {
		reqs[i] = coordinator.TakeRequest{Key: "tenant-" + strconv.Itoa(i), Limit: l, Want: tok, Min: tok,
			Op: coordinator.OpID{Agent: "node-17.eu-west-1"}}
	}
	ctx := context.Background()
	seq := uint64(0)
	take := func() {
		seq++
		for i := range reqs {
			reqs[i].Op.Seq = seq
		}
		res, err := s.Take(ctx, reqs)
		if err != nil {
			b.Fatal(err)
		}
		for _, r := range res {
			if r.Err != nil || r.Granted != tok {
				b.Fatal(r.Err, r.Granted)
			}
		}
	}
	take() // every key and record created: what follows is the steady state
	if err := rdb.ConfigResetStat(ctx).Err(); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	takes := 0
	for b.Loop() {
		take()
		takes += len(reqs)
	}
	var calls, usec float64
	for cmd, c := range commandStats(b, rdb) {
		calls += c.Calls
		if redistest.ScriptCommands[cmd] {
			usec += c.Usec
		}
	}
	b.ReportMetric(calls/float64(takes), "redis-cmds/take")
	b.ReportMetric(usec/float64(takes), "redis-script-µs/take")
	b.ReportMetric(float64(takes)/b.Elapsed().Seconds(), "grants/s")
}

// commandStats reads INFO commandstats: each command's calls (the INFO itself is not yet counted
// when it answers) and microseconds.
func commandStats(tb testing.TB, rdb *redis.Client) map[string]redistest.CommandStat {
	tb.Helper()
	info, err := rdb.Info(context.Background(), "commandstats").Result()
	if err != nil {
		tb.Fatal(err)
	}
	stats, err := redistest.ParseCommandStats(info)
	if err != nil {
		tb.Fatal(err)
	}
	return stats
}

// BenchmarkTakeHotKeyParallel is the throughput of one hot key from many goroutines: the script is
// the serialization point. The takes that wait while two are out share round trips
// (WithInFlight), so roundtrips/grant is below 1, but each is still its own bucket call.
func BenchmarkTakeHotKeyParallel(b *testing.B) {
	s, _, counter := benchStore(b)
	reqs := []coordinator.TakeRequest{{Key: "hot", Limit: benchLimit(b), Want: tok, Min: tok}}
	counter.reset()
	b.SetParallelism(8)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if res, err := s.Take(context.Background(), reqs); err != nil || res[0].Err != nil {
				b.Error(err, res)
				return
			}
		}
	})
	trips, _ := counter.reset()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "grants/s")
	b.ReportMetric(float64(sum(trips))/float64(b.N), "roundtrips/grant")
}

func sum(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

// BenchmarkMemoryPerKey reports what one bucket key costs in Redis (MEMORY USAGE), bare and with
// one agent's Take record.
func BenchmarkMemoryPerKey(b *testing.B) {
	for _, tc := range []struct {
		name string
		op   coordinator.OpID
	}{{"bare", coordinator.OpID{}}, {"one-agent-record", coordinator.OpID{Agent: "node-17.eu-west-1", Seq: 1234567}}} {
		b.Run(tc.name, func(b *testing.B) {
			s, rdb, _ := benchStore(b)
			l := mustLimit(b, 100*tok, 100*tok, 60_000) // 100 a minute
			ctx := context.Background()
			n := 0
			for b.Loop() {
				key := "tenant-" + strconv.Itoa(n) + "/GET /orders/{id}/read/v3"
				n++
				if _, err := s.Take(ctx, []coordinator.TakeRequest{{Key: key, Limit: l, Want: 20 * tok, Min: tok, Op: tc.op}}); err != nil {
					b.Fatal(err)
				}
			}
			var bytes int64
			sample := min(n, 100)
			for i := range sample {
				v, err := rdb.MemoryUsage(ctx, "tenant-"+strconv.Itoa(i)+"/GET /orders/{id}/read/v3", 0).Result()
				if err != nil {
					b.Fatal(err)
				}
				bytes += v
			}
			b.ReportMetric(float64(bytes)/float64(sample), "bytes/key")
		})
	}
}

// BenchmarkTakeAgents is what one coordinator sends Redis for many agents' cold keys: 64 callers
// at once (the Acquire calls of many agents), each take a batch of two keys never seen in the
// last second, every take with an agent's OpID, under each bound on the batches out to Redis at
// once (WithInFlight; 0: none, one round trip per batch). It reports the script commands Redis
// ran per key, the CPU per key of redis-server and of this process (the coordinator's side:
// go-redis, the merger and the callers), and keys per wall second.
func BenchmarkTakeAgents(b *testing.B) {
	for _, most := range []int{0, 1, redisstore.DefaultInFlight, 4} {
		b.Run("in-flight-"+strconv.Itoa(most), func(b *testing.B) {
			srv := redistest.Start(b)
			rdb := srv.Client(b)
			s := redisstore.New(rdb, redisstore.WithInFlight(most))
			ctx := context.Background()
			if err := s.Load(ctx); err != nil {
				b.Fatal(err)
			}
			pid := srv.Pid()
			l := mustLimit(b, 100*tok, 100*tok, 1000) // 100 a second: a key's bucket is partly spent
			var next atomic.Uint64
			var agents atomic.Int64
			take := func(agent string, seq uint64) {
				k := next.Add(2)
				reqs := make([]coordinator.TakeRequest, 2)
				for i := range reqs {
					reqs[i] = coordinator.TakeRequest{Key: "tenant-" + strconv.FormatUint((k+uint64(i))%200_000, 10), Limit: l,
						Want: tok, Min: tok, Op: coordinator.OpID{Agent: agent, Seq: seq}}
				}
				res, err := s.Take(ctx, reqs)
				if err != nil {
					b.Error(err)
					return
				}
				for _, r := range res {
					if r.Err != nil {
						b.Error(r.Err)
						return
					}
				}
			}
			take("warm-up", 1) // the connection and the script
			if err := rdb.ConfigResetStat(ctx).Err(); err != nil {
				b.Fatal(err)
			}
			cpu := func() (server, self time.Duration) {
				var err1, err2 error
				server, err1 = stackbench.ProcCPU(pid)
				self, err2 = stackbench.ProcCPU(0) // this process
				if err := errors.Join(err1, err2); err != nil {
					b.Fatal(err)
				}
				return server, self
			}
			redisBefore, selfBefore := cpu()
			b.SetParallelism(32) // 64 callers on 2 CPUs
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				agent := "node-" + strconv.FormatInt(agents.Add(1), 10)
				for seq := uint64(1); pb.Next(); seq++ {
					take(agent, seq)
				}
			})
			b.StopTimer()
			redisAfter, selfAfter := cpu()
			keys := float64(2 * b.N)
			scripts := scriptRuns(b, rdb)
			redisCPU := float64((redisAfter - redisBefore).Microseconds()) / keys
			selfCPU := float64((selfAfter - selfBefore).Microseconds()) / keys
			b.ReportMetric(scripts/keys, "scripts/key")
			b.ReportMetric(redisCPU, "redis-cpu-µs/key")
			b.ReportMetric(selfCPU, "coord-cpu-µs/key")
			b.ReportMetric(redisCPU+selfCPU, "total-cpu-µs/key")
			b.ReportMetric(keys/b.Elapsed().Seconds(), "keys/s")
		})
	}
}

// scriptRuns is how many scripts Redis ran since its statistics were last reset (INFO
// commandstats).
func scriptRuns(tb testing.TB, rdb *redis.Client) float64 {
	tb.Helper()
	var n float64
	for cmd, c := range commandStats(tb, rdb) {
		if redistest.ScriptCommands[cmd] {
			n += c.Calls
		}
	}
	return n
}
