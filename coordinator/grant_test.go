package coordinator

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/datadriven"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/lease"
)

// TestGrantSpec runs the specification of the grant rule in testdata/grant (docs/leases.md, "The
// grant rule"). Commands act on one bucket shape:
//
//	limit capacity=C amount=A period=P          the bucket (amounts in µ, or tokens with a t suffix)
//	plan needed=N min=M [demand=D] [cost=U] [direct]
//	                                            PlanGrant (D in µ per second; U one request's cost,
//	                                            1t if absent; direct: the rule has lease: off)
//	grant tokens=B needed=N min=M [...]         PlanGrant, then the store's TakeShare on a bucket
//	                                            holding B, of the ample want where the bucket stays
//	                                            ample (lease.Ample; no agent competes here)
//
// Rewrite the expected outputs with `go test ./coordinator -run TestGrantSpec -rewrite`.
func TestGrantSpec(t *testing.T) {
	datadriven.Walk(t, "testdata/grant", func(t *testing.T, path string) {
		var l bucket.Limit
		datadriven.RunTest(t, path, func(t *testing.T, d *datadriven.TestData) string {
			switch d.Cmd {
			case "limit":
				var err error
				l, err = bucket.NewLimit(bucket.Micro(arg(t, d, "capacity")), bucket.Micro(arg(t, d, "amount")), bucket.Millis(arg(t, d, "period")))
				if err != nil {
					return "error: " + err.Error()
				}
				return fmt.Sprintf("%s fill=%dms ttl=%s", l, l.FillTime(), lease.TTL(l))
			case "plan":
				p, err := planArgs(t, d, l)
				if err != nil {
					return "error: " + err.Error()
				}
				return showPlan(p)
			case "grant":
				p, err := planArgs(t, d, l)
				if err != nil {
					return "error: " + err.Error()
				}
				const now = 1_000_000
				s := bucket.State{Tokens: bucket.Micro(arg(t, d, "tokens")), Last: now}
				want := p.Want
				if p.AmpleWant > want && lease.Ample(l, s.Tokens, p.AmpleWant) {
					want = p.AmpleWant
				}
				r := s.TakeShare(l, now, want, p.Least, p.Share, p.Unit)
				return fmt.Sprintf("%s\ngranted=%s remaining=%s retry=%s", showPlan(p), tok(r.Granted), tok(r.Remaining), ms(r.RetryAfter))
			default:
				d.Fatalf(t, "unknown command %q", d.Cmd)
				return ""
			}
		})
	})
}

func planArgs(t *testing.T, d *datadriven.TestData, l bucket.Limit) (lease.Plan, error) {
	cost := bucket.PerToken
	if d.HasArg("cost") {
		cost = bucket.Micro(arg(t, d, "cost"))
	}
	return PlanGrant(l, cost, d.HasArg("direct"), lease.Ask{
		Needed: bucket.Micro(arg(t, d, "needed")), Least: bucket.Micro(arg(t, d, "min")), Demand: bucket.Micro(optArg(t, d, "demand")),
	})
}

func showPlan(p lease.Plan) string {
	return fmt.Sprintf("want=%s ample=%s min=%s unit=%s share=%d‰ ttl=%s", tok(p.Want), tok(p.AmpleWant), tok(p.Least), tok(p.Unit), p.Share, p.TTL)
}

// arg reads an integer argument; a "t" suffix means whole tokens.
func arg(t *testing.T, d *datadriven.TestData, key string) int64 {
	t.Helper()
	var v string
	d.ScanArgs(t, key, &v)
	mult := int64(1)
	if s, ok := strings.CutSuffix(v, "t"); ok {
		v, mult = s, int64(bucket.PerToken)
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		d.Fatalf(t, "%s=%q: %v", key, v, err)
	}
	return n * mult
}

func optArg(t *testing.T, d *datadriven.TestData, key string) int64 {
	if !d.HasArg(key) {
		return 0
	}
	return arg(t, d, key)
}

// tok prints microtokens, as tokens when whole.
func tok(m bucket.Micro) string {
	if m%bucket.PerToken == 0 {
		return fmt.Sprintf("%dt", m/bucket.PerToken)
	}
	return fmt.Sprintf("%dµ", m)
}

func ms(m bucket.Millis) string {
	if m == bucket.Never {
		return "never"
	}
	return fmt.Sprintf("%dms", m)
}

func TestPlanGrantRejects(t *testing.T) {
	l := mustLimit(t, 20*bucket.PerToken, 100*bucket.PerToken, 60_000)
	for _, tc := range []struct {
		ask  lease.Ask
		cost bucket.Micro
		err  error
	}{
		{ask: lease.Ask{Needed: 1, Least: 0}, cost: 1, err: ErrInvalidRequest},
		{ask: lease.Ask{Needed: -1, Least: 1}, cost: 1, err: ErrInvalidRequest},
		{ask: lease.Ask{Needed: 1, Least: 1, Demand: -1}, cost: 1, err: ErrInvalidRequest},
		{ask: lease.Ask{Needed: 1, Least: 1}, cost: 0, err: ErrInvalidRequest},
		{ask: lease.Ask{Needed: 30 * bucket.PerToken, Least: 21 * bucket.PerToken}, cost: bucket.PerToken, err: ErrCostAboveCapacity},
		{ask: lease.Ask{Needed: 1, Least: 20*bucket.PerToken + 1}, cost: bucket.PerToken, err: ErrCostAboveCapacity},
		{ask: lease.Ask{Needed: 0, Least: 20 * bucket.PerToken}, cost: bucket.PerToken},
	} {
		_, err := PlanGrant(l, tc.cost, false, tc.ask)
		if !errors.Is(err, tc.err) || (tc.err == nil) != (err == nil) {
			t.Errorf("PlanGrant(%v, cost=%d, %+v) error = %v, want %v", l, tc.cost, tc.ask, err, tc.err)
		}
	}
}

// FuzzPlanGrant checks the rule's invariants on any limit and any request: the size asked of
// the store is between the least grant and the capacity; beyond what the waiting checks need it
// is whole requests of the route, and never more than the reported demand over half a lease; a
// key with no demand asks for exactly what its waiting checks need; the ample want obeys the same
// with the demand over a whole lease rounded up to a request, and is never below the want; direct mode asks for exactly
// that, uncapped by the share, and keeps no lease; the lifetime of a lease is within
// [MinTTL, MaxTTL].
func FuzzPlanGrant(f *testing.F) {
	f.Add(int64(20_000_000), int64(100_000_000), int64(60_000), int64(5_000_000), int64(1_000_000), int64(0), int64(1_000_000), false)
	f.Add(int64(1), int64(1), int64(1), int64(1), int64(1), int64(1), int64(1), false)
	f.Add(int64(1<<50), int64(1<<40), int64(3), int64(1<<62), int64(7), int64(1<<62), int64(7), false)
	f.Add(int64(1_000_000), int64(0), int64(0), int64(0), int64(1), int64(-5), int64(1), true)
	f.Add(int64(100_000_000), int64(100_000_000), int64(1000), int64(3_000_000), int64(1_000_000), int64(40_000_000), int64(1_000_000), false)
	f.Add(int64(1<<52), int64(1<<52), int64(1000), int64(0), int64(1), int64(1<<62), int64(1<<63-1), false) // the largest cost
	f.Fuzz(func(t *testing.T, capacity, amount, period, needed, least, demand, cost int64, direct bool) {
		l, err := bucket.NewLimit(bucket.Micro(capacity), bucket.Micro(amount), bucket.Millis(period))
		if err != nil {
			return
		}
		ask := lease.Ask{Needed: bucket.Micro(needed), Least: bucket.Micro(least), Demand: bucket.Micro(demand)}
		p, err := PlanGrant(l, bucket.Micro(cost), direct, ask)
		c := l.Capacity()
		switch {
		case least < 1 || needed < 0 || demand < 0 || cost < 1 || needed > bucket.MaxExact/2:
			if !errors.Is(err, ErrInvalidRequest) {
				t.Fatalf("PlanGrant(%v, %d, %t, %+v) = %+v, %v, want ErrInvalidRequest", l, cost, direct, ask, p, err)
			}
			return
		case bucket.Micro(least) > c:
			if !errors.Is(err, ErrCostAboveCapacity) {
				t.Fatalf("PlanGrant(%v, %d, %t, %+v) = %+v, %v, want ErrCostAboveCapacity", l, cost, direct, ask, p, err)
			}
			return
		case err != nil:
			t.Fatalf("PlanGrant(%v, %d, %t, %+v): %v", l, cost, direct, ask, err)
		}
		need := min(c, max(bucket.Micro(least), bucket.Micro(needed)))
		if p.Least != bucket.Micro(least) || p.Want < p.Least || p.Want > c || p.Unit != bucket.Micro(cost) {
			t.Fatalf("PlanGrant(%v, %d, %t, %+v) = %+v: want outside [least, capacity]", l, cost, direct, ask, p)
		}
		if direct {
			if p.Want != need || p.AmpleWant != 0 || p.Share != bucket.WholeShare || p.TTL != 0 {
				t.Fatalf("direct PlanGrant(%v, %d, %+v) = %+v, want exactly %d µ, whole share, no lease", l, cost, ask, p, need)
			}
			return
		}
		lifetime := min(bucket.Micro(demand), bucket.MaxExact/2) / 1000 * bucket.Micro(p.TTL/time.Millisecond)
		ample := lifetime // a thin key's with its spread (one standard deviation) added, up to lease.ThinRequests
		if lifetime/lease.ThinRequests < bucket.Micro(cost) {
			ample = lifetime + bucket.Micro(math.Sqrt(float64(lifetime)*float64(cost))) + 1 // + 1: rounding
		}
		for _, w := range []struct {
			name      string
			size      bucket.Micro
			justified bucket.Micro
		}{{"want", p.Want, lifetime / lease.Refills}, {"ample want", p.AmpleWant, ample + min(bucket.Micro(cost), c) - 1}} {
			extra := w.size - need
			switch {
			case w.size < p.Least || w.size > c:
				t.Fatalf("PlanGrant(%v, %d, %+v) = %+v: %s outside [least, capacity]", l, cost, ask, p, w.name)
			case w.size < c && extra%bucket.Micro(cost) != 0:
				t.Fatalf("PlanGrant(%v, %d, %+v) = %+v: the %s beyond the waiting checks is not whole requests", l, cost, ask, p, w.name)
			case extra > w.justified:
				t.Fatalf("PlanGrant(%v, %d, %+v) = %+v: %s %d µ beyond the waiting checks, demand justifies %d", l, cost, ask, p, w.name, extra, w.justified)
			case demand == 0 && w.size != need:
				t.Fatalf("PlanGrant(%v, %d, %+v) = %+v: no demand, %s exactly what waits (%d)", l, cost, ask, p, w.name, need)
			}
		}
		if p.AmpleWant < p.Want {
			t.Fatalf("PlanGrant(%v, %d, %+v) = %+v: ample want below want", l, cost, ask, p)
		}
		if p.Share != lease.Share || p.TTL < lease.MinTTL || p.TTL > lease.MaxTTL || p.TTL%time.Millisecond != 0 {
			t.Fatalf("PlanGrant(%v, ...) = %+v: share or lifetime out of range", l, p)
		}
	})
}

func mustLimit(t testing.TB, capacity, amount bucket.Micro, period bucket.Millis) bucket.Limit {
	t.Helper()
	l, err := bucket.NewLimit(capacity, amount, period)
	if err != nil {
		t.Fatal(err)
	}
	return l
}
