package agent_test

import (
	"context"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/internal/bucket"
)

const directChargesPolicy = `
version: "v1"
rules:
  - name: d
    routes: ["/d"]
    operations: [read]
    cost: 2
    lease: off
    limits:
      - {limit: 6000/minute, burst: 1000}
      - {limit: 10/hour, burst: 10}
  - name: other
    routes: ["/other"]
    operations: [read]
    limit: 6000/minute
    burst: 1000
  - name: budget
    scope: tenant
    limit: 6000/minute
    burst: 1000
default:
  limit: 60/minute
  burst: 10
`

// TestChargesDirectAllOrNothing: a direct route with a second limit under a tenant budget that a
// leased route charges too. Through the agent's server on a coordinator and a store whose clock
// stands still, five checks of /d are allowed (d#2 holds 10 tokens, a check costs 2); every
// refusal after them names d#2 and spends nothing anywhere; the leased route keeps charging the
// budget from leases. Each bucket ends holding exactly its burst less what was allowed.
func TestChargesDirectAllOrNothing(t *testing.T) {
	set := parsePolicy(t, directChargesPolicy)
	s := newStack(t, set, stackOptions{})
	ctx := context.Background()
	allowed := checkAllOrNothing(t, s, "/d", "d#2", 11*time.Minute, 12*time.Minute)
	if allowed != 5 {
		t.Fatalf("%d checks allowed, want 5 (d#2 holds 10 tokens, a check costs 2)", allowed)
	}
	s.stop(t)
	const tok = bucket.PerToken
	r, _ := set.Match("/d", "GET")
	want := map[string]bucket.Micro{"d": 1000*tok - 10*tok, "d#2": 0, "budget": 1000*tok - 10*tok - 40*tok}
	for _, id := range append([]uint32{r.ID}, r.Charges()...) {
		c := set.RouteByID(id)
		key, _ := set.Key(c, "acme", "")
		lim, _ := set.Limits(c, "acme", "")
		// A take above the capacity never grants: its answer is the level.
		res, err := s.store.Take(ctx, []coordinator.TakeRequest{{Key: key, Limit: lim.Bucket, Want: lim.Bucket.Capacity() + 1, Min: lim.Bucket.Capacity() + 1}})
		if err != nil || res[0].Err != nil {
			t.Fatal(err, res[0].Err)
		}
		if got := res[0].Remaining; got != want[c.Rule.Name] {
			t.Errorf("%s holds %d µ, want %d µ: charged for exactly the allowed checks", c.Rule.Name, got, want[c.Rule.Name])
		}
	}
}
