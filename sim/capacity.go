package sim

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// CapacitySpec asks for a capacity plan (docs/simulator.md): the scenario's traffic is the peak, and
// its run measures what each check costs the coordinators and the stores in steady state; the
// throughputs of one unit come from `make bench` (Bench), or are given (Figures), or are stated
// as assumptions (Assume, labelled as such in the report).
type CapacitySpec struct {
	PeakChecksPerSecond Rate    `yaml:"peak_checks_per_second"`
	TargetUtilisation   float64 `yaml:"target_utilisation"`
	// Card is the design card's own assumption, shown beside ours: a limiter replica safely
	// serves this many checks per second (every check goes to Redis in the card's design).
	CardReplicaChecksPerSecond Rate `yaml:"card_replica_checks_per_second"`
	// Bench is the JSON `make bench` writes (bench/latest.json, or the text bench/latest.txt
	// beside it), relative to the working directory.
	Bench   string  `yaml:"bench"`
	Figures Figures `yaml:"figures"`
	Assume  Figures `yaml:"assume"`
}

// Figures are throughputs of one unit. Zero means unknown.
type Figures struct {
	AgentCheckNs              float64 `yaml:"agent_check_ns"`               // agent CPU per check, ns
	CoordinatorItemsPerSecond Rate    `yaml:"coordinator_items_per_second"` // one coordinator replica (one core)
	RedisOpsPerSecond         Rate    `yaml:"redis_ops_per_second"`         // one Redis shard
	RedisKeyOpsPerSecond      Rate    `yaml:"redis_key_ops_per_second"`     // one key (a shard cannot split it)
}

func (c *CapacitySpec) prepare() error {
	if c.PeakChecksPerSecond <= 0 {
		return errors.New("peak_checks_per_second: required")
	}
	if c.TargetUtilisation == 0 {
		c.TargetUtilisation = 0.6
	}
	if c.TargetUtilisation <= 0 || c.TargetUtilisation > 1 {
		return errors.New("target_utilisation: a fraction in (0, 1]")
	}
	if c.Bench == "" {
		c.Bench = "bench/latest.json"
	}
	return nil
}

// Benchmark is one entry of the bench JSON.
type Benchmark struct {
	Name    string             `json:"name"`
	Package string             `json:"package"`
	NsPerOp float64            `json:"ns_per_op"`
	Metrics map[string]float64 `json:"metrics"`
}

// benchSchema is the bench JSON's format (docs/coordinator.md, "bench/latest.json").
const benchSchema = "leasebucket-bench/1"

// ReadBench reads benchmark results: the JSON of `make bench` — an object with schema
// leasebucket-bench/1 whose "benchmarks" lists name, package, ns_per_op and metrics (custom
// metrics by unit), or that list alone — or, if path ends in .txt or the JSON is missing and a
// .txt sits beside it, the text `go test -bench` prints. It returns the file it read.
func ReadBench(path string) ([]Benchmark, string, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) && strings.HasSuffix(path, ".json") {
		txt := strings.TrimSuffix(path, ".json") + ".txt"
		if d, e := os.ReadFile(txt); e == nil {
			data, err, path = d, nil, txt
		}
	}
	if err != nil {
		return nil, "", err
	}
	if strings.HasSuffix(path, ".txt") {
		return parseBenchText(string(data)), path, nil
	}
	var list []Benchmark
	if err := json.Unmarshal(data, &list); err != nil {
		var doc struct {
			Schema     string      `json:"schema"`
			Benchmarks []Benchmark `json:"benchmarks"`
		}
		if err2 := json.Unmarshal(data, &doc); err2 != nil {
			return nil, "", fmt.Errorf("sim: %s: %w", path, err)
		}
		if doc.Schema != "" && doc.Schema != benchSchema {
			return nil, "", fmt.Errorf("sim: %s: schema %q, want %q", path, doc.Schema, benchSchema)
		}
		list = doc.Benchmarks
	}
	for i := range list {
		b := &list[i]
		b.Name = trimProcs(b.Name)
		if b.NsPerOp == 0 {
			b.NsPerOp = b.Metrics["ns/op"]
		}
	}
	return list, path, nil
}

var procsSuffix = regexp.MustCompile(`-\d+$`)

func trimProcs(name string) string { return procsSuffix.ReplaceAllString(name, "") }

// parseBenchText reads `go test -bench` output: "pkg:" lines and result lines of value-unit pairs.
func parseBenchText(s string) []Benchmark {
	var out []Benchmark
	pkg := ""
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		switch {
		case len(f) == 2 && f[0] == "pkg:":
			pkg = f[1]
		case len(f) >= 4 && strings.HasPrefix(f[0], "Benchmark"):
			b := Benchmark{Name: trimProcs(f[0]), Package: pkg, Metrics: map[string]float64{}}
			for i := 2; i+1 < len(f); i += 2 {
				v, err := strconv.ParseFloat(f[i], 64)
				if err != nil {
					break
				}
				b.Metrics[f[i+1]] = v
			}
			b.NsPerOp = b.Metrics["ns/op"]
			out = append(out, b)
		}
	}
	return out
}

// Figure is one throughput in the plan and where it came from.
type Figure struct {
	Value  float64
	Source string
}

// Measured are the throughputs found in benchmark results.
type Measured struct {
	File                                                  string // the file read, or why none was
	AgentCheckNs, CoordinatorItems, RedisOps, RedisKeyOps Figure
}

// MeasuredFrom picks our figures out of benchmark results (docs/coordinator.md, "Capacity:
// benchmark figures", names them):
//
//   - agent: the agent server's CPU per check over its Unix socket, BenchmarkUnixCheck/c=64
//     check-srv-µs/call; else its handler in process, BenchmarkServerCheck ns/op; else the lease
//     core alone, BenchmarkCheck ns/op (a lower bound: no gRPC);
//   - coordinator: BenchmarkAcquireRedis/batch=100, grants/cpu-s: what one coordinator core serves;
//   - Redis shard: 10^6 / redis-µs/grant of the same benchmark (Redis' own time per grant in the
//     script), else the Redis store's BenchmarkTakeBatch100 grants/s;
//   - one key: the Redis store's BenchmarkTakeHotKeyParallel grants/s, else the shard's figure (one
//     key is one shard's single thread).
func MeasuredFrom(list []Benchmark, file string) Measured {
	find := func(pkgSuffix, name, metric string, f func(float64) float64) Figure {
		for _, b := range list {
			if !strings.HasSuffix(b.Package, pkgSuffix) || b.Name != name {
				continue
			}
			v := b.Metrics[metric]
			if metric == "ns/op" {
				v = b.NsPerOp
			}
			if v > 0 {
				return Figure{f(v), fmt.Sprintf("%s: %s %s (%s)", file, strings.TrimPrefix(b.Package, modulePath), b.Name, metric)}
			}
		}
		return Figure{}
	}
	same := func(v float64) float64 { return v }
	perSecond := func(us float64) float64 { return 1e6 / us }
	m := Measured{
		File:             file,
		AgentCheckNs:     find("/agent", "BenchmarkUnixCheck/c=64", "check-srv-µs/call", func(us float64) float64 { return 1000 * us }),
		CoordinatorItems: find("/coordinator", "BenchmarkAcquireRedis/batch=100", "grants/cpu-s", same),
		RedisOps:         find("/coordinator", "BenchmarkAcquireRedis/batch=100", "redis-µs/grant", perSecond),
		RedisKeyOps:      find("/redisstore", "BenchmarkTakeHotKeyParallel", "grants/s", same),
	}
	if m.AgentCheckNs.Value == 0 {
		m.AgentCheckNs = find("/agent", "BenchmarkServerCheck", "ns/op", same)
	}
	if m.AgentCheckNs.Value == 0 {
		m.AgentCheckNs = find("/agent", "BenchmarkCheck", "ns/op", same)
	}
	if m.RedisOps.Value == 0 {
		m.RedisOps = find("/redisstore", "BenchmarkTakeBatch100", "grants/s", same)
	}
	if m.RedisKeyOps.Value == 0 {
		m.RedisKeyOps = m.RedisOps
	}
	return m
}

const modulePath = "github.com/leasebucket/leasebucket/"

// Plan is a capacity plan: the card's formula with the card's figure, and ours with measured
// figures and the load per check the simulation measured.
type Plan struct {
	Peak        float64 // checks per second
	Utilisation float64
	Agents      int
	Bench       string // the benchmark file read, or why none was

	CardReplica  float64 // checks/s per replica, the card's assumption
	CardReplicas int

	// Measured by the simulation in steady state, per check.
	CallsPerCheck    float64
	StoreOpsPerCheck float64
	HotKeyShare      float64 // of the store operations, on the busiest key
	HotKey           string

	AgentCheckNs, CoordinatorItems, RedisOps, RedisKeyOps Figure

	AgentCores      float64 // over the fleet, at the target utilisation
	AgentCoresEach  float64
	CoordinatorLoad float64 // items per second at the peak
	Coordinators    int
	RedisLoad       float64 // operations per second at the peak
	RedisShards     int
	HotKeyLoad      float64 // operations per second on the busiest key
	HotKeyFits      bool
	Missing         []string // figures neither measured nor given
}

// planCapacity computes the plan from a run of a capacity scenario. Each figure comes from the
// first of: override (the command line), the benchmark results, the scenario's figures, its
// assumptions (labelled as such).
func planCapacity(res *Result, spec *CapacitySpec, bench Measured, override Figures) *Plan {
	p := &Plan{
		Peak: float64(spec.PeakChecksPerSecond), Utilisation: spec.TargetUtilisation, Agents: res.Agents,
		CardReplica: float64(spec.CardReplicaChecksPerSecond), Bench: bench.File,
	}
	if p.CardReplica > 0 {
		p.CardReplicas = int(math.Ceil(p.Peak / (p.CardReplica * p.Utilisation)))
	}
	st := &res.Steady
	p.CallsPerCheck = ratio(st.Calls, st.Requests)
	p.StoreOpsPerCheck = ratio(st.StoreOps, st.Requests)
	p.HotKeyShare = ratio(st.HotKeyOps, st.StoreOps)
	p.HotKey = st.HotKey
	pick := func(label string, flag float64, measured Figure, given, assumed float64) Figure {
		switch {
		case flag > 0:
			return Figure{flag, "command line"}
		case measured.Value > 0:
			return measured
		case given > 0:
			return Figure{given, "the scenario's figures"}
		case assumed > 0:
			return Figure{assumed, "**assumed, not measured** (the scenario's assumptions)"}
		}
		p.Missing = append(p.Missing, label)
		return Figure{}
	}
	f, a := spec.Figures, spec.Assume
	p.AgentCheckNs = pick("agent check ns", override.AgentCheckNs, bench.AgentCheckNs, f.AgentCheckNs, a.AgentCheckNs)
	p.CoordinatorItems = pick("coordinator items/s", float64(override.CoordinatorItemsPerSecond), bench.CoordinatorItems,
		float64(f.CoordinatorItemsPerSecond), float64(a.CoordinatorItemsPerSecond))
	p.RedisOps = pick("Redis ops/s per shard", float64(override.RedisOpsPerSecond), bench.RedisOps,
		float64(f.RedisOpsPerSecond), float64(a.RedisOpsPerSecond))
	p.RedisKeyOps = pick("Redis ops/s on one key", float64(override.RedisKeyOpsPerSecond), bench.RedisKeyOps,
		float64(f.RedisKeyOpsPerSecond), float64(a.RedisKeyOpsPerSecond))

	p.AgentCores = p.Peak * p.AgentCheckNs.Value / 1e9 / p.Utilisation
	p.AgentCoresEach = p.AgentCores / float64(max(p.Agents, 1))
	p.CoordinatorLoad = p.Peak * p.StoreOpsPerCheck
	p.RedisLoad = p.CoordinatorLoad
	p.HotKeyLoad = p.RedisLoad * p.HotKeyShare
	if v := p.CoordinatorItems.Value; v > 0 {
		p.Coordinators = max(1, int(math.Ceil(p.CoordinatorLoad/(v*p.Utilisation))))
	}
	if v := p.RedisOps.Value; v > 0 {
		p.RedisShards = max(1, int(math.Ceil(p.RedisLoad/(v*p.Utilisation))))
	}
	p.HotKeyFits = p.RedisKeyOps.Value == 0 || p.HotKeyLoad <= p.RedisKeyOps.Value*p.Utilisation
	slices.Sort(p.Missing)
	return p
}
