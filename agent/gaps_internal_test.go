package agent

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/policy"
)

// answerAmple answers call c as a coordinator whose bucket of lim stays ample: each refill gets
// the grant rule's ample want (requests of cost) for the lease's lifetime, each hand-back a full
// credit.
func answerAmple(tb testing.TB, l *Limiter, now clock.Nanos, lim bucket.Limit, cost bucket.Micro, c *Call) {
	tb.Helper()
	r := answerAll(c, 0)
	if c.Acquire != nil {
		for i, it := range c.Acquire.Items {
			p, err := lease.Size(lim, cost, false, lease.Ask{Needed: bucket.Micro(it.NeededMicro), Least: bucket.Micro(it.MinMicro),
				Demand: bucket.Micro(it.DemandMicroPerSecond)})
			if err != nil {
				tb.Fatal(err)
			}
			res := r.Acquire.Results[i]
			res.GrantedMicro, res.TtlMs, res.GrantedAtMs = int64(p.AmpleWant), p.TTL.Milliseconds(), int64(now/clock.Nanos(time.Millisecond))
		}
	}
	if err := l.Apply(now, c, r); err != nil {
		tb.Fatal(err)
	}
}

// TestRegularKeyReportsNoDemand: a key checked every 0.8 s (±5 %), colder than its 250 ms leases,
// asks for a refill at each check and, from its fifth on, reports no demand, so its ample want is
// its check alone (lease.Servable); a key checked at random with the same mean reports its demand
// at nearly every refill.
func TestRegularKeyReportsNoDemand(t *testing.T) {
	set, err := policy.Parse("gaps.yaml", []byte(`version: v1
rules:
  - name: api
    routes: ["/api/*"]
    operations: [read]
    limit: 100/second
    burst: 100
default:
  limit: 10/second
`))
	if err != nil {
		t.Fatal(err)
	}
	route, err := set.Match("/api/x", "GET")
	if err != nil {
		t.Fatal(err)
	}
	limits, err := set.Limits(route, "t", "")
	if err != nil {
		t.Fatal(err)
	}
	cost := bucket.Micro(set.Cost(route)) * bucket.PerToken
	r := rand.New(rand.NewPCG(3, 4))
	for _, tc := range []struct {
		name    string
		gap     func() time.Duration
		regular bool
	}{
		{"every 0.8 s", func() time.Duration { return time.Duration(float64(800*time.Millisecond) * (0.95 + 0.1*r.Float64())) }, true},
		{"at random, a mean of 0.8 s", func() time.Duration { return time.Duration(r.ExpFloat64() * float64(800*time.Millisecond)) }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := New(Config{AgentID: "a"}, set)
			now := clock.Of(time.Hour)
			q := Query{Tenant: "acme", Path: "/api/x", Operation: "GET"}
			asks, zero := 0, 0
			for i := range 200 {
				now += clock.Of(max(tc.gap(), time.Millisecond))
				v, err := l.Check(now, q)
				if err != nil {
					t.Fatal(err)
				}
				if v.Outcome != Wait {
					continue // the last lease still held a request
				}
				for c := l.NextCall(now); c != nil; c = l.NextCall(now) {
					if c.Acquire != nil && i >= 4 {
						for _, it := range c.Acquire.Items {
							asks++
							if it.DemandMicroPerSecond == 0 {
								zero++
							}
						}
					}
					answerAmple(t, l, now, limits.Bucket, cost, c)
				}
				if got := v.Ticket.Verdict(); got.Outcome != Allow {
					t.Fatalf("check %d: %v, want allowed by its refill", i, got.Outcome)
				}
			}
			if tc.regular && (asks < 190 || zero != asks) {
				t.Errorf("%d refills asked, %d of them without demand; want one per check, none with demand", asks, zero)
			}
			if !tc.regular && zero > asks/20 {
				t.Errorf("%d of %d refills asked without demand; want at most 5 %%", zero, asks)
			}
		})
	}
}
