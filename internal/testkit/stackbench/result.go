package stackbench

import (
	"context"
	"fmt"
	"io"
	"math"
	"strings"
	"testing"
	"time"
)

// Timing is how long a run warms up (load running, nothing counted) and then measures.
type Timing struct {
	Warmup, Measure time.Duration
}

// Result is one measured run: a case, an API and a mode.
type Result struct {
	Case string
	API  API
	Mode Mode
	Dist Dist
	// Agents is how many agents the load's callers were spread over (Target.Sockets).
	Agents int
	Window
	// Deltas over the measured window. Scripts, RedisCmds, StoreOps and Calls are read over a
	// slightly longer span and scaled to the window's checks (Measure).
	CPU       [numProcs]time.Duration
	Scripts   float64 // script runs in Redis (EVALSHA, EVAL, FCALL…)
	RedisCmds float64 // every command Redis ran, script commands included, the probe's excluded
	StoreOps  float64 // items of the coordinator's calls
	Calls     float64 // the coordinator's calls
	Mallocs   uint64  // heap allocations of this process (the load generator)
	Bytes     uint64
	Host      HostCPU // the machine's CPUs, steal included
	AgentGC   GCCPU   // the agents' garbage collectors and their busy CPU (the runtime's estimates)
	// Slices are the figures of each measured window, in the order measured (Merge appends):
	// how far they spread is what the machine did to the run.
	Slices []Slice
}

// Slice is the figures of one measured window.
type Slice struct {
	Rate     float64 // checks/s
	TotalCPU float64 // total-cpu-µs/check
}

// slice is r's figures as one Slice (r one measured window).
func (r *Result) slice() Slice { return Slice{Rate: r.Rate(), TotalCPU: r.TotalCPUPerCheck()} }

// Measure runs load against target: the callers start, run for tm.Warmup uncounted, then for
// tm.Measure counted, and stop. The counters are read around the measured window (Target.Sample).
func Measure(ctx context.Context, target Target, keys *Keys, load Load, tm Timing) (Result, error) {
	res := Result{API: load.API, Dist: keys.Dist(), Agents: len(target.Sockets())}
	r, err := StartLoad(target.Sockets(), keys, load)
	if err != nil {
		return res, err
	}
	stopped := false
	defer func() {
		if !stopped {
			r.Stop()
		}
	}()
	if err := sleep(ctx, tm.Warmup); err != nil {
		return res, err
	}
	a, aAt, err := sampleAt(ctx, target, r, false)
	if err != nil {
		return res, err
	}
	hostA, err := ReadHostCPU()
	if err != nil {
		return res, err
	}
	r.Begin()
	err = sleep(ctx, tm.Measure)
	r.End()
	if err != nil {
		return res, err
	}
	hostZ, err := ReadHostCPU()
	if err != nil {
		return res, err
	}
	res.Host = hostZ.Sub(hostA)
	z, zAt, err := sampleAt(ctx, target, r, true)
	stopped = true
	res.Window = r.Stop()
	if err != nil {
		return res, err
	}
	for p := range numProcs {
		res.CPU[p] = z.CPU[p] - a.CPU[p]
	}
	res.Mallocs, res.Bytes = z.Mallocs-a.Mallocs, z.Bytes-a.Bytes
	res.AgentGC = GCCPU{GC: z.AgentGC.GC - a.AgentGC.GC, Busy: z.AgentGC.Busy - a.AgentGC.Busy}
	if res.Checks() == 0 && res.Err != nil {
		return res, fmt.Errorf("stackbench: no check answered in %v; the first failure: %w", tm.Measure, res.Err)
	}
	if res.Checks() == 0 {
		return res, fmt.Errorf("stackbench: no check answered in %v", tm.Measure)
	}
	// Redis' and the coordinator's counts span the two readings, a few milliseconds each side of
	// the window while the load runs on (about 1 % more checks at 1 s windows): scaled by the
	// window's checks over those answered between the readings (more than the window's, so never
	// zero), their per-check figures are those of their own span.
	scale := float64(res.Checks()) / (zAt - aAt)
	res.Scripts = scale * (z.Redis.Scripts - a.Redis.Scripts)
	res.RedisCmds = scale * (z.Redis.Commands - a.Redis.Commands)
	res.StoreOps = scale * (z.StoreOps - a.StoreOps)
	res.Calls = scale * (z.Calls - a.Calls)
	res.Slices = []Slice{res.slice()}
	return res, nil
}

// sampleAt reads target's counters (Target.Sample) and the checks r's callers had answered by
// then: the mean of the counts just before and just after the reading, which takes milliseconds
// (HTTP scrapes of the coordinator, INFO of Redis) while the load runs on.
func sampleAt(ctx context.Context, target Target, r *Runner, procsFirst bool) (Sample, float64, error) {
	before := r.Answered()
	s, err := target.Sample(ctx, procsFirst)
	return s, float64(before+r.Answered()) / 2, err
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Merge adds o, another measured window of the same case, API and mode, to r: its wall time,
// checks, latencies and counters add up, and r keeps its first failure.
func (r *Result) Merge(o Result) {
	r.Wall += o.Wall
	r.Latency.Merge(&o.Latency)
	for i := range r.Outcomes {
		r.Outcomes[i] += o.Outcomes[i]
		r.Total[i] += o.Total[i]
	}
	r.Messages += o.Messages
	r.MessageChecks += o.MessageChecks
	if r.Err == nil {
		r.Err = o.Err
	}
	for p := range r.CPU {
		r.CPU[p] += o.CPU[p]
	}
	r.Scripts += o.Scripts
	r.RedisCmds += o.RedisCmds
	r.StoreOps += o.StoreOps
	r.Calls += o.Calls
	r.Mallocs += o.Mallocs
	r.Bytes += o.Bytes
	r.Host.Total += o.Host.Total
	r.Host.Steal += o.Host.Steal
	r.AgentGC.GC += o.AgentGC.GC
	r.AgentGC.Busy += o.AgentGC.Busy
	r.Slices = append(r.Slices, o.Slices...)
}

// Rate is checks answered per second of the measured window.
func (r *Result) Rate() float64 { return float64(r.Checks()) / r.Wall.Seconds() }

// PerCheck is x over the checks answered.
func (r *Result) PerCheck(x float64) float64 { return x / float64(r.Checks()) }

// CPUPerCheck is process p's CPU time per check, in µs.
func (r *Result) CPUPerCheck(p Proc) float64 {
	return r.PerCheck(float64(r.CPU[p]) / float64(time.Microsecond))
}

// TotalCPUPerCheck is the CPU per check, in µs, of the limiter's processes: agent, coordinator
// and Redis (for the empty handler, its process alone).
func (r *Result) TotalCPUPerCheck() float64 {
	return r.CPUPerCheck(ProcAgent) + r.CPUPerCheck(ProcCoordinator) + r.CPUPerCheck(ProcRedis)
}

// Percent is the share of the checks that got o, in %.
func (r *Result) Percent(o Outcome) float64 { return 100 * r.PerCheck(float64(r.Outcomes[o])) }

// OpsBound is the fewest store operations per check that leases of lifetime tau could take on
// r's checks, whatever their rule (docs/leases.md, "What leases cannot save on a long tail"): a
// lease serves checks only while it lives, so a key checked at λ a second on one agent costs at
// least λ/(1 + λ·tau) takes a second, its checks arriving at random; spread evenly over n agents,
// each with its own leases, λ/(1 + λ·tau/n). Per check that is Σ λ_k/(1 + λ_k·tau/n) ÷ Σ λ_k
// over the distribution's keys at r's rate (Zipf: λ_k ∝ (k+1)^-S; Hot: the one key). The uniform
// walk checks each key once every N/X seconds: a key checked less often than tau is a take per
// check, 1; when keys come round faster than tau the walk is not random and no bound is given, 0.
// 0 too for a run without checks.
func (r *Result) OpsBound(tau time.Duration) float64 {
	rate, n := r.Rate(), float64(max(1, r.Agents))
	if r.Checks() == 0 || rate <= 0 {
		return 0
	}
	span := tau.Seconds() / n
	switch r.Dist.Kind {
	case Hot:
		return 1 / (1 + rate*span)
	case Uniform:
		if float64(r.Dist.N)/rate >= tau.Seconds() {
			return 1
		}
		return 0
	case Zipf:
		var h float64
		w := make([]float64, r.Dist.N)
		for k := range w {
			w[k] = math.Pow(float64(k+1), -r.Dist.S)
			h += w[k]
		}
		var ops float64
		for _, wk := range w {
			l := rate * wk / h
			ops += l / (1 + l*span)
		}
		return ops / rate
	}
	return 0
}

// KeyInterval is, for a uniform case, how long apart two checks of one key are: N checks of the
// walk at the measured rate. 0 for the other distributions, whose keys have no single interval.
func (r *Result) KeyInterval() time.Duration {
	if r.Dist.Kind != Uniform {
		return 0
	}
	return time.Duration(float64(r.Dist.N) / r.Rate() * float64(time.Second))
}

// Report reports r's figures as b's metrics (docs: the README's Performance section). ns/op is
// the wall time per check; B/op and allocs/op are the load generator's per check.
func (r *Result) Report(b *testing.B) {
	b.ReportMetric(float64(r.Wall.Nanoseconds())/float64(r.Checks()), "ns/op")
	b.ReportMetric(r.PerCheck(float64(r.Bytes)), "B/op")
	b.ReportMetric(r.PerCheck(float64(r.Mallocs)), "allocs/op")
	b.ReportMetric(r.Rate(), "checks/s")
	b.ReportMetric(micros(r.Latency.Quantile(0.5)), "p50-µs")
	b.ReportMetric(micros(r.Latency.Quantile(0.99)), "p99-µs")
	b.ReportMetric(r.CPUPerCheck(ProcAgent), "agent-cpu-µs/check")
	b.ReportMetric(r.CPUPerCheck(ProcClient), "client-cpu-µs/check")
	b.ReportMetric(r.Percent(Denied), "denied-%")
	b.ReportMetric(r.Percent(Unavailable), "unavailable-%")
	b.ReportMetric(r.Host.StealPercent(), "steal-%")
	if !r.Mode.Bare() {
		b.ReportMetric(r.CPUPerCheck(ProcCoordinator), "coord-cpu-µs/check")
		b.ReportMetric(r.CPUPerCheck(ProcRedis), "redis-cpu-µs/check")
		b.ReportMetric(r.TotalCPUPerCheck(), "total-cpu-µs/check")
		if r.AgentGC.Busy > 0 { // none when no agent finished a collection in the window
			b.ReportMetric(r.AgentGC.Percent(), "agent-gc-%")
		}
		b.ReportMetric(r.PerCheck(r.Scripts), "scripts/check")
		b.ReportMetric(r.PerCheck(r.RedisCmds), "redis-cmds/check")
		b.ReportMetric(r.PerCheck(r.StoreOps), "store-ops/check")
		if r.Calls > 0 {
			b.ReportMetric(r.StoreOps/r.Calls, "items/call")
		}
	}
	if r.API == Stream && r.Messages > 0 {
		b.ReportMetric(float64(r.MessageChecks)/float64(r.Messages), "checks/msg")
	}
	if iv := r.KeyInterval(); iv > 0 {
		b.ReportMetric(float64(iv)/float64(time.Millisecond), "key-interval-ms")
	}
	if bound := r.leaseBound(); bound > 0 {
		b.ReportMetric(bound, "store-ops-bound/check")
	}
}

// leaseBound is OpsBound at the benchmark rules' lease lifetime, for a lease run; 0 for the others.
func (r *Result) leaseBound() float64 {
	if r.Mode != Lease {
		return 0
	}
	return r.OpsBound(TTL)
}

func micros(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// Ratios of a lease run to the direct run and to the empty handler of the same case and API
// (0 when that run is missing), and the spread of each over the slices both runs measured in the
// same rounds (zero with fewer than two).
type Ratios struct {
	DirectRate, DirectCPU, EmptyRate                   float64
	DirectRateSpread, DirectCPUSpread, EmptyRateSpread Spread
}

// Spread is the least and the most of a ratio taken slice by slice.
type Spread struct {
	Min, Max float64
}

// RatiosOf compares r with direct and empty, either of which may be nil.
func RatiosOf(r, direct, empty *Result) Ratios {
	var q Ratios
	rate := func(a, b Slice) float64 { return a.Rate / b.Rate }
	if direct != nil {
		q.DirectRate = r.Rate() / direct.Rate()
		q.DirectCPU = r.TotalCPUPerCheck() / direct.TotalCPUPerCheck()
		q.DirectRateSpread = spread(r.Slices, direct.Slices, rate)
		q.DirectCPUSpread = spread(r.Slices, direct.Slices, func(a, b Slice) float64 { return a.TotalCPU / b.TotalCPU })
	}
	if empty != nil {
		q.EmptyRate = r.Rate() / empty.Rate()
		q.EmptyRateSpread = spread(r.Slices, empty.Slices, rate)
	}
	return q
}

// spread is the least and the most of f over the slices of a and b measured in the same rounds
// (the i-th of each: BenchmarkStack measures every mode once per round); zero unless both have
// the same two or more slices.
func spread(a, b []Slice, f func(a, b Slice) float64) Spread {
	if len(a) < 2 || len(a) != len(b) {
		return Spread{}
	}
	s := Spread{Min: math.Inf(1), Max: math.Inf(-1)}
	for i := range a {
		v := f(a[i], b[i])
		s.Min, s.Max = min(s.Min, v), max(s.Max, v)
	}
	return s
}

// Report reports the ratios as b's metrics: x-direct-checks/s, x-direct-cpu/check and
// x-empty-checks/s, and where the slices spread, each one's least and most (-min, -max).
func (q Ratios) Report(b *testing.B) {
	report := func(v float64, s Spread, unit string) {
		b.ReportMetric(v, unit)
		if s != (Spread{}) {
			b.ReportMetric(s.Min, unit+"-min")
			b.ReportMetric(s.Max, unit+"-max")
		}
	}
	if q.DirectRate > 0 {
		report(q.DirectRate, q.DirectRateSpread, "x-direct-checks/s")
		report(q.DirectCPU, q.DirectCPUSpread, "x-direct-cpu/check")
	}
	if q.EmptyRate > 0 {
		report(q.EmptyRate, q.EmptyRateSpread, "x-empty-checks/s")
	}
}

// Summary collects results in the order they ran and prints them as one Markdown table.
type Summary struct {
	results []*Result
}

// Add appends a result.
func (s *Summary) Add(r Result) { s.results = append(s.results, &r) }

// Find is the result of case c, API a and mode m, nil if it did not run.
func (s *Summary) Find(c string, a API, m Mode) *Result {
	for _, r := range s.results {
		if r.Case == c && r.API == a && r.Mode == m {
			return r
		}
	}
	return nil
}

// EmptyOf is the empty handler's result for API a, whatever its case: the empty handler answers
// without looking at the key, so its run in the hot-key case is the floor of every case.
func (s *Summary) EmptyOf(a API) *Result {
	for _, r := range s.results {
		if r.API == a && r.Mode == Empty {
			return r
		}
	}
	return nil
}

// Write prints the table: one row per run, the ratios on the rows they compare (a lease row and
// a direct row to the empty handler of their API; a lease row to its direct row).
func (s *Summary) Write(w io.Writer) {
	if len(s.results) == 0 {
		return
	}
	var b strings.Builder
	b.WriteString("| case | API | mode | checks/s | p50 µs | p99 µs | scripts/check | Redis cmds/check | store ops/check | lease bound ops/check | CPU µs/check agent | coord | Redis | total | denied % | unavailable % | key interval s | ×direct checks/s | ×direct CPU/check | ×empty checks/s | steal % |\n")
	b.WriteString("|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n")
	for _, r := range s.results {
		q := RatiosOf(r, nil, s.EmptyOf(r.API))
		if r.Mode.Compared() {
			q = RatiosOf(r, s.Find(r.Case, r.API, Direct), s.EmptyOf(r.API))
		}
		if r.Mode == Empty {
			q = Ratios{}
		}
		dash := func(v float64, format string) string {
			if r.Mode.Bare() {
				return "—"
			}
			return fmt.Sprintf(format, v)
		}
		ratio := func(v float64) string {
			if v == 0 {
				return ""
			}
			return fmt.Sprintf("%.2f", v)
		}
		interval := ""
		if iv := r.KeyInterval(); iv > 0 {
			interval = fmt.Sprintf("%.1f", iv.Seconds())
		}
		bound := ""
		if v := r.leaseBound(); v > 0 {
			bound = fmt.Sprintf("%.4f", v)
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %.0f | %.0f | %.0f | %s | %s | %s | %s | %.1f | %s | %s | %.1f | %.1f | %.1f | %s | %s | %s | %s | %.0f |\n",
			r.Case, r.API, r.Mode, r.Rate(), micros(r.Latency.Quantile(0.5)), micros(r.Latency.Quantile(0.99)),
			dash(r.PerCheck(r.Scripts), "%.4f"), dash(r.PerCheck(r.RedisCmds), "%.3f"), dash(r.PerCheck(r.StoreOps), "%.4f"), bound,
			r.CPUPerCheck(ProcAgent), dash(r.CPUPerCheck(ProcCoordinator), "%.1f"), dash(r.CPUPerCheck(ProcRedis), "%.1f"),
			r.TotalCPUPerCheck(), r.Percent(Denied), r.Percent(Unavailable), interval, ratio(q.DirectRate), ratio(q.DirectCPU), ratio(q.EmptyRate), r.Host.StealPercent())
	}
	_, _ = io.WriteString(w, b.String())
}
