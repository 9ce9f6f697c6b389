package sim

import (
	"strings"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
)

// TestDirectMode: the crash scenario three times over its quota with every rule lease: off. Every
// bound holds with the admission bound of direct mode, C + r·(w + max wait): a check is served
// only by a take made while it waited. A crash strands only the grants of calls in flight, less
// than the leases it strands with lease: on, and leases take fewer store operations per check.
func TestDirectMode(t *testing.T) {
	base, err := parse(t, crashes).With("load", 3)
	if err != nil {
		t.Fatal(err)
	}
	results := map[float64]*Result{}
	for _, v := range []float64{0, 1} {
		sc, err := base.With("lease", v)
		if err != nil {
			t.Fatal(err)
		}
		if got := sc.policy.Rule("api").Direct; got != (v == 0) {
			t.Fatalf("lease %v: rule api Direct = %t", v, got)
		}
		res := run(t, sc)
		if res.Failed() {
			t.Fatalf("lease %v: violations %+v", v, res.Violations)
		}
		if res.Totals.Denied == 0 || res.Totals.AllowedTokens == 0 || len(res.Crashes) != 5 {
			t.Fatalf("lease %v: %d admitted, %d denied, %d crashes: the scenario must overload the keys and crash agents",
				v, res.Totals.AllowedTokens, res.Totals.Denied, len(res.Crashes))
		}
		l := &res.Loss
		if got := l.Spent + l.Returned + l.Expired + l.Stranded + l.HeldAtEnd; got != l.Granted {
			t.Errorf("lease %v: granted %d µ ≠ spent %d + returned %d + expired %d + stranded %d + held %d = %d",
				v, l.Granted, l.Spent, l.Returned, l.Expired, l.Stranded, l.HeldAtEnd, got)
		}
		results[v] = res
	}
	direct, leased := results[0], results[1]
	wait := base.Agent.MaxWait.D()
	for _, k := range direct.Keys {
		c := float64(k.CapacityMicro)
		want := c + k.RatePerSecond*(wait+time.Millisecond).Seconds()
		if k.TTL != 0 || k.Lag != wait || k.AdmitBound < want-1 || k.AdmitBound > want+1 {
			t.Errorf("direct key %s: τ %s, lag %s, admission bound %.0f µ; want 0, %s, %.0f", k.Key, k.TTL, k.Lag, k.AdmitBound, wait, want)
		}
		if k.AdmitExcess < c {
			t.Errorf("direct key %s: the busiest window spent %.0f µ over the refill, less than C: the key was not overloaded", k.Key, k.AdmitExcess)
		}
	}
	for _, k := range leased.Keys {
		if k.TTL == 0 || k.Lag != k.TTL {
			t.Errorf("leased key %s: τ %s, lag %s", k.Key, k.TTL, k.Lag)
		}
	}
	stranded := func(r *Result) (n int64) {
		for _, c := range r.Crashes {
			if c.Stranded != c.Outstanding {
				t.Errorf("agent %s stranded %d µ, held %d µ", c.ID, c.Stranded, c.Outstanding)
			}
			n += c.Stranded
		}
		return n
	}
	if d, l := stranded(direct), stranded(leased); d >= l {
		t.Errorf("crashes stranded %d µ in direct mode, %d µ with leases: direct mode holds no lease", d, l)
	}
	if d, l := direct.StoreOpsPerCheck(), leased.StoreOpsPerCheck(); d < 5*l {
		t.Errorf("store operations per check: direct %.4f, leases %.4f; leases must amortise a key this hot", d, l)
	}
}

// TestDirectBoundTrips feeds the admission check of a direct key a synthetic series: a burst of
// C + r·(max wait) at once, then the refill at its rate, holds; a token more trips it, where the
// same series on a leased key (τ = 250 ms) holds.
func TestDirectBoundTrips(t *testing.T) {
	const tok = float64(bucket.PerToken)
	limit, err := bucket.NewLimit(100*bucket.PerToken, 100*bucket.PerToken, 1000) // 100 tokens/s, burst 100: τ = 250 ms
	if err != nil {
		t.Fatal(err)
	}
	wait := 50 * time.Millisecond
	feed := func(direct bool, extra float64) *Result {
		w := &world{violSeen: map[string]bool{}, timeline: make([]Second, 10)}
		k := newKey("k", 0, limit, 0)
		if direct {
			k.direct(wait)
		}
		// C + r·(50 ms + 1 ms) = 105.1 tokens at once, less half a token, then the refill for 5 s
		w.spend(k, 0, 105.1*tok-tok/2+extra*tok)
		for i := 1; i <= 50; i++ {
			w.now = int64(i) * int64(100*time.Millisecond)
			w.spend(k, w.now, 10*tok)
		}
		return &w.res
	}
	if r := feed(true, 0); r.Failed() {
		t.Fatalf("within the direct bound: %+v", r.Violations)
	}
	r := feed(true, 1)
	if !r.Failed() || r.Violations[0].Kind != "admission" || !strings.Contains(r.Violations[0].Detail, "lease: off") {
		t.Fatalf("a token over the direct bound: violations %+v, want an admission violation", r.Violations)
	}
	if r := feed(false, 1); r.Failed() {
		t.Fatalf("a leased key allows r·τ = 25 tokens more: %+v", r.Violations)
	}
}

// TestLeaseParameterReplaces: lease 1 turns a rule written lease: off back on, and the policy
// otherwise stays as written.
func TestLeaseParameterReplaces(t *testing.T) {
	sc := parse(t, oneRule("duration: 1s\nagents: 1", "limit: 10/second, burst: 20, lease: off", "[acme]", "rate: 1/s"))
	if !sc.policy.Rule("api").Direct {
		t.Fatal("the rule is written lease: off")
	}
	on, err := sc.With("lease", 1)
	if err != nil {
		t.Fatal(err)
	}
	if r := on.policy.Rule("api"); r.Direct || r.Quota.Burst != 20 || on.policy.Version() != sc.policy.Version() {
		t.Fatalf("lease 1: direct %t, burst %d, version %q", r.Direct, r.Quota.Burst, on.policy.Version())
	}
	if !sc.policy.Rule("api").Direct {
		t.Fatal("With changed the original scenario")
	}
}

// stale is direct mode with checks that often give up waiting before their grant comes (a 5 ms wait
// against a round trip of 3–9 ms): their grants go back, riding in later Acquires, and the
// network's jitter lets a later call of the agent overtake one carrying a hand-back of the same
// key, which the store then answers STALE.
const stale = `
seed: 5
duration: 20s
agents: 2
network: {agent_coordinator: 1ms, coordinator_store: 500us, jitter: 2}
agent: {max_wait: 5ms}
policy: |
  version: "1"
  rules:
    - {name: api, routes: ["/api/*"], operations: [read], limit: 100000/second, burst: 100000, lease: off}
  default: {limit: 60/minute, burst: 10}
identities:
  - {name: a, tenants: 8, path: /api/x, operation: GET}
traffic:
  - {identities: a, rate: 3000/s}
`

// TestStaleHandBacksAreHandedBackAgain: a hand-back the store answers STALE did nothing, and the
// agent hands it back again. The simulator books it as not handed back (otherwise the agent's
// ledger counts it twice and conservation breaks) and not as lost.
func TestStaleHandBacksAreHandedBackAgain(t *testing.T) {
	res := run(t, parse(t, stale))
	if res.Backend.StaleBacks == 0 {
		t.Fatal("no hand-back was answered STALE: the scenario does not reach the case")
	}
	if res.Failed() {
		t.Fatalf("violations %+v", res.Violations)
	}
	l := &res.Loss
	if got := l.Credited + l.Decayed + l.Lost; got != l.Returned {
		t.Errorf("returned %d µ ≠ credited %d + decayed %d + lost %d = %d", l.Returned, l.Credited, l.Decayed, l.Lost, got)
	}
	if got := l.Spent + l.Returned + l.Expired + l.Stranded + l.HeldAtEnd; got != l.Granted {
		t.Errorf("granted %d µ ≠ spent %d + returned %d + expired %d + stranded %d + held %d = %d", l.Granted, l.Spent, l.Returned, l.Expired, l.Stranded, l.HeldAtEnd, got)
	}
}
