package stackbench

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"
)

// TestSummaryRatios: a lease row is compared with the direct row of its case and API and with the
// empty row of its API (whatever the case: another case's rows too), a direct row with the empty
// row only; per-check figures divide by the checks answered; the last column is the steal.
func TestSummaryRatios(t *testing.T) {
	run := func(m Mode, checks int64, cpu time.Duration) Result {
		r := Result{Case: "hot", API: Unary, Mode: m, Dist: Dist{Kind: Hot, N: 1}}
		r.Wall = time.Second
		r.Outcomes[Allowed] = checks
		r.CPU[ProcAgent] = cpu
		return r
	}
	var s Summary
	s.Add(run(Empty, 1000, 10*time.Millisecond))     // 10 µs/check
	s.Add(run(Direct, 500, 20*time.Millisecond))     // 40 µs/check
	leaseRun := run(Lease, 800, 16*time.Millisecond) // 20 µs/check
	leaseRun.Host = HostCPU{Total: 400, Steal: 20}   // 5 % stolen
	s.Add(leaseRun)
	s.Add(Result{Case: "other", API: Unary, Mode: Lease, Window: Window{Wall: time.Second, Outcomes: [numOutcomes]int64{Allowed: 1}}})
	s.Add(Result{Case: "other", API: Stream, Mode: Lease, Window: Window{Wall: time.Second, Outcomes: [numOutcomes]int64{Allowed: 1}}})
	lease := s.Find("hot", Unary, Lease)
	if got := lease.TotalCPUPerCheck(); got != 20 {
		t.Errorf("lease CPU/check = %v µs, want 20", got)
	}
	q := RatiosOf(lease, s.Find("hot", Unary, Direct), s.Find("hot", Unary, Empty))
	if q != (Ratios{DirectRate: 1.6, DirectCPU: 0.5, EmptyRate: 0.8}) {
		t.Errorf("RatiosOf = %+v", q)
	}
	var out strings.Builder
	s.Write(&out)
	rows := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(rows) != 7 {
		t.Fatalf("%d lines:\n%s", len(rows), out.String())
	}
	for i, want := range []string{
		"| hot | unary | empty | 1000 |",
		"| hot | unary | direct | 500 |",
		"| hot | unary | lease | 800 |",
		"| other | unary | lease | 1 |",
		"| other | stream | lease | 1 |",
	} {
		if !strings.HasPrefix(rows[i+2], want) {
			t.Errorf("row %d = %q, want it to start %q", i, rows[i+2], want)
		}
	}
	if !strings.HasSuffix(rows[3], "|  |  | 0.50 | 0 |") || !strings.HasSuffix(rows[4], "|  | 1.60 | 0.50 | 0.80 | 5 |") || !strings.HasSuffix(rows[5], "|  |  |  | 0.00 | 0 |") || !strings.HasSuffix(rows[6], "|  |  |  |  | 0 |") {
		t.Errorf("ratio and steal columns:\n%s", out.String())
	}
}

// TestResultMerge: windows of one run merged give the figures of one window as long as all of
// them: rates and per-check figures over the summed wall time and checks, the latencies of
// both, the first failure.
func TestResultMerge(t *testing.T) {
	first := Result{Case: "zipf", API: Unary, Mode: Lease}
	first.Wall = time.Second
	first.Outcomes[Allowed], first.Outcomes[Denied] = 900, 100
	first.Total[Allowed] = 1200
	first.CPU[ProcAgent], first.CPU[ProcRedis] = 40*time.Millisecond, 10*time.Millisecond
	first.StoreOps, first.Calls, first.Scripts, first.RedisCmds = 400, 20, 30, 120
	first.Latency.Record(time.Millisecond)
	first.Host = HostCPU{Total: 200, Steal: 0}
	first.AgentGC = GCCPU{GC: 0.01, Busy: 0.2}
	second := first
	second.Latency = Hist{}
	second.Wall = 3 * time.Second
	second.Outcomes[Allowed], second.Outcomes[Denied] = 2700, 300
	second.CPU[ProcAgent] = 200 * time.Millisecond
	second.StoreOps = 1200
	second.Err = errors.New("a failure")
	second.Host = HostCPU{Total: 600, Steal: 80}
	second.AgentGC = GCCPU{GC: 0.05, Busy: 0.3}
	for range 3 {
		second.Latency.Record(3 * time.Millisecond)
	}
	first.Merge(second)
	if got := first.Rate(); got != 1000 {
		t.Errorf("rate %v, want 1000 checks/s (4000 over 4 s)", got)
	}
	if got := first.CPUPerCheck(ProcAgent); got != 60 {
		t.Errorf("agent CPU %v µs/check, want 60 (240 ms over 4000)", got)
	}
	if got := first.PerCheck(first.StoreOps); got != 0.4 {
		t.Errorf("store ops %v per check, want 0.4", got)
	}
	if first.Percent(Denied) != 10 || first.Total[Allowed] != 2400 || first.Calls != 40 || first.RedisCmds != 240 {
		t.Errorf("denied %v %%, total %d, calls %v, commands %v", first.Percent(Denied), first.Total[Allowed], first.Calls, first.RedisCmds)
	}
	if first.Latency.Count() != 4 || first.Latency.Quantile(0.5) < 2*time.Millisecond {
		t.Errorf("latencies: %d, p50 %v; want 4 with the second window's 3 ms at the median", first.Latency.Count(), first.Latency.Quantile(0.5))
	}
	if first.Err == nil {
		t.Error("the second window's failure is lost")
	}
	if got := first.Host.StealPercent(); got != 10 {
		t.Errorf("steal %v %%, want 10 (80 of 800 ticks)", got)
	}
	if got := first.AgentGC.Percent(); math.Abs(got-12) > 1e-9 {
		t.Errorf("agents' collector %v %%, want 12 (0.06 s of 0.5 s busy)", got)
	}
	if got := (GCCPU{}).Percent(); got != 0 {
		t.Errorf("collector's share over no busy CPU %v %%, want 0", got)
	}
}

// TestParseHostCPU: /proc/stat's first line, with and without the steal field (kernels before
// 2.6.11), guest time left out as it is already in user and nice; anything else is an error.
func TestParseHostCPU(t *testing.T) {
	for _, tc := range []struct {
		name, stat string
		want       HostCPU
		err        bool
	}{
		{"a current kernel", "cpu  4705 150 1120 16250 520 0 25 300 40 0\ncpu0 2350 75 560 8125 260 0 12 150 20 0\n", HostCPU{Total: 23070, Steal: 300}, false},
		{"no steal field", "cpu  4705 150 1120 16250 520 0 25\n", HostCPU{Total: 22770}, false},
		{"not the cpu line", "intr 12345 0 0\n", HostCPU{}, true},
		{"a field that is not a number", "cpu  4705 150 x 16250 520 0 25 300\n", HostCPU{}, true},
		{"empty", "", HostCPU{}, true},
	} {
		got, err := parseHostCPU(tc.stat)
		if (err != nil) != tc.err || got != tc.want {
			t.Errorf("%s: parseHostCPU = %+v, %v; want %+v, error %t", tc.name, got, err, tc.want, tc.err)
		}
	}
	h, err := ReadHostCPU()
	if err != nil || h.Total <= 0 || h.Steal < 0 || h.Steal > h.Total {
		t.Errorf("ReadHostCPU() = %+v, %v: want this machine's ticks so far", h, err)
	}
}

// TestRatiosSpread: slices merged in the order measured are paired round by round, each ratio's
// least and most over the rounds reported beside it; runs of one slice, or of slices that do not
// pair, have no spread.
func TestRatiosSpread(t *testing.T) {
	slice := func(m Mode, checks int64, cpu time.Duration) Result {
		r := Result{Case: "uniform-10k", API: Unary, Mode: m}
		r.Wall = time.Second
		r.Outcomes[Allowed] = checks
		r.CPU[ProcAgent] = cpu
		r.Slices = []Slice{r.slice()}
		return r
	}
	direct, lease, empty := slice(Direct, 1000, 100*time.Millisecond), slice(Lease, 900, 99*time.Millisecond), slice(Empty, 2000, 20*time.Millisecond)
	if q := RatiosOf(&lease, &direct, &empty); q.DirectRateSpread != (Spread{}) || q.EmptyRateSpread != (Spread{}) {
		t.Errorf("one slice each: spread %+v", q)
	}
	// rounds 2 and 3: lease 1100 checks at 88 ms (80 µs/check), then 1000 at 120 ms; direct
	// 1000 at 100 ms, then 1250 at 125 ms; the empty handler 2000 at 20 ms, then 2500 at 25 ms
	direct.Merge(slice(Direct, 1000, 100*time.Millisecond))
	direct.Merge(slice(Direct, 1250, 125*time.Millisecond))
	lease.Merge(slice(Lease, 1100, 88*time.Millisecond))
	lease.Merge(slice(Lease, 1000, 120*time.Millisecond))
	empty.Merge(slice(Empty, 2000, 20*time.Millisecond))
	empty.Merge(slice(Empty, 2500, 25*time.Millisecond))
	q := RatiosOf(&lease, &direct, &empty)
	if q.DirectRate != 3000.0/3250 {
		t.Errorf("x-direct checks/s %v, want the whole runs' 3000/3250", q.DirectRate)
	}
	want := Ratios{
		DirectRate: q.DirectRate, DirectCPU: q.DirectCPU, EmptyRate: q.EmptyRate,
		DirectRateSpread: Spread{Min: 0.8, Max: 1.1},  // 900/1000, 1100/1000, 1000/1250
		DirectCPUSpread:  Spread{Min: 0.8, Max: 1.2},  // 110/100, 80/100, 120/100 µs per check
		EmptyRateSpread:  Spread{Min: 0.4, Max: 0.55}, // 900/2000, 1100/2000, 1000/2500
	}
	if q != want {
		t.Errorf("RatiosOf = %+v\nwant %+v", q, want)
	}
	empty.Merge(slice(Empty, 2000, 20*time.Millisecond)) // a fourth slice pairs with nothing
	if q := RatiosOf(&lease, &direct, &empty); q.EmptyRateSpread != (Spread{}) || q.DirectRateSpread == (Spread{}) {
		t.Errorf("slices that do not pair: %+v", q)
	}
}

// summaryRows writes the table of one run a second per mode of modes, each allowing its checks
// (10 µs of agent CPU a check), in case c and API a, and returns its lines.
func summaryRows(c string, a API, d Dist, modes []Mode, checks []int64) (string, []string) {
	var s Summary
	for i, m := range modes {
		res := Result{Case: c, API: a, Mode: m, Dist: d}
		res.Wall = time.Second
		res.Outcomes[Allowed] = checks[i]
		res.CPU[ProcAgent] = time.Duration(checks[i]) * 10 * time.Microsecond
		s.Add(res)
	}
	var out strings.Builder
	s.Write(&out)
	return out.String(), strings.Split(strings.TrimSpace(out.String()), "\n")
}

// TestSummaryControl: the A/A control's row is compared with the direct row of its case and API,
// as a lease row is.
func TestSummaryControl(t *testing.T) {
	out, rows := summaryRows("uniform-10k", Stream, Dist{Kind: Uniform, N: 10_000}, []Mode{Direct, Control}, []int64{1000, 950})
	if len(rows) != 4 || !strings.HasPrefix(rows[3], "| uniform-10k | stream | control | 950 |") || !strings.HasSuffix(rows[3], "| 0.95 | 1.00 |  | 0 |") {
		t.Errorf("the control row is not compared with direct:\n%s", out)
	}
}

// TestSummaryEmptyControl: the second empty handler's row is compared with the first (×empty),
// has no store figures, and the first has no ratio.
func TestSummaryEmptyControl(t *testing.T) {
	out, rows := summaryRows("hot", Unary, Dist{Kind: Hot, N: 1}, []Mode{Empty, EmptyControl}, []int64{1000, 1040})
	if len(rows) != 4 || !strings.HasPrefix(rows[2], "| hot | unary | empty | 1000 |") || !strings.HasSuffix(rows[2], "|  |  |  | 0 |") ||
		!strings.HasPrefix(rows[3], "| hot | unary | empty-control | 1040 | 0 | 0 | — | — | — |") || !strings.HasSuffix(rows[3], "|  |  | 1.04 | 0 |") {
		t.Errorf("the second empty handler's row is not compared with the first:\n%s", out)
	}
}

// TestOpsBound: the fewest store operations per check leases could take, against values worked
// out by hand (Zipf: the sum over 100,000 keys computed apart, at the rates of the README's runs)
// and the cases' limits: more agents take more (each keeps its own leases of its share of a key's
// checks), a faster load fewer; the uniform walk's keys colder than τ take one each; a lease row
// of the summary shows it, a direct row does not.
func TestOpsBound(t *testing.T) {
	run := func(d Dist, agents int, rate int64) *Result {
		r := &Result{Dist: d, Agents: agents, Mode: Lease}
		r.Wall = time.Second
		r.Outcomes[Allowed] = rate
		return r
	}
	zipf := Dist{Kind: Zipf, N: 100_000, S: 1.1}
	for _, c := range []struct {
		r    *Result
		want float64
	}{
		{run(zipf, 1, 19_711), 0.33046},
		{run(zipf, 0, 19_711), 0.33046}, // no agents recorded: one
		{run(zipf, 1, 15_222), 0.34839},
		{run(zipf, 4, 15_222), 0.45199},
		{run(Dist{Kind: Hot, N: 1}, 1, 1000), 1.0 / 251},
		{run(Dist{Kind: Hot, N: 1}, 4, 1000), 4.0 / 254},
		{run(Dist{Kind: Uniform, N: 10_000}, 4, 5000), 1},   // each key every 2 s
		{run(Dist{Kind: Uniform, N: 10_000}, 1, 50_000), 0}, // every 200 ms: not given
		{run(Dist{Kind: Zipf, N: 100, S: 2}, 1, 0), 0},      // no checks
	} {
		if got := c.r.OpsBound(TTL); math.Abs(got-c.want) > 5e-6 {
			t.Errorf("%+v, %d agents, %.0f checks/s: bound %.6f, want %.6f", c.r.Dist, c.r.Agents, c.r.Rate(), got, c.want)
		}
	}
	var s Summary
	direct, lease := *run(zipf, 4, 15_222), *run(zipf, 4, 15_222)
	direct.Case, direct.Mode, lease.Case = "zipf", Direct, "zipf"
	s.Add(direct)
	s.Add(lease)
	var out strings.Builder
	s.Write(&out)
	rows := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(rows) != 4 {
		t.Fatalf("%d lines:\n%s", len(rows), out.String())
	}
	// case, API, mode, checks/s, p50, p99, scripts, commands, store ops, bound
	if col := strings.Split(rows[2], "|")[10]; col != "  " {
		t.Errorf("direct row's bound column %q, want empty:\n%s", col, out.String())
	}
	if col := strings.Split(rows[3], "|")[10]; col != " 0.4520 " {
		t.Errorf("lease row's bound column %q, want 0.4520:\n%s", col, out.String())
	}
}
