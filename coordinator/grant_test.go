package coordinator

import (
	"errors"
	"fmt"
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
//	plan want=W min=M [demand=D]                PlanGrant (D in µ per second)
//	grant tokens=B want=W min=M [demand=D]      PlanGrant, then the store's TakeShare on a bucket
//	                                            holding B, and Scarce on the outcome
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
				p, err := PlanGrant(l, bucket.Micro(arg(t, d, "want")), bucket.Micro(arg(t, d, "min")), bucket.Micro(optArg(t, d, "demand")))
				if err != nil {
					return "error: " + err.Error()
				}
				return showPlan(p)
			case "grant":
				p, err := PlanGrant(l, bucket.Micro(arg(t, d, "want")), bucket.Micro(arg(t, d, "min")), bucket.Micro(optArg(t, d, "demand")))
				if err != nil {
					return "error: " + err.Error()
				}
				const now = 1_000_000
				s := bucket.State{Tokens: bucket.Micro(arg(t, d, "tokens")), Last: now}
				r := s.TakeShare(l, now, p.Want, p.Min, p.Share)
				out := fmt.Sprintf("%s\ngranted=%s remaining=%s retry=%s", showPlan(p), tok(r.Granted), tok(r.Remaining), ms(r.RetryAfter))
				if r.Granted > 0 {
					out += fmt.Sprintf(" scarce=%t", Scarce(p, l, r.Granted, r.Remaining))
				}
				return out
			default:
				d.Fatalf(t, "unknown command %q", d.Cmd)
				return ""
			}
		})
	})
}

func showPlan(p Plan) string {
	return fmt.Sprintf("want=%s min=%s share=%d‰ ttl=%s", tok(p.Want), tok(p.Min), p.Share, p.TTL)
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
		want, least, demand bucket.Micro
		err                 error
	}{
		{want: 1, least: 0, err: ErrInvalidRequest},
		{want: -1, least: 1, err: ErrInvalidRequest},
		{want: 1, least: 1, demand: -1, err: ErrInvalidRequest},
		{want: 30 * bucket.PerToken, least: 21 * bucket.PerToken, err: ErrCostAboveCapacity},
		{want: 1, least: 20*bucket.PerToken + 1, err: ErrCostAboveCapacity},
		{want: 0, least: 20 * bucket.PerToken},
	} {
		_, err := PlanGrant(l, tc.want, tc.least, tc.demand)
		if !errors.Is(err, tc.err) || (tc.err == nil) != (err == nil) {
			t.Errorf("PlanGrant(%v, want=%d, min=%d, demand=%d) error = %v, want %v", l, tc.want, tc.least, tc.demand, err, tc.err)
		}
	}
}

// FuzzPlanGrant checks the rule's invariants on any limit and any request: the size asked of
// the store is between one request's cost and the capacity, and never more than twice what the
// reported demand over half a lease justifies; the lifetime is within [MinTTL, MaxTTL].
func FuzzPlanGrant(f *testing.F) {
	f.Add(int64(20_000_000), int64(100_000_000), int64(60_000), int64(5_000_000), int64(1_000_000), int64(0))
	f.Add(int64(1), int64(1), int64(1), int64(1), int64(1), int64(1))
	f.Add(int64(1<<50), int64(1<<40), int64(3), int64(1<<62), int64(7), int64(1<<62))
	f.Add(int64(1_000_000), int64(0), int64(0), int64(0), int64(1), int64(-5))
	f.Fuzz(func(t *testing.T, capacity, amount, period, want, least, demand int64) {
		l, err := bucket.NewLimit(bucket.Micro(capacity), bucket.Micro(amount), bucket.Millis(period))
		if err != nil {
			return
		}
		p, err := PlanGrant(l, bucket.Micro(want), bucket.Micro(least), bucket.Micro(demand))
		c := l.Capacity()
		switch {
		case least < 1 || want < 0 || demand < 0:
			if !errors.Is(err, ErrInvalidRequest) {
				t.Fatalf("PlanGrant(%v, %d, %d, %d) = %+v, %v, want ErrInvalidRequest", l, want, least, demand, p, err)
			}
			return
		case bucket.Micro(least) > c:
			if !errors.Is(err, ErrCostAboveCapacity) {
				t.Fatalf("PlanGrant(%v, %d, %d, %d) = %+v, %v, want ErrCostAboveCapacity", l, want, least, demand, p, err)
			}
			return
		case err != nil:
			t.Fatalf("PlanGrant(%v, %d, %d, %d): %v", l, want, least, demand, err)
		}
		justified := lease.Want(min(bucket.Micro(demand), bucket.MaxExact), p.TTL, bucket.Micro(least), c)
		if p.Min != bucket.Micro(least) || p.Want < p.Min || p.Want > c || p.Want > max(p.Min, 2*justified) {
			t.Fatalf("PlanGrant(%v, %d, %d, %d) = %+v: want outside [min, min(capacity, max(min, 2·%d))]",
				l, want, least, demand, p, justified)
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
