package sim

import (
	"strings"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
)

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
