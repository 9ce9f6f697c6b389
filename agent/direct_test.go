package agent_test

import (
	"context"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/coordinator/storetest"
	"github.com/leasebucket/leasebucket/internal/bucket"
)

// TestChargesDirectAllOrNothing: a direct route (chargesPolicy's /d) with a second limit under a
// tenant budget that a leased route charges too. Through the agent's server on a coordinator and a store whose clock
// stands still, five checks of /d are allowed (d#2 holds 10 tokens, a check costs 2); every
// refusal after them names d#2 and spends nothing anywhere; the leased route keeps charging the
// budget from leases. Each bucket ends holding exactly its burst less what was allowed (less
// what the agent gave up: see checkLevels).
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
	levels := []level{{"other", s.level(t, "/other", "GET", "acme"), 1000*tok - 40*tok}}
	for _, id := range append([]uint32{r.ID}, r.Charges()...) {
		c := set.RouteByID(id)
		key, _ := set.Key(c, "acme", "")
		lim, _ := set.Limits(c, "acme", "")
		got, err := storetest.Probe(context.Background(), s.store, key, lim.Bucket)
		if err != nil {
			t.Fatal(err)
		}
		levels = append(levels, level{c.Rule.Name, got, want[c.Rule.Name]})
	}
	checkLevels(t, s, levels)
}

// TestChargesDirectUnservedGoesBackEverywhere: a direct check of three buckets (chargesPolicy's
// /d: d, its second limit d#2 and the tenant budget) whose Acquire the store applied but whose
// answer was lost (every retry too) is answered by the failure mode, charged in all three. The
// key's next refill sends the seq again; the replayed grant finds no check waiting for it and goes
// back to every bucket it was taken from, not to d alone. On a store whose clock stands still
// nothing decays, so once the agent has stopped each bucket holds exactly its burst less the
// checks allowed.
func TestChargesDirectUnservedGoesBackEverywhere(t *testing.T) {
	set := parsePolicy(t, chargesPolicy)
	s := newStack(t, set, stackOptions{callTimeout: 50 * time.Millisecond, maxWait: 200 * time.Millisecond})
	q := agent.Query{Tenant: "acme", Path: "/d", Operation: "GET"}
	s.coord.setFault(lostAnswers)
	if v, err := s.srv.Decide(ctxTimeout(t, 5*time.Second), q); err != nil || v.Outcome == agent.Allow {
		t.Fatalf("Decide while answers are lost = %s, %v; want the failure mode", show(v), err)
	}
	const tok = bucket.PerToken
	r, _ := set.Match("/d", "GET")
	level := map[string]func() bucket.Micro{}
	for _, id := range append([]uint32{r.ID}, r.Charges()...) {
		c := set.RouteByID(id)
		key, _ := set.Key(c, "acme", "")
		lim, _ := set.Limits(c, "acme", "")
		level[c.Rule.Name] = func() bucket.Micro {
			got, err := storetest.Probe(context.Background(), s.store, key, lim.Bucket)
			if err != nil {
				t.Fatal(err)
			}
			return got
		}
	}
	if got := level["d#2"](); got != 8*tok {
		t.Fatalf("d#2 holds %d µ after the lost Acquire, want %d µ: the test shows nothing unless it was charged", got, 8*tok)
	}
	s.coord.setFault(healthy)
	s.awaitAllow(t, q)
	const allowed = 1
	if s.lim.Stats().Resends.Load() == 0 {
		t.Fatal("the lost seq was not sent again")
	}
	s.stop(t)
	// One grant of 2 tokens went back, to three buckets: counted once per bucket, as credited.
	if st := s.lim.Stats(); st.ReturnedMicro.Load() != uint64(6*tok) || st.CreditedMicro.Load() != uint64(6*tok) {
		t.Errorf("handed back %d µ, credited %d µ; want %d µ both (2 tokens to each of 3 buckets)",
			st.ReturnedMicro.Load(), st.CreditedMicro.Load(), 6*tok)
	}
	for rule, burst := range map[string]bucket.Micro{"d": 1000, "d#2": 10, "budget": 1000} {
		if got, want := level[rule](), (burst-2*allowed)*tok; got != want {
			t.Errorf("%s holds %d µ, want %d µ: charged %d µ for the check the failure mode answered", rule, got, want, want-got)
		}
	}
}
