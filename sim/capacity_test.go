package sim

import (
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestReadBench(t *testing.T) {
	dir := t.TempDir()
	list := `[
  {"name": "BenchmarkCheck-2", "package": "github.com/leasebucket/leasebucket/agent", "ns_per_op": 45.5},
  {"name": "BenchmarkAcquireRedis/batch=10", "package": "github.com/leasebucket/leasebucket/coordinator", "ns_per_op": 300000, "metrics": {"grants/cpu-s": 70000, "redis-µs/grant": 16}},
  {"name": "BenchmarkAcquireRedis/batch=100", "package": "github.com/leasebucket/leasebucket/coordinator", "ns_per_op": 2500000, "metrics": {"grants/cpu-s": 65000, "redis-µs/grant": 8}}
]`
	object := `{"schema": "leasebucket-bench/1", "benchmarks": ` + list + `}`
	text := `goos: linux
pkg: github.com/leasebucket/leasebucket/agent
BenchmarkCheck-2   	 1000000	        45.50 ns/op	       0 B/op	       0 allocs/op
BenchmarkUnixCheck/c=64-2        	   27442	     20319 ns/op	        16.40 check-srv-µs/call	         0.9544 ratio
pkg: github.com/leasebucket/leasebucket/coordinator/redisstore
BenchmarkTakeBatch100-2        	    1500	    800000 ns/op	    125000 grants/s	         0.01000 roundtrips/grant
BenchmarkTakeHotKeyParallel-2  	   30000	     40000 ns/op	     25000 grants/s
PASS
`
	for name, data := range map[string]string{"list.json": list, "object.json": object, "latest.txt": text} {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
		got, file, err := ReadBench(path)
		if err != nil || file != path {
			t.Fatalf("%s: %v (read %s)", name, err, file)
		}
		m := MeasuredFrom(got, file)
		// The text has the agent server over its socket (16.4 µs a check); the JSON only the core.
		if want := map[bool]float64{true: 45.5, false: 16400}[strings.HasSuffix(name, ".json")]; m.AgentCheckNs.Value != want {
			t.Errorf("%s: agent %v ns, want %v", name, m.AgentCheckNs, want)
		}
		json := strings.HasSuffix(name, ".json")
		// JSON: 10^6 / 8 µs per grant = 125,000 per shard, and so for one key; text: the Redis
		// store's own benchmarks.
		if want := map[bool][3]float64{true: {65000, 125000, 125000}, false: {0, 125000, 25000}}[json]; m.CoordinatorItems.Value != want[0] ||
			m.RedisOps.Value != want[1] || m.RedisKeyOps.Value != want[2] {
			t.Errorf("%s: coordinator %v, shard %v, key %v; want %v", name, m.CoordinatorItems, m.RedisOps, m.RedisKeyOps, want)
		}
	}
	// A missing JSON falls back to the text beside it.
	if _, file, err := ReadBench(filepath.Join(dir, "latest.json")); err != nil || filepath.Base(file) != "latest.txt" {
		t.Errorf("fallback: %s, %v", file, err)
	}
	if _, _, err := ReadBench(filepath.Join(dir, "none.json")); err == nil {
		t.Error("a missing file read")
	}
	other := filepath.Join(dir, "other.json")
	if err := os.WriteFile(other, []byte(`{"schema": "something-else/2", "benchmarks": []}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, _, err := ReadBench(other); err == nil || !strings.Contains(err.Error(), "schema") {
		t.Errorf("another schema: %v", err)
	}
}

// TestPlanCapacity checks the plan's arithmetic against figures worked out by hand.
func TestPlanCapacity(t *testing.T) {
	res := &Result{Agents: 120, Steady: Steady{Requests: 1_000_000, Calls: 40_000, StoreOps: 110_000, HotKey: "k", HotKeyOps: 11_000}}
	spec := &CapacitySpec{PeakChecksPerSecond: 1.2e6, TargetUtilisation: 0.6, CardReplicaChecksPerSecond: 80e3,
		Assume: Figures{RedisKeyOpsPerSecond: 10e3}}
	bench := Measured{File: "bench.json",
		AgentCheckNs: Figure{50, "bench"}, CoordinatorItems: Figure{50e3, "bench"}, RedisOps: Figure{100e3, "bench"}}
	p := planCapacity(res, spec, bench, Figures{RedisOpsPerSecond: 70e3})
	// The card: ceil(1.2M / (80K × 0.6)) = 25.
	if p.CardReplicas != 25 {
		t.Errorf("card replicas %d, want 25", p.CardReplicas)
	}
	// 0.11 store operations per check: 132K per second at the peak.
	if math.Abs(p.RedisLoad-132e3) > 1e-6 || p.StoreOpsPerCheck != 0.11 || p.CallsPerCheck != 0.04 {
		t.Errorf("load %v ops/s, %v ops and %v calls per check; want 132000, 0.11, 0.04", p.RedisLoad, p.StoreOpsPerCheck, p.CallsPerCheck)
	}
	// Coordinators: ceil(132K / (50K × 0.6)) = ceil(4.4) = 5. Redis, with the command line's 70K per
	// shard: ceil(132K / 42K) = ceil(3.14) = 4. Agents: 1.2M × 50 ns / 0.6 = 0.1 cores.
	if p.Coordinators != 5 || p.RedisShards != 4 || math.Abs(p.AgentCores-0.1) > 1e-9 {
		t.Errorf("coordinators %d, shards %d, agent cores %v; want 5, 4, 0.1", p.Coordinators, p.RedisShards, p.AgentCores)
	}
	if p.RedisOps.Source != "command line" || !strings.Contains(p.RedisKeyOps.Source, "assumed") {
		t.Errorf("sources: %q, %q", p.RedisOps.Source, p.RedisKeyOps.Source)
	}
	// The hot key takes 10%: 13.2K ops/s against one key's 10K × 0.6.
	if p.HotKeyFits || math.Abs(p.HotKeyLoad-13.2e3) > 1e-6 {
		t.Errorf("hot key %v ops/s fits = %v; want 13200, false", p.HotKeyLoad, p.HotKeyFits)
	}
	if len(p.Missing) != 0 {
		t.Errorf("missing %v", p.Missing)
	}
	if p := planCapacity(res, spec, Measured{}, Figures{}); len(p.Missing) != 3 || p.Coordinators != 0 {
		t.Errorf("without figures: missing %v, %d coordinators", p.Missing, p.Coordinators)
	}
}
