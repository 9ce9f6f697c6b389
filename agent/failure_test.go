package agent_test

import (
	"bytes"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/policy"
)

// settle waits until no refill or return is queued or in flight.
func settle(t testing.TB, s *stack) {
	t.Helper()
	eventually(t, 5*time.Second, "refills settle", func() bool {
		refills, returns := s.lim.Pending()
		return refills == 0 && returns == 0 && s.ref.InFlight() == 0
	})
}

func show(v agent.Verdict) string {
	out := v.Outcome.String()
	if v.Degraded {
		out += " degraded"
	}
	return out
}

// TestFailureModes proves the failure modes of docs/agent.md end to end through the check path:
// while the global state is unreachable (the coordinator, the whole store, or the store for these
// keys), a live lease still allows; then a fail-closed route answers unavailable with its rule's
// Retry-After and never lets anything through, and an emergency route spends its local emergency
// bucket (3 degraded allows), then answers 429. When the global state is back, checks are allowed
// again.
func TestFailureModes(t *testing.T) {
	// The example's writes at 100 a second rather than 30 a minute: the warm-up's checks, 20 a
	// second, then stay below the rate, and the agent is not paced (docs/leases.md) when the
	// outage begins — a paced agent refuses locally without asking anyone.
	data, err := os.ReadFile(examplePolicy)
	if err != nil {
		t.Fatal(err)
	}
	const slow = "limit: 30/minute\n    burst: 10\n    on_failure: deny"
	if !bytes.Contains(data, []byte(slow)) {
		t.Fatalf("%s: orders-write no longer reads %q", examplePolicy, slow)
	}
	set, err := policy.Parse(examplePolicy, bytes.Replace(data, []byte(slow), []byte("limit: 100/second\n    burst: 10\n    on_failure: deny"), 1))
	if err != nil {
		t.Fatal(err)
	}
	for _, outage := range []string{"coordinator", "store", "store-keys"} {
		for _, route := range []struct {
			path, op, rule string
		}{
			{"/orders/7", "POST", "orders-write"},   // on_failure: deny, retry_after_on_failure: 1s
			{"/products/42", "GET", "catalog-read"}, // on_failure: emergency, 5/minute burst 3
		} {
			t.Run(outage+"/"+route.rule, func(t *testing.T) {
				s := newStack(t, set, stackOptions{})
				s.lossOK = true // the returns at shutdown fail while the store is down
				q := agent.Query{Tenant: "acme", Path: route.path, Operation: route.op}
				decide := func() agent.Verdict {
					t.Helper()
					v, err := s.srv.Decide(ctxTimeout(t, 5*time.Second), q)
					if err != nil {
						t.Fatal(err)
					}
					return v
				}
				// A key with no demand holds no lease: checks over more than a demand sample
				// (lease.MinSample) make it hold one, which the outage is then served from. The
				// store's clock moves a minute each time, so the bucket is full for each refill
				// (a bucket that runs low paces the agent, docs/leases.md).
				var held bucket.Micro
				for i := 0; held < bucket.PerToken; i++ {
					if i == 20 {
						t.Fatalf("agent holds %d µ after %d checks, want a lease of a token or more", held, i)
					}
					s.storeMs.Add(60_000)
					if v := decide(); v.Outcome != agent.Allow || v.Degraded {
						t.Fatalf("check %d = %s, want allow", i, show(v))
					}
					settle(t, s)
					held = s.lim.Outstanding()
					time.Sleep(lease.MinSample / 2)
				}
				switch outage {
				case "coordinator":
					s.coord.setFault(unreachable)
				case "store":
					s.storeDown.Store(storeBatchDown)
				case "store-keys":
					s.storeDown.Store(storeKeysDown)
				}
				var seq []string
				for range int(held/bucket.PerToken) + 8 {
					v := decide()
					seq = append(seq, show(v))
					switch {
					case v.Outcome == agent.Unavailable && v.RetryAfter != time.Second:
						t.Fatalf("unavailable with Retry-After %v, want the rule's 1s", v.RetryAfter)
					case v.Outcome == agent.Deny && v.Degraded && (v.RetryAfter <= 0 || v.RetryAfter > 12*time.Second):
						t.Fatalf("degraded deny with Retry-After %v, want up to 12s (one token at 5/minute)", v.RetryAfter)
					case v.Rule == nil || v.Rule.Name != route.rule:
						t.Fatalf("verdict of rule %v, want %s", v.Rule, route.rule)
					}
				}
				got := strings.Join(seq, ",")
				t.Logf("held %d µ; checks during the outage: %s", held, got)
				allows := 0
				for allows < len(seq) && seq[allows] == "allow" {
					allows++
				}
				if allows == 0 || bucket.Micro(allows)*bucket.PerToken > held {
					t.Fatalf("checks during the outage: %s; want 1..%d allows from the lease held (%d µ) first", got, held/bucket.PerToken, held)
				}
				var want []string
				if route.rule == "orders-write" {
					for range len(seq) - allows {
						want = append(want, "unavailable")
					}
				} else {
					want = append(want, "allow degraded", "allow degraded", "allow degraded")
					for range len(seq) - allows - 3 {
						want = append(want, "deny degraded")
					}
				}
				if rest := strings.Join(seq[allows:], ","); rest != strings.Join(want, ",") {
					t.Fatalf("checks during the outage: %s\nafter the %d lease allows: %s\nwant:                     %s", got, allows, rest, strings.Join(want, ","))
				}
				stats := s.lim.Stats()
				if route.rule == "orders-write" && stats.Unavailable.Load() == 0 || route.rule == "catalog-read" && stats.Degraded.Load() != 3 {
					t.Fatalf("stats: unavailable %d, degraded %d", stats.Unavailable.Load(), stats.Degraded.Load())
				}

				// Recovery: after the key's backoff a check refills and is allowed again.
				s.coord.setFault(healthy)
				s.storeDown.Store(storeUp)
				s.lossOK = false
				eventually(t, 5*time.Second, "a normal allow after the outage", func() bool {
					v := decide()
					return v.Outcome == agent.Allow && !v.Degraded
				})
			})
		}
	}
}

// TestWaitBound: a coordinator that does not answer holds a check at most MaxWait, or less when
// the caller's deadline is nearer; then the rule's failure mode answers.
func TestWaitBound(t *testing.T) {
	const maxWait = 100 * time.Millisecond
	s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{maxWait: maxWait, callTimeout: 5 * time.Second})
	s.coord.setFault(hang)
	s.lossOK = true
	q := agent.Query{Tenant: "acme", Path: "/orders/7", Operation: "POST"}
	start := time.Now()
	v, err := s.srv.Decide(ctxTimeout(t, 10*time.Second), q)
	if err != nil || v.Outcome != agent.Unavailable || v.RetryAfter != time.Second {
		t.Fatalf("Decide with a hanging coordinator = %s %v, %v; want unavailable 1s", show(v), v.RetryAfter, err)
	}
	if took := time.Since(start); took < maxWait {
		t.Fatalf("answered after %v, before the wait bound %v", took, maxWait)
	}
	// A caller allowing 20 ms is answered by then (the failure mode), not with an error.
	q.Tenant = "other"
	v, err = s.srv.Decide(ctxTimeout(t, 20*time.Millisecond), q)
	if err != nil || v.Outcome != agent.Unavailable {
		t.Fatalf("Decide with a 20 ms deadline = %s, %v; want unavailable", show(v), err)
	}
	// An emergency route answers degraded.
	q = agent.Query{Tenant: "acme", Path: "/products/1", Operation: "GET"}
	if v, err := s.srv.Decide(ctxTimeout(t, 10*time.Second), q); err != nil || v.Outcome != agent.Allow || !v.Degraded {
		t.Fatalf("Decide on an emergency route = %s, %v; want allow degraded", show(v), err)
	}
}

// policyV2 is examplePolicy under another version.
func policyV2(t testing.TB) *policy.Set {
	t.Helper()
	set := loadPolicy(t, examplePolicy)
	data := strings.Replace(canonicalExample(t), `version: "`+set.Version()+`"`, `version: "v2"`, 1)
	return parsePolicy(t, data)
}

func canonicalExample(t testing.TB) string {
	t.Helper()
	return string(mustRead(t, examplePolicy))
}

// TestUnknownPolicyVersion: a coordinator that does not know the agent's policy version makes
// the agent reload its policy; a reload that finds the coordinators' version serves normally,
// and one that does not leaves each route in its failure mode (the safe default).
func TestUnknownPolicyVersion(t *testing.T) {
	for _, reloadHelps := range []bool{true, false} {
		t.Run(fmt.Sprintf("reload-finds-version=%v", reloadHelps), func(t *testing.T) {
			v2 := policyV2(t)
			s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{reload: func(s *stack) {
				if reloadHelps {
					s.lim.SetPolicy(v2)
				}
			}})
			s.coord.svc = coordinator.NewService(s.store, v2) // the coordinators moved on to v2
			q := agent.Query{Tenant: "acme", Path: "/orders/7", Operation: "POST"}
			v, err := s.srv.Decide(ctxTimeout(t, 5*time.Second), q)
			if err != nil {
				t.Fatal(err)
			}
			// The check is answered when the refill fails; the reload follows on the Refresher.
			eventually(t, 5*time.Second, "a policy reload", func() bool { return s.reloads.Load() == 1 })
			if !reloadHelps {
				if v.Outcome != agent.Unavailable || v.RetryAfter != time.Second {
					t.Fatalf("check = %s %v, want unavailable 1s (the rule fails closed)", show(v), v.RetryAfter)
				}
				q = agent.Query{Tenant: "acme", Path: "/products/1", Operation: "GET"}
				if v, _ := s.srv.Decide(ctxTimeout(t, 5*time.Second), q); v.Outcome != agent.Allow || !v.Degraded {
					t.Fatalf("emergency route = %s, want allow degraded", show(v))
				}
				return
			}
			// The first check was answered during the mismatch; after the reload checks refill.
			eventually(t, 5*time.Second, "an allow under the reloaded policy", func() bool {
				v, err := s.srv.Decide(ctxTimeout(t, 5*time.Second), q)
				return err == nil && v.Outcome == agent.Allow && !v.Degraded
			})
			if got := s.lim.Policy().Version(); got != "v2" {
				t.Fatalf("policy version %q after reload, want v2", got)
			}
		})
	}
}
