package sim

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
)

// settledScenario is a short version of examples/sim/settled-costs.yaml.
func settledScenario(t *testing.T, d time.Duration) *Scenario {
	t.Helper()
	sc, err := Load("../examples/sim/settled-costs.yaml")
	if err != nil {
		t.Fatal(err)
	}
	sc.Duration = Duration(d)
	return sc
}

// TestSettledCosts: heavy-tailed costs settled after the response on tenants far over their
// quota and tenants under it: no bound breaks, no bucket goes below -max_debt, debt is debited
// and, the heavy tenants being far over, some is forgiven; admitted requests are charged about
// their buckets' budget.
func TestSettledCosts(t *testing.T) {
	sc := settledScenario(t, 40*time.Second)
	res := run(t, sc)
	if again := run(t, sc); !bytes.Equal(report(t, res, sc), report(t, again, sc)) {
		t.Fatal("two runs of the same scenario and seed gave different reports")
	}
	if res.Failed() {
		t.Fatalf("violations: %+v", res.Violations)
	}
	s := &res.Settled
	if s.Settles == 0 || s.Actual <= s.Estimates {
		t.Fatalf("%d settles, actual %d µ, estimates %d µ: the costs were not settled above their estimates", s.Settles, s.Actual, s.Estimates)
	}
	if s.DebtCharged <= 0 || s.StoreDebited != s.DebtCharged {
		t.Errorf("debt debited %d µ by the agents' account, %d µ by the stores'; want the same, above 0", s.DebtCharged, s.StoreDebited)
	}
	if s.DebtForgiven <= 0 {
		t.Errorf("no debt forgiven, with tenants at 20 times their quota")
	}
	if got := s.DebtCharged + s.DebtForgiven + s.DebtLost; got > s.Debt {
		t.Errorf("debt debited %d + forgiven %d + lost %d = %d µ, more than the %d µ sent", s.DebtCharged, s.DebtForgiven, s.DebtLost, got, s.Debt)
	}
	for _, k := range res.Keys {
		if k.Lowest < -k.MaxDebt {
			t.Errorf("%s went to %d µ, below -max_debt %d µ", k.Key, k.Lowest, k.MaxDebt)
		}
		if k.ChargedExcess > k.DebtBound {
			t.Errorf("%s: charged excess %g µ above the debt bound %g µ", k.Key, k.ChargedExcess, k.DebtBound)
		}
	}
	if s.Deepest >= 0 || s.DeepestMax <= 0 {
		t.Errorf("lowest level %d µ with max_debt %d µ: the buckets never went into debt", s.Deepest, s.DeepestMax)
	}
	if u := s.Utilisation(); u < 0.7 || u > 1.3 {
		t.Errorf("admitted requests were charged %.3f of the budget, want about 1 (the load is far over on most keys)", u)
	}
	if r := s.WorstRatio(); r <= 0.5 || r > 1 {
		t.Errorf("worst window at %.3f of the debt bound, want in (0.5, 1]", r)
	}
	l := &res.Loss
	if got := l.Spent + l.Returned + l.Expired + l.Stranded + l.HeldAtEnd; got != l.Granted {
		t.Errorf("granted %d µ ≠ spent %d + returned %d + expired %d + stranded %d + held %d = %d", l.Granted, l.Spent, l.Returned, l.Expired, l.Stranded, l.HeldAtEnd, got)
	}
	if s.Credited == 0 || s.SpentExtra == 0 {
		t.Errorf("credited %d µ, spent beyond estimates from leases %d µ: the scenario must exercise both", s.Credited, s.SpentExtra)
	}
}

// TestDebtBoundTrips feeds the debt check a synthetic series: what leases may spend and a
// store may debit with max_debt holds; the same series on a key whose max_debt is ignored (0), or
// one more token, trips it; and a level below -max_debt trips it.
func TestDebtBoundTrips(t *testing.T) {
	const tok = float64(bucket.PerToken)
	limit, err := bucket.NewLimit(200*bucket.PerToken, 20*bucket.PerToken, 1000) // 20 tokens/s, burst 200
	if err != nil {
		t.Fatal(err)
	}
	feed := func(maxDebt, extra float64) *Result {
		w := &world{violSeen: map[string]bool{}, timeline: make([]Second, 20)}
		k := newKey("k", 0, limit, bucket.Micro(maxDebt*tok))
		// A full bucket and the refill over τ spent at once, then the refill at its rate for 10 s
		// with a 200-token debt debited in the middle: the window from 0 to 10 s holds
		// C + r·(10 s + τ) + 200 tokens.
		w.spend(k, 0, k.admitBound-tok/2)
		for i := 1; i <= 100; i++ {
			w.now = int64(i) * int64(100*time.Millisecond)
			w.spend(k, w.now, 2*tok)
			if i == 50 {
				w.charge(k, w.now, 200*tok+extra*tok)
			}
		}
		return &w.res
	}
	if r := feed(200, 0); r.Failed() {
		t.Fatalf("within the bound: %+v", r.Violations)
	}
	for _, tc := range []struct {
		name           string
		maxDebt, extra float64
	}{{"max_debt ignored", 0, 0}, {"one token over", 200, 1}} {
		r := feed(tc.maxDebt, tc.extra)
		if !r.Failed() || r.Violations[0].Kind != "debt" || !strings.Contains(r.Violations[0].Detail, "max_debt") {
			t.Errorf("%s: violations %+v, want a debt violation", tc.name, r.Violations)
		}
	}
	w := &world{violSeen: map[string]bool{}, timeline: make([]Second, 1)}
	k := newKey("k", 0, limit, bucket.Micro(200*tok))
	w.debtLevel(k, -200*int64(tok))
	if w.res.Failed() || w.timeline[0].DebtDepth != 1 {
		t.Fatalf("a level at -max_debt: violations %+v, depth %g", w.res.Violations, w.timeline[0].DebtDepth)
	}
	w.debtLevel(k, -200*int64(tok)-1)
	if !w.res.Failed() || w.res.Violations[0].Kind != "debt" {
		t.Fatalf("a level 1 µ below -max_debt: violations %+v, want a debt violation", w.res.Violations)
	}
}

func TestSettledCostErrors(t *testing.T) {
	base := oneRule("duration: 10s\nagents: 2", "limit: 60/minute, burst: 10", "3", "rate: 10/s, cost: COST")
	for _, tc := range []struct{ cost, want string }{
		{"{estimate: 0, actual: {value: 2}, after: 1s}", "cost.estimate"},
		{"{estimate: 1, actual: {dist: pareto, alpha: 1.2, min: 1}, after: 1s}", "cost.actual: pareto needs max"},
		{"{estimate: 1, actual: {dist: pareto, alpha: 0, min: 1, max: 5}, after: 1s}", "pareto needs alpha"},
		{"{estimate: 1, actual: {dist: lognormal, median: 2}, after: 1s}", "lognormal needs max"},
		{"{estimate: 1, actual: {dist: zipf}, after: 1s}", `dist "zipf"`},
		{"{estimate: 1, actual: {dist: uniform, min: 3, max: 1}, after: 1s}", "min <= max"},
		{"{estimate: 1, actual: {value: 2}}", "cost.after"},
		{"{estimate: 1, actual: {value: 2}, after: {dist: lognormal, median: 2s, mean: 1s}}", "field mean"},
		{"{estimate: 1, actual: {value: 2}, after: soon}", "not a duration"},
		{"{estimate: 1, actual: {value: 2}, after: 1s, sometimes: true}", "sometimes"},
		{"{estimate: 11, actual: {value: 2}, after: 1s}", "cost.estimate 11 is more than the burst"},
		{"{estimate: 1, actual: {dist: pareto, alpha: 1.2, min: 1, max: 400}, after: 1s}", "the burst plus max_debt"},
	} {
		sc, err := parseScenario("bad.yaml", []byte(strings.Replace(base, "COST", tc.cost, 1)))
		if err == nil {
			_, err = newWorld(sc, Options{})
		}
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("cost %s: error %v, want one mentioning %q", tc.cost, err, tc.want)
		}
	}
}
