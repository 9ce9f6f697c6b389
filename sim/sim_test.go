package sim

import (
	"bytes"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
)

func parse(t *testing.T, yaml string) *Scenario {
	t.Helper()
	sc, err := parseScenario(filepath.Join(t.TempDir(), "test.yaml"), []byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	return sc
}

func run(t *testing.T, sc *Scenario) *Result {
	t.Helper()
	res, err := runScenario(sc, Options{})
	if err != nil {
		t.Fatal(err)
	}
	return res
}

const perToken = int64(bucket.PerToken)

// mixed exercises every mechanism: two regions, a regional and a global rule, an emergency rule,
// Poisson and constant arrivals, bursts, Zipf and a hot key, crashes (rate and schedule), an
// outage and a partition.
const mixed = `
seed: 11
duration: 40s
home: eu
regions:
  - {name: eu, agents: 4, coordinators: 2}
  - {name: us, agents: 3}
network: {jitter: 0.3, cross_region: 20ms}
policy: |
  version: "mixed"
  rules:
    - name: orders
      routes: ["/orders/{id}"]
      operations: [read]
      limit: 600/minute
      burst: 40
    - name: catalog
      routes: ["/products/{sku}"]
      operations: [read]
      limit: 1200/minute
      burst: 60
      on_failure: emergency
      emergency: {limit: 60/minute, burst: 5}
    - name: search
      routes: [/search]
      operations: [read]
      limit: 1200/minute
      burst: 40
      scope: regional
      regions:
        eu: {limit: 600/minute, burst: 20}
        us: {limit: 600/minute, burst: 20}
  default:
    limit: 60/minute
    burst: 10
identities:
  - {name: orders, tenants: 30, path: /orders/7, operation: GET}
  - {name: catalog, tenants: [acme, globex, initech], path: /products/x, operation: GET}
  - {name: search, tenants: 10, path: /search, operation: GET}
traffic:
  - {identities: orders, rate: 150/s, skew: {zipf: 1.1}}
  - {identities: catalog, rate: 40/s, arrivals: constant, skew: {hot: 0.7}, shape: {kind: bursts, every: 10s, length: 2s, factor: 4}}
  - {identities: search, rate: 60/s, agents: eu}
  - {identities: search, rate: 20/s, agents: us}
crashes:
  rate_per_agent_hour: 120
  restart_after: 3s
  schedule:
    - {agent: 5, at: 12s, restart_after: 1s}
outages:
  - {kind: coordinator, region: us, from: 20s, to: 22s}
  - {kind: redis, from: 30s, to: 31s, mode: blackhole}
partitions:
  - {region: us, from: 25s, to: 28s}
`

// oneRule is a scenario of one rule, api on /api/* (rule: its limit and burst), and one group of
// identities, a (tenants: a count or a list), checking /api/x with GET; head is what comes before
// the policy (duration, agents), traffic the rest of a's one traffic entry.
func oneRule(head, rule, tenants, traffic string) string {
	return "\n" + head + `
policy: |
  version: "1"
  rules:
    - {name: api, routes: ["/api/*"], operations: [read], ` + rule + `}
  default: {limit: 60/minute, burst: 10}
identities:
  - {name: a, tenants: ` + tenants + `, path: /api/x, operation: GET}
traffic:
  - {identities: a, ` + traffic + `}
`
}

func report(t *testing.T, res *Result, sc *Scenario) []byte {
	t.Helper()
	var b bytes.Buffer
	if err := markdown(&b, []*Outcome{{Scenario: sc, Result: res}}); err != nil {
		t.Fatal(err)
	}
	for _, rows := range [][][]string{timelineCSV(res), identitiesCSV(res), keysCSV(res), crashesCSV(res)} {
		for _, row := range rows {
			b.WriteString(strings.Join(row, ",") + "\n")
		}
	}
	return b.Bytes()
}

// TestDeterminism: the same scenario and seed give the same report byte for byte; another seed
// gives another.
func TestDeterminism(t *testing.T) {
	sc := parse(t, mixed)
	first := report(t, run(t, sc), sc)
	again := report(t, run(t, sc), sc)
	if !bytes.Equal(first, again) {
		a, b := strings.Split(string(first), "\n"), strings.Split(string(again), "\n")
		for i := range min(len(a), len(b)) {
			if a[i] != b[i] {
				t.Fatalf("two runs with seed %d differ at line %d:\n%s\n%s", sc.Seed, i+1, a[i], b[i])
			}
		}
		t.Fatalf("two runs with seed %d differ in length: %d and %d lines", sc.Seed, len(a), len(b))
	}
	other := *sc
	other.Seed++
	if bytes.Equal(first, report(t, run(t, &other), &other)) {
		t.Fatal("seeds 11 and 12 gave the same report")
	}
}

// TestMixedHoldsTheBounds: under crashes, outages and a partition, no bound breaks and every
// mechanism was exercised, with leases and with every rule in direct mode (lease: off).
func TestMixedHoldsTheBounds(t *testing.T) {
	for _, lease := range []float64{1, 0} {
		t.Run(sweepValue("lease", lease), func(t *testing.T) {
			sc, err := parse(t, mixed).With("lease", lease)
			if err != nil {
				t.Fatal(err)
			}
			mixedHolds(t, run(t, sc))
		})
	}
}

func mixedHolds(t *testing.T, res *Result) {
	t.Helper()
	if res.Failed() {
		t.Fatalf("violations: %+v", res.Violations)
	}
	tt := &res.Totals
	for name, v := range map[string]int64{
		"crashes": int64(len(res.Crashes)), "503": tt.Unavailable, "degraded": tt.Degraded, "failed calls": res.Backend.FailedCalls,
		"429": tt.Denied, "waited": tt.Waited, "fallbacks": res.Latency.FellBack,
	} {
		if v == 0 {
			t.Errorf("%s = 0: the scenario did not exercise it", name)
		}
	}
	if !slices.ContainsFunc(res.Crashes, func(c Crash) bool { return c.Agent == 5 && c.At == 12*time.Second }) {
		t.Errorf("the scheduled crash of agent 5 at 12s is missing: %+v", res.Crashes)
	}
	l := &res.Loss
	if got := l.Spent + l.Returned + l.Expired + l.Stranded + l.HeldAtEnd; got != l.Granted {
		t.Errorf("granted %d µ ≠ spent %d + returned %d + expired %d + stranded %d + held %d = %d", l.Granted, l.Spent, l.Returned, l.Expired, l.Stranded, l.HeldAtEnd, got)
	}
	if got := l.Credited + l.Decayed + l.Lost; got != l.Returned {
		t.Errorf("returned %d µ ≠ credited %d + decayed %d + lost %d = %d", l.Returned, l.Credited, l.Decayed, l.Lost, got)
	}
	if l.Spent != tt.AllowedTokens*perToken {
		t.Errorf("spent %d µ, but %d tokens were admitted from leases", l.Spent, tt.AllowedTokens)
	}
}

// TestUnderQuota (by hand): one agent, 10 requests a second, evenly spaced, for 60 s against a
// limit of 20 a second: all 600 are admitted, as the ideal limiter does; the first check waits
// for the first lease, one round trip: 2 × (500 µs + 250 µs) = 1.5 ms.
func TestUnderQuota(t *testing.T) {
	res := run(t, parse(t, oneRule("duration: 60s\nagents: 1", "limit: 1200/minute, burst: 100", "[acme]", "rate: 10/s, arrivals: constant")))
	tt := &res.Totals
	if tt.Requests != 600 || tt.IdealTokens != 600 || tt.AllowedTokens != 600 || tt.Denied != 0 || tt.Unavailable != 0 {
		t.Fatalf("requests %d, ideal %d, admitted %d, 429 %d, 503 %d; want 600, 600, 600, 0, 0",
			tt.Requests, tt.IdealTokens, tt.AllowedTokens, tt.Denied, tt.Unavailable)
	}
	if tt.Waited < 1 || res.Latency.WaitMax != 1500*time.Microsecond {
		t.Fatalf("%d checks waited, the longest %s; want the first, 1.5ms", tt.Waited, res.Latency.WaitMax)
	}
	if res.Failed() {
		t.Fatal(res.Violations)
	}
}

// TestExhaustedBucket (by hand): a bucket of 2 tokens that refills one token an hour, 100
// requests in 10 s: exactly 2 are admitted (by the agents as by the ideal limiter) and 98 denied.
// With one agent no denial is false: no token is anywhere when it denies. (With three, one may
// deny while another holds the last token: that is what a false deny is.)
func TestExhaustedBucket(t *testing.T) {
	for _, agents := range []int{1, 3} {
		sc := parse(t, oneRule("duration: 10s\nagents: 1", "limit: 1/hour, burst: 2", "[acme]", "rate: 10/s, arrivals: constant"))
		sc, err := sc.With("agents", float64(agents))
		if err != nil {
			t.Fatal(err)
		}
		tt := &run(t, sc).Totals
		if tt.Requests != 100 || tt.IdealTokens != 2 || tt.AllowedTokens != 2 || tt.Denied != 98 {
			t.Errorf("%d agents: requests %d, ideal %d, admitted %d, 429 %d; want 100, 2, 2, 98",
				agents, tt.Requests, tt.IdealTokens, tt.AllowedTokens, tt.Denied)
		}
		if agents == 1 && tt.FalseDenied != 0 {
			t.Errorf("one agent: %d false denies, want 0", tt.FalseDenied)
		}
	}
}

// TestSteadyOverload (by hand): 10 requests a second, evenly spaced, for 30 s against 1 a second
// with a burst of 10. The ideal limiter admits the burst, then one request per refilled token:
// the last arrival, at 29.9 s plus a phase under 0.1 s, has seen less than 30 tokens refilled, so
// 10 + 29 = 39. The agents may admit more, but within C + r·(w + τ) = 10 + 30 + 2.5 (τ = C/(4r)).
func TestSteadyOverload(t *testing.T) {
	res := run(t, parse(t, oneRule("duration: 30s\nagents: 2", "limit: 60/minute, burst: 10", "[acme]", "rate: 10/s, arrivals: constant, agents: [0]")))
	tt := &res.Totals
	if tt.IdealTokens != 39 {
		t.Errorf("ideal admitted %d, want 39", tt.IdealTokens)
	}
	if tt.AllowedTokens > 42 || tt.AllowedTokens < 30 {
		t.Errorf("agents admitted %d, want at most 42 (the admission bound) and not far below 39", tt.AllowedTokens)
	}
	if res.Failed() {
		t.Fatal(res.Violations)
	}
}

// crashes is a fleet in steady demand whose agents crash on a schedule.
var crashes = oneRule("seed: 3\nduration: 60s\nagents: 6", "limit: 6000/minute, burst: 1000", "8", "rate: 700/s") + `crashes:
  restart_after: 5s
  schedule:
    - {agent: 0, at: 10s}
    - {agent: 1, at: 20s}
    - {agent: 2, at: 20s}
    - {agent: 0, at: 30s}
    - {agent: 5, at: 45s, restart_after: 20s}
`

// TestCrashStrandsOutstanding: what crashed agents strand is exactly what their lease cores held
// when they died plus the grants of their calls in flight.
func TestCrashStrandsOutstanding(t *testing.T) {
	res := run(t, parse(t, crashes))
	if len(res.Crashes) != 5 {
		t.Fatalf("%d crashes, want the 5 scheduled", len(res.Crashes))
	}
	var stranded int64
	for _, c := range res.Crashes {
		if c.Stranded != c.Outstanding {
			t.Errorf("agent %s stranded %d µ, its outstanding leases were %d µ", c.ID, c.Stranded, c.Outstanding)
		}
		if c.Stranded <= 0 {
			t.Errorf("agent %s stranded nothing: the scenario must crash agents holding leases", c.ID)
		}
		stranded += c.Stranded
	}
	if res.Loss.Stranded != stranded || res.Loss.Outstanding != stranded {
		t.Errorf("loss: stranded %d µ, outstanding %d µ; the crashes sum to %d µ", res.Loss.Stranded, res.Loss.Outstanding, stranded)
	}
	if res.Failed() {
		t.Fatal(res.Violations)
	}
}

// TestCrashesWithRefillsInFlight: the shipped crash-loss scenario with agents crashing every
// six seconds each. A crash often comes while a key's refill is out and its retired lease waits
// for that call to be handed back; what the agent held by its own account must be what it sends
// after Close plus what those calls hold up (Limiter.Withheld), and no crash may strand more than
// the agent held. Without Withheld the autopsy missed those hand-backs: conservation and loss
// violations within two minutes.
func TestCrashesWithRefillsInFlight(t *testing.T) {
	sc, err := Load("../examples/sim/crash-loss.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if sc, err = sc.With("crash_rate", 600); err != nil {
		t.Fatal(err)
	}
	sc.Duration = Duration(2 * time.Minute)
	res := run(t, sc)
	if len(res.Crashes) < 100 {
		t.Fatalf("%d crashes, want hundreds", len(res.Crashes))
	}
	if res.Failed() {
		t.Fatal(res.Violations)
	}
}

// TestBrokenGrantRuleFails: a store that hands out twice what it debits lets agents admit more
// than C + r·(w + τ) once demand exceeds the quota; the admission check catches it, and the
// budget check too.
func TestBrokenGrantRuleFails(t *testing.T) {
	sc, err := parse(t, crashes+"faults: {overgrant_factor: 2}\n").With("load", 3)
	if err != nil {
		t.Fatal(err)
	}
	sc.Crashes.Schedule = nil
	res := run(t, sc)
	kinds := map[string]bool{}
	for _, v := range res.Violations {
		kinds[v.Kind] = true
	}
	if !res.Failed() || !kinds["admission"] || !kinds["budget"] {
		t.Fatalf("violations %+v; want admission and budget", res.Violations)
	}
	var b bytes.Buffer
	if err := markdown(&b, []*Outcome{{Scenario: sc, Result: res}}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "FAILED") {
		t.Fatal("the report does not say the run failed")
	}
	// A sweep point that breaks a bound says which, under the sweep's table.
	swept := *sc
	swept.Sweep = &Sweep{Parameter: "load", Values: []float64{1}, Duration: Duration(20 * time.Second)}
	sw, err := runSweep(&swept, Options{})
	if err != nil {
		t.Fatal(err)
	}
	b.Reset()
	if err := markdown(&b, []*Outcome{{Scenario: &swept, Result: res, Sweep: sw}}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "**FAILED at load 1: ") || !strings.Contains(b.String(), "- admission at ") {
		t.Fatal("the report does not list the violations of the failed sweep point")
	}
	// The same scenario with the real grant rule holds.
	sc.Faults.OvergrantFactor = 0
	if res := run(t, sc); res.Failed() {
		t.Fatalf("the real grant rule broke a bound: %+v", res.Violations)
	}
}

func TestDropTraffic(t *testing.T) {
	sc := parse(t, crashes)
	sc.Crashes.Traffic = "drop"
	res := run(t, sc)
	if res.Dropped == 0 || res.Totals.Unanswered > 0 && res.Dropped == 0 {
		t.Fatalf("dropped %d requests while agents were down", res.Dropped)
	}
	redirect := run(t, parse(t, crashes))
	if redirect.Dropped != 0 || redirect.Totals.Requests != res.Totals.Requests+res.Dropped {
		t.Fatalf("redirect: %d requests, %d dropped; drop: %d requests + %d dropped",
			redirect.Totals.Requests, redirect.Dropped, res.Totals.Requests, res.Dropped)
	}
}

func TestSweep(t *testing.T) {
	sc := parse(t, crashes+"sweep: {parameter: crash_rate, values: [0, 600], duration: 20s}\n")
	sc.Crashes.Schedule = nil
	s, err := runSweep(sc, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Points) != 2 || s.Points[0].Value != 0 || s.Points[1].Value != 600 {
		t.Fatalf("points %+v", s.Points)
	}
	if n := len(s.Points[0].Crashes); n != 0 {
		t.Errorf("crash rate 0: %d crashes", n)
	}
	if n := len(s.Points[1].Crashes); n < 5 {
		t.Errorf("crash rate 600/h on 6 agents for 20 s: %d crashes, want about 20", n)
	}
	if s.Points[0].Duration != 20*time.Second {
		t.Errorf("sweep point ran %s, want the sweep's 20s", s.Points[0].Duration)
	}
	rows := sweepCSV(s)
	if len(rows) != 3 || rows[0][0] != "crash_rate" {
		t.Errorf("sweep CSV %v", rows)
	}
}

func TestWith(t *testing.T) {
	sc := parse(t, mixed)
	sc.Crashes.Schedule = nil
	for _, tc := range []struct {
		param string
		v     float64
		check func(*Scenario) bool
	}{
		{"agents", 14, func(c *Scenario) bool {
			return c.numAgents() == 14 && c.Regions[0].Agents == 8 && len(c.Traffic[2].nodes) == 8
		}},
		{"crash_rate", 3, func(c *Scenario) bool { return c.Crashes.RatePerAgentHour == 3 }},
		{"load", 2, func(c *Scenario) bool { return c.Traffic[0].Rate == 300 && c.Traffic[1].Rate == 80 }},
		{"zipf", 0.7, func(c *Scenario) bool { return c.Traffic[0].Skew.Zipf == 0.7 && c.Traffic[1].Skew.Zipf == 0 }},
		{"hot_share", 0.2, func(c *Scenario) bool { return c.Traffic[1].Skew.Hot == 0.2 && c.Traffic[0].Skew.Hot == 0 }},
		{"want_factor", 1.5, func(c *Scenario) bool { return c.Agent.WantFactor == 1.5 }},
		{"lease", 0, func(c *Scenario) bool {
			return c.policy.Rule("orders").Direct && c.policy.Rule("catalog").Direct && c.policy.Rule("search").Direct
		}},
		{"lease", 1, func(c *Scenario) bool { return !c.policy.Rule("orders").Direct && !c.policy.Rule("search").Direct }},
		{"burst_factor", 2, func(c *Scenario) bool {
			r := c.policy.Rule("search")
			return c.policy.Rule("orders").Quota.Burst == 80 && r.Regions[0].Burst == 40 && r.Quota.Burst == 80 &&
				c.policy.Rule("catalog").Emergency.Burst == 10
		}},
	} {
		c, err := sc.With(tc.param, tc.v)
		if err != nil {
			t.Errorf("With(%s, %v): %v", tc.param, tc.v, err)
			continue
		}
		if !tc.check(c) {
			t.Errorf("With(%s, %v) did not apply", tc.param, tc.v)
		}
	}
	if sc.numAgents() != 7 || sc.Traffic[0].Rate != 150 || sc.policy.Rule("orders").Quota.Burst != 40 || sc.policy.Rule("orders").Direct {
		t.Error("With changed the original scenario")
	}
	for _, bad := range []struct {
		param string
		v     float64
	}{{"agents", 1}, {"hot_share", 2}, {"want_factor", 0}, {"lease", 0.5}, {"tick", 1}} {
		if _, err := sc.With(bad.param, bad.v); err == nil {
			t.Errorf("With(%s, %v) succeeded", bad.param, bad.v)
		}
	}
}

func TestParseErrors(t *testing.T) {
	base := oneRule("duration: 10s\nagents: 2", "limit: 60/minute, burst: 10", "3", "rate: 10/s")
	for _, tc := range []struct{ extra, want string }{
		{"tick: 2ms\n", "tick"},
		{"crashes: {traffic: somewhere}\n", "crashes.traffic"},
		{"outages: [{kind: dns, from: 1s, to: 2s}]\n", "kind"},
		{"outages: [{kind: redis, from: 2s, to: 1s}]\n", "after from"},
		{"partitions: [{region: mars, from: 1s, to: 2s}]\n", "partitions[0]"},
		{"sweep: {parameter: colour, values: [1]}\n", "sweep.parameter"},
		{"sweep: {parameter: lease, values: [1, 2]}\n", "lease 2"},
		{"faults: {overgrant_factor: 0.5}\n", "overgrant"},
		{"agent: {max_wait: soon}\n", "not a duration"},
		{"unknown_field: 1\n", "unknown_field"},
		{"capacity: {target_utilisation: 0.5}\n", "peak_checks_per_second"},
	} {
		_, err := parseScenario("bad.yaml", []byte(base+tc.extra))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want one mentioning %q", tc.extra, err, tc.want)
		}
	}
	for _, tc := range []struct{ old, new, want string }{
		{"rate: 10/s", "rate: 10/week", "rate"},
		{"rate: 10/s", "rate: 10/s, skew: {cycle: true, zipf: 1}", "one of zipf, hot or cycle"},
		{"identities: a, rate", "identities: b, rate", "no identities group"},
		{"tenants: 3", "tenants: 0", "tenants"},
		{"path: /api/x", "path: ''", "path and operation"},
		{"limit: 60/minute, burst: 10}\n  default", "limit: 60/fortnight, burst: 10}\n  default", "limit"},
		{"limit: 60/minute, burst: 10}\n  default", "quota: 60/day}\n  default", "calendar quotas (quota: 60/day) are not simulated"},
	} {
		_, err := parseScenario("bad.yaml", []byte(strings.Replace(base, tc.old, tc.new, 1)))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q → %q: error %v, want one mentioning %q", tc.old, tc.new, err, tc.want)
		}
	}
}

// TestCyclePicker: a cycle picks every request exactly once in each round of len(reqs) picks, in
// an order that is not the identity (it is drawn from the seed) and is the same every round.
func TestCyclePicker(t *testing.T) {
	reqs := make([]int32, 50)
	for i := range reqs {
		reqs[i] = int32(100 + i)
	}
	p := newPicker(reqs, Skew{Cycle: true})
	r := rand.New(rand.NewPCG(1, 2))
	var first []int32
	for round := range 3 {
		seen := map[int32]bool{}
		var order []int32
		for range reqs {
			q := p.pick(r)
			if seen[q] || q < 100 || q >= 150 {
				t.Fatalf("round %d: pick %d repeated or not a request", round, q)
			}
			seen[q] = true
			order = append(order, q)
		}
		if first == nil {
			first = order
			if slices.Equal(order, reqs) {
				t.Fatal("the cycle walks the requests in their own order, not a drawn one")
			}
		} else if !slices.Equal(order, first) {
			t.Fatalf("round %d walks %v, round 0 walked %v", round, order, first)
		}
	}
}

// TestExamples runs every shipped scenario briefly, its traffic scaled down: they parse, run on
// the current core and hold every bound.
func TestExamples(t *testing.T) {
	files, err := filepath.Glob("../examples/sim/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no examples: %v", err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			sc, err := Load(f)
			if err != nil {
				t.Fatal(err)
			}
			var rate float64
			for _, tr := range sc.Traffic {
				rate += float64(tr.Rate)
			}
			if sc, err = sc.With("load", min(1, 20_000/rate)); err != nil {
				t.Fatal(err)
			}
			sc.Duration, sc.Warmup = Duration(3*time.Second), 0
			res := run(t, sc)
			if res.Totals.Requests == 0 || res.Failed() {
				t.Fatalf("%d requests, violations %+v", res.Totals.Requests, res.Violations)
			}
		})
	}
}
