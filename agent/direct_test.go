package agent_test

import (
	"context"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/coordinator/storetest"
	"github.com/leasebucket/leasebucket/internal/bucket"
)

// TestChargesDirectAllOrNothing: a direct route (chargesPolicy's /d) with a second limit under a
// tenant budget that a leased route charges too. Through the agent's server on a coordinator and a store whose clock
// stands still, five checks of /d are allowed (d#2 holds 10 tokens, a check costs 2); every
// refusal after them names d#2 and spends nothing anywhere; the leased route keeps charging the
// budget from leases. Each bucket ends holding exactly its burst less what was allowed.
func TestChargesDirectAllOrNothing(t *testing.T) {
	set := parsePolicy(t, chargesPolicy)
	s := newStack(t, set, stackOptions{})
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
		got, err := storetest.Probe(context.Background(), s.store, key, lim.Bucket)
		if err != nil {
			t.Fatal(err)
		}
		if got != want[c.Rule.Name] {
			t.Errorf("%s holds %d µ, want %d µ: charged for exactly the allowed checks", c.Rule.Name, got, want[c.Rule.Name])
		}
	}
}
