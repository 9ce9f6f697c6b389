package main

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

// admission is one allowed check as a client saw it: sent and answered (monotonic, since start).
type admission struct{ sent, recv time.Duration }

// checkAdmission verifies the admission bound (I6 of docs/design.md) on allowed checks: in every
// window of length w, allowed ≤ C + r·(w + τ). Clients time an allow between sending and receiving
// it; the spend happened in between, so windows are taken over receive times and widened by the
// longest round trip δ: a window [t_i, t_j] of receive times holds spends from t_i − δ to t_j. It
// returns the tightest window (for the log) or an error naming the window that breaks the bound.
func checkAdmission(allowed []admission, capacity, ratePerSec float64, tau time.Duration) (string, error) {
	recv := make([]time.Duration, len(allowed))
	var delta time.Duration
	for i, a := range allowed {
		recv[i] = a.recv
		delta = max(delta, a.recv-a.sent)
	}
	slices.Sort(recv)
	slack := math.Inf(1)
	tightest := ""
	for i := range recv {
		for j := i; j < len(recv); j++ {
			w := recv[j] - recv[i]
			count := float64(j - i + 1)
			bound := capacity + ratePerSec*(w+tau+delta).Seconds()
			if count > bound {
				return "", fmt.Errorf("%v allowed in a window of %v (from %v): bound C + r·(w + τ + δ) = %.2f (δ = %v)", count, w, recv[i], bound, delta)
			}
			if bound-count < slack {
				slack = bound - count
				tightest = fmt.Sprintf("%v allowed within %v, bound %.2f (δ = %v)", count, w, bound, delta)
			}
		}
	}
	return tightest, nil
}

func TestCheckAdmissionCatchesOvershoot(t *testing.T) {
	// C = 2, r = 1/s, τ = 0: three allows within a millisecond break the bound; spaced a second
	// apart they do not.
	ms := time.Millisecond
	burst := []admission{{0, ms}, {ms, 2 * ms}, {2 * ms, 3 * ms}}
	if _, err := checkAdmission(burst, 2, 1, 0); err == nil {
		t.Fatal("3 allows in 2 ms passed a bound of C = 2")
	}
	spaced := []admission{{0, ms}, {time.Second, time.Second + ms}, {2 * time.Second, 2*time.Second + ms}}
	if _, err := checkAdmission(spaced, 2, 1, 0); err != nil {
		t.Fatal(err)
	}
}

// TestAdmissionBoundAcrossAgents: three agent processes behind two coordinators share one bucket
// in a real Redis; clients hammer all three. The allowed checks, with their times, keep the
// admission bound in every window: C + r·(w + τ) with leases, C + r·w in direct mode (lease: off),
// where every check is one atomic take and nothing is kept.
func TestAdmissionBoundAcrossAgents(t *testing.T) {
	redistest.Require(t)
	for _, tc := range []struct{ rule, route string }{{"shared", "/shared"}, {"shared-direct", "/shared-direct"}} {
		t.Run(tc.rule, func(t *testing.T) {
			rdb := redistest.Start(t)
			policyFile, set := writePolicy(t)
			coords := []*coordinatorNode{startCoordinator(t, policyFile, rdb.Addr()), startCoordinator(t, policyFile, rdb.Addr())}
			var agents []*agentNode
			for range 3 {
				agents = append(agents, startAgent(t, policyFile, coords, "--max-wait", "500ms"))
			}
			rule := set.Rule(tc.rule)
			capacity := float64(rule.Quota.Burst)
			rate := float64(rule.Quota.Requests) / rule.Quota.Period.Seconds()
			var tau time.Duration
			if !rule.Direct {
				tau = lease.TTL(rule.Quota.Bucket)
			}
			allowed, outcomes := hammer(t, agents, &agentv1.CheckRequest{Tenant: "acme", Route: tc.route, Operation: "GET"}, 3*time.Second)
			t.Logf("outcomes: %v", outcomes)
			if outcomes["error"] > 0 {
				t.Fatalf("%d checks failed", outcomes["error"])
			}
			if len(allowed) == 0 || outcomes[agentv1.Decision_DECISION_DENY.String()] == 0 {
				t.Fatalf("want allows and denials from a bucket of %v at %v/s under this load: %v", capacity, rate, outcomes)
			}
			tightest, err := checkAdmission(allowed, capacity, rate, tau)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%d allowed; tightest window: %s", len(allowed), tightest)
		})
	}
}

// hammer sends req from 4 clients per agent, each as fast as answers come (2 ms apart), for
// duration, and returns the allowed checks with their times and the count of each outcome.
func hammer(t *testing.T, agents []*agentNode, req *agentv1.CheckRequest, duration time.Duration) ([]admission, map[string]int) {
	t.Helper()
	const perAgent = 4
	var (
		mu       sync.Mutex
		allowed  []admission
		outcomes = map[string]int{}
		wg       sync.WaitGroup
	)
	start := time.Now()
	for ai, a := range agents {
		for range perAgent {
			wg.Go(func() {
				for time.Since(start) < duration {
					ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
					sent := time.Since(start)
					resp, err := a.client.Check(ctx, req)
					recv := time.Since(start)
					cancel()
					mu.Lock()
					switch {
					case err != nil:
						outcomes["error"]++
					case resp.Decision == agentv1.Decision_DECISION_ALLOW:
						allowed = append(allowed, admission{sent, recv})
						outcomes["allow agent "+strconv.Itoa(ai)]++
					default:
						outcomes[resp.Decision.String()]++
					}
					mu.Unlock()
					time.Sleep(2 * time.Millisecond)
				}
			})
		}
	}
	wg.Wait()
	return allowed, outcomes
}

// outageRoutes are the e2e policy's two failure modes.
var outageRoutes = []struct{ route, op, rule string }{
	{"/w/1", "POST", "writes"}, // on_failure: deny, retry_after_on_failure: 2s
	{"/r/1", "GET", "reads"},   // on_failure: emergency, 6/minute burst 3
}

// TestOutages: with the coordinators killed, or Redis killed behind live coordinators, an agent
// keeps allowing from the leases it holds, then each route answers as its policy says: the
// fail-closed route UNAVAILABLE with its Retry-After, the emergency route three degraded allows
// and then 429.
func TestOutages(t *testing.T) {
	redistest.Require(t)
	for _, outage := range []string{"coordinators-killed", "redis-killed"} {
		t.Run(outage, func(t *testing.T) {
			rdb := redistest.Start(t)
			policyFile, _ := writePolicy(t)
			coords := []*coordinatorNode{startCoordinator(t, policyFile, rdb.Addr()), startCoordinator(t, policyFile, rdb.Addr())}
			a := startAgent(t, policyFile, coords)
			held := map[string]float64{}
			for _, r := range outageRoutes {
				before := a.metric(t, "leasebucket_agent_outstanding_lease_tokens")
				// A key with no demand holds no lease: checks spread over more than a demand
				// sample (lease.MinSample) bring one sized to the demand they show.
				for i := 0; held[r.rule] < 1; i++ {
					if i == 20 {
						t.Fatalf("%s: agent holds %v tokens after %d checks, want a lease", r.rule, held[r.rule], i)
					}
					if resp := a.check(t, "acme", r.route, r.op); resp.Decision != agentv1.Decision_DECISION_ALLOW {
						t.Fatalf("%s before the outage: %v", r.rule, resp)
					}
					a.settle(t)
					held[r.rule] = a.metric(t, "leasebucket_agent_outstanding_lease_tokens") - before
					time.Sleep(lease.MinSample / 2)
				}
			}
			switch outage {
			case "coordinators-killed":
				for _, c := range coords {
					c.kill()
				}
			case "redis-killed":
				rdb.Kill()
			}
			for _, r := range outageRoutes {
				var seq []string
				for range int(held[r.rule]) + 8 {
					resp := a.check(t, "acme", r.route, r.op)
					s := strings.ToLower(strings.TrimPrefix(resp.Decision.String(), "DECISION_"))
					if resp.Degraded {
						s += " degraded"
					}
					switch {
					case resp.Decision == agentv1.Decision_DECISION_UNAVAILABLE && resp.RetryAfterMs != 2000:
						t.Fatalf("%s: unavailable with retry_after_ms %d, want the rule's 2000", r.rule, resp.RetryAfterMs)
					case resp.Decision == agentv1.Decision_DECISION_DENY && (resp.RetryAfterMs <= 0 || resp.RetryAfterMs > 10_000):
						t.Fatalf("%s: deny with retry_after_ms %d, want 1..10000 (a token at 6/minute)", r.rule, resp.RetryAfterMs)
					}
					seq = append(seq, s)
				}
				allows := 0
				for allows < len(seq) && seq[allows] == "allow" {
					allows++
				}
				t.Logf("%s: held %v tokens; checks during the outage: %s", r.rule, held[r.rule], strings.Join(seq, ","))
				if allows == 0 || float64(allows) > held[r.rule] {
					t.Fatalf("%s: %d allows from leases first, want 1..%v", r.rule, allows, held[r.rule])
				}
				var want []string
				if r.rule == "writes" {
					for range len(seq) - allows {
						want = append(want, "unavailable")
					}
				} else {
					want = []string{"allow degraded", "allow degraded", "allow degraded"}
					for range len(seq) - allows - 3 {
						want = append(want, "deny degraded")
					}
				}
				if got := strings.Join(seq[allows:], ","); got != strings.Join(want, ",") {
					t.Fatalf("%s after the lease: %s\nwant: %s", r.rule, got, strings.Join(want, ","))
				}
			}
			if got := a.metric(t, "leasebucket_agent_degraded_admissions_total"); got != 3 {
				t.Fatalf("degraded admissions metric %v, want 3", got)
			}
		})
	}
}

// TestAgentKilledLosesAtMostItsLeases: an agent killed with SIGKILL loses the global bucket no
// more than its outstanding leases (I7). The ledger rule refills one token a day (C = 1000), so
// Redis' level is a ledger: C = level + allowed (every agent) + returned-but-decayed + lost,
// less the refill since the start. Refill and decay together stay far below one token here
// (1000 tokens a day is 0.012 µ/ms), so
//
//	lost = C − level − allowed   within one token,
//
// and it must not exceed the outstanding-lease gauge read just before the kill (nor, the ledger
// being exact, fall short of it by more than that token).
func TestAgentKilledLosesAtMostItsLeases(t *testing.T) {
	redistest.Require(t)
	rdb := redistest.Start(t)
	policyFile, set := writePolicy(t)
	coord := startCoordinator(t, policyFile, rdb.Addr())
	victim := startAgent(t, policyFile, []*coordinatorNode{coord})
	survivor := startAgent(t, policyFile, []*coordinatorNode{coord})

	// 400 checks in all, well within the 1000 tokens: every check is allowed or waits for a
	// refill, and both agents hold leases throughout.
	traffic := func(a *agentNode, n int) int {
		allowed := 0
		for range n {
			if a.check(t, "acme", "/ledger", "GET").Decision == agentv1.Decision_DECISION_ALLOW {
				allowed++
			}
		}
		return allowed
	}
	allowedVictim := traffic(victim, 200)
	allowedSurvivor := traffic(survivor, 100)
	victim.settle(t)
	outstanding := victim.metric(t, "leasebucket_agent_outstanding_lease_tokens")
	victim.Kill()
	allowedSurvivor += traffic(survivor, 100)
	survivor.Terminate(t) // returns its leases
	coord.kill()

	r, _ := set.Match("/ledger", "GET")
	key, err := set.Key(r, "acme", "")
	if err != nil {
		t.Fatal(err)
	}
	tokens := redisTokens(t, rdb.Client(t), key)
	capacity := float64(set.Rule("ledger").Quota.Burst)
	level := float64(tokens) / float64(bucket.PerToken)
	lost := capacity - level - float64(allowedVictim+allowedSurvivor)
	t.Logf("capacity %v, level %.6f, allowed %d (victim) + %d (survivor): lost %.6f; victim's outstanding leases %v",
		capacity, level, allowedVictim, allowedSurvivor, lost, outstanding)
	if allowedVictim == 0 || outstanding < 1 {
		t.Fatalf("the victim allowed %d and held %v tokens: the test needs both", allowedVictim, outstanding)
	}
	if lost > outstanding+1 {
		t.Fatalf("lost %.6f tokens, more than the killed agent's outstanding leases %v", lost, outstanding)
	}
	if lost < outstanding-1 {
		t.Fatalf("lost %.6f tokens, the killed agent held %v: the ledger does not add up", lost, outstanding)
	}
}

// TestCoordinatorFailover: with one of two coordinator processes killed, refills go to the other:
// keys that need their first lease right after the kill are all allowed.
func TestCoordinatorFailover(t *testing.T) {
	redistest.Require(t)
	rdb := redistest.Start(t)
	policyFile, _ := writePolicy(t)
	coords := []*coordinatorNode{startCoordinator(t, policyFile, rdb.Addr()), startCoordinator(t, policyFile, rdb.Addr())}
	a := startAgent(t, policyFile, coords)
	for i := range 10 {
		if resp := a.check(t, fmt.Sprintf("before-%d", i), "/shared", "GET"); resp.Decision != agentv1.Decision_DECISION_ALLOW {
			t.Fatalf("before the kill: %v", resp)
		}
	}
	coords[0].kill()
	for i := range 50 {
		resp := a.check(t, fmt.Sprintf("after-%d", i), "/shared", "GET")
		if resp.Decision != agentv1.Decision_DECISION_ALLOW || resp.Degraded {
			t.Fatalf("check %d after one coordinator died: %v", i, resp)
		}
	}
}
