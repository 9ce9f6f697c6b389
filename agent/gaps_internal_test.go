package agent

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/internal/lease"
)

// TestRegularKeyRefills: a key checked every 0.8 s (±5 %), colder than its 250 ms leases, asks
// for a refill at each check and, from its sixth on, says it is regular (AcquireItem.regular), so
// the grant rule's ample want is its check alone, nothing to lapse, and so does one that pauses
// for 3 s after every sixth gap and resumes on its period (as the stack benchmark's keys do
// between their mode's turns); a key checked at random with the same mean is not called regular
// at nearly any refill, and its ample want keeps the request rounded up. Each reports its demand.
func TestRegularKeyRefills(t *testing.T) {
	set := parseSet(t, `version: v1
rules:
  - name: api
    routes: ["/api/*"]
    operations: [read]
    limit: 100/second
    burst: 100
default:
  limit: 10/second
`)
	limit, cost := routeBucket(t, set, "/api/x", "GET", "acme")
	r := rand.New(rand.NewPCG(3, 4))
	period := func() time.Duration { return time.Duration(float64(800*time.Millisecond) * (0.95 + 0.1*r.Float64())) }
	gaps := 0
	for _, tc := range []struct {
		name    string
		gap     func() time.Duration
		regular bool
	}{
		{"every 0.8 s", period, true},
		{"every 0.8 s, paused 3 s after every sixth gap", func() time.Duration {
			if gaps++; gaps%7 == 0 {
				return 3*time.Second + period()
			}
			return period()
		}, true},
		{"at random, a mean of 0.8 s", func() time.Duration { return time.Duration(r.ExpFloat64() * float64(800*time.Millisecond)) }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := New(Config{AgentID: "a"}, set)
			now := clock.Of(time.Hour)
			q := Query{Tenant: "acme", Path: "/api/x", Operation: "GET"}
			asks, regular, alone := 0, 0, 0
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
					if c.Acquire != nil && i >= 5 {
						for _, it := range c.Acquire.Items {
							asks++
							if it.DemandMicroPerSecond <= 0 {
								t.Fatalf("check %d: a refill without demand", i)
							}
							p, err := lease.Size(limit, cost, false, itemAsk(it))
							if err != nil {
								t.Fatal(err)
							}
							if it.Regular {
								regular++
							}
							if p.AmpleWant == cost {
								alone++
							}
						}
					}
					answerSized(t, l, now, limit, cost, c, true) // the bucket stays ample
				}
				if got := v.Ticket.Verdict(); got.Outcome != Allow {
					t.Fatalf("check %d: %v, want allowed by its refill", i, got.Outcome)
				}
			}
			if tc.regular && (asks < 190 || regular != asks || alone != asks) {
				t.Errorf("%d refills asked, %d regular, %d for the check alone; want one per check, all regular and alone", asks, regular, alone)
			}
			if !tc.regular && (regular > asks/20 || alone > asks/20) {
				t.Errorf("%d of %d refills regular and %d for the check alone; want at most 5 %%", regular, asks, alone)
			}
		})
	}
}
