package main

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

// chargesDirectPolicy: /direct is lease: off with two limits under a tenant budget; /leased
// charges the same budget from leases. direct#2 and the budget refill slowly (a few tokens an
// hour), so what is left in them at the end is what was admitted.
const chargesDirectPolicy = `version: charges-direct-1
rules:
  - name: direct
    routes: [/direct]
    operations: [read]
    lease: off
    limits:
      - {limit: 10/second, burst: 20}
      - {limit: 2/hour, burst: 40}
  - name: leased
    routes: [/leased]
    operations: [read]
    limit: 1000/second
    burst: 100
  - name: budget
    scope: tenant
    limit: 1/hour
    burst: 30
default:
  limit: 10/minute
`

// TestChargesDirect: two agent processes behind two coordinators, on a standalone Redis and on a
// Cluster of three masters, hammer a direct route charged with a second limit and a tenant budget,
// then a leased route charging the same budget. The direct route's own bucket keeps the direct
// admission bound C + r·w; every bucket of the check was charged exactly the checks admitted
// (checked in Redis: a refused check left nothing anywhere); the budget admits at most its burst
// across both routes; and the refusal names the budget. On the Cluster, the keys of the check
// share one slot.
func TestChargesDirect(t *testing.T) {
	redistest.Require(t)
	for _, mode := range []string{"standalone", "cluster"} {
		t.Run(mode, func(t *testing.T) {
			addrs, rdb, file, set := redisAndPolicy(t, mode, chargesDirectPolicy)
			coords := []*coordinatorNode{startCoordinator(t, file, addrs), startCoordinator(t, file, addrs)}
			agents := []*agentNode{startAgent(t, file, coords, "--max-wait", "2s"), startAgent(t, file, coords, "--max-wait", "2s")}

			allowed, outcomes := hammer(t, agents, &agentv1.CheckRequest{Tenant: "acme", Route: "/direct", Operation: "GET"}, 2*time.Second)
			t.Logf("/direct: %v", outcomes)
			if outcomes["error"] > 0 || len(allowed) == 0 || outcomes[agentv1.Decision_DECISION_DENY.String()] == 0 {
				t.Fatalf("want allows and denials: %v", outcomes)
			}
			q := set.Rule("direct").Quota
			tightest, err := checkAdmission(allowed, float64(q.Burst), float64(q.Requests)/q.Period.Seconds(), 0)
			if err != nil {
				t.Fatalf("the direct route's own bucket: %v", err)
			}
			t.Logf("%d allowed; tightest window of its own bucket: %s", len(allowed), tightest)

			// The budget (30) refuses before direct#2 (40): every bucket of the check was charged
			// exactly the checks admitted.
			route, _ := set.Match("/direct", "GET")
			keys := map[string]string{}
			var slot int64 = -1
			for _, id := range append([]uint32{route.ID}, route.Charges()...) {
				r := set.RouteByID(id)
				keys[r.Rule.Name], _ = set.Key(r, "acme", "")
				if mode == "cluster" {
					s := rdb.(*redis.ClusterClient).ClusterKeySlot(context.Background(), keys[r.Rule.Name]).Val()
					if slot >= 0 && s != slot {
						t.Fatalf("%s in slot %d, another bucket of the check in slot %d", keys[r.Rule.Name], s, slot)
					}
					slot = s
				}
			}
			// What a grant left unserved goes back within ReturnLinger: let the agents' calls end.
			for _, a := range agents {
				a.settle(t)
			}
			resp := agents[0].check(t, "acme", "/direct", "GET")
			if resp.Decision != agentv1.Decision_DECISION_DENY || resp.Rule != "budget" {
				t.Fatalf("/direct after the hammer: %v, want a denial by budget", resp)
			}
			level := func(rule string) int64 { return redisTokens(t, rdb, keys[rule]) }
			tok := int64(bucket.PerToken)
			n := int64(len(allowed))
			// At most what they refilled since (2 and 1 an hour: a tenth of a token in three minutes),
			// less at most the decay of a grant whose check stopped waiting (handed back to every
			// bucket), far below one refused check.
			if got := level("budget"); got < (30-n)*tok-tok/10 || got > (30-n)*tok+tok/10 {
				t.Errorf("the budget holds %d µ, want %d µ (30 less %d admitted)", got, (30-n)*tok, n)
			}
			if got := level("direct#2"); got < (40-n)*tok-tok/10 || got > (40-n)*tok+tok/10 {
				t.Errorf("direct#2 holds %d µ, want %d µ (40 less %d admitted)", got, (40-n)*tok, n)
			}
			if n > 30 {
				t.Fatalf("%d admitted, more than the budget's burst 30", n)
			}
			// The leased route charges the same budget from leases: nothing left for it.
			more, outcomes := hammer(t, agents, &agentv1.CheckRequest{Tenant: "acme", Route: "/leased", Operation: "GET"}, 500*time.Millisecond)
			t.Logf("/leased: %v", outcomes)
			if int64(len(more))+n > 30 {
				t.Fatalf("%d + %d admitted across both routes, more than the budget's burst 30", n, len(more))
			}
		})
	}
}

// TestChargesDirectWaitsCutShort: the same direct route, with agents whose checks wait at most
// 1 ms, shorter than a refill's round trip: many checks are answered by the failure mode while
// their take is in flight, and the grant that then comes serves no check. It goes back to every
// bucket it was taken from, so once the agents have stopped, the budget and direct#2 hold what
// the admitted checks left, less at most the decay of the returned grants (a tenth of a token
// here) and the hand-backs the agents counted as lost, never a refused check's token.
func TestChargesDirectWaitsCutShort(t *testing.T) {
	redistest.Require(t)
	for _, mode := range []string{"standalone", "cluster"} {
		t.Run(mode, func(t *testing.T) {
			addrs, rdb, file, set := redisAndPolicy(t, mode, chargesDirectPolicy)
			coords := []*coordinatorNode{startCoordinator(t, file, addrs)}
			agents := []*agentNode{startAgent(t, file, coords, "--max-wait", "1ms"), startAgent(t, file, coords, "--max-wait", "1ms")}

			allowed, outcomes := hammer(t, agents, &agentv1.CheckRequest{Tenant: "acme", Route: "/direct", Operation: "GET"}, time.Second)
			t.Logf("/direct: %v", outcomes)
			cut := outcomes[agentv1.Decision_DECISION_UNAVAILABLE.String()]
			if outcomes["error"] > 0 || cut == 0 {
				t.Fatalf("want checks the 1 ms wait bound answered: %v", outcomes)
			}
			// A hand-back whose call failed is lost, and counted: the only shortfall allowed
			// beyond the decay.
			var unserved, lost float64
			for _, a := range agents {
				a.settle(t)
				unserved += a.metric(t, "leasebucket_agent_wait_fallbacks_total")
				lost += a.metric(t, "leasebucket_agent_tokens_lost_total")
				a.Terminate(t) // hands back what it holds
			}
			route, _ := set.Match("/direct", "GET")
			n := int64(len(allowed))
			tok := int64(bucket.PerToken)
			for _, c := range []struct {
				rule  string
				burst int64
			}{{"budget", 30}, {"direct#2", 40}} {
				found := false
				for _, id := range route.Charges() {
					if r := set.RouteByID(id); r.Rule.Name == c.rule {
						found = true
						key, _ := set.Key(r, "acme", "")
						want := (c.burst - n) * tok
						if got := redisTokens(t, rdb, key); got < want-int64(lost*float64(tok))-tok/10 || got > want+tok/10 {
							t.Errorf("%s holds %d µ, want %d µ (%d less %d admitted; %v waits cut short, %v tokens of hand-backs lost): %.2f tokens off",
								c.rule, got, want, c.burst, n, unserved, lost, float64(got-want)/float64(tok))
						}
					}
				}
				if !found {
					t.Fatalf("/direct charges no %s bucket: nothing was checked", c.rule)
				}
			}
		})
	}
}
