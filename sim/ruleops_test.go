package sim

import (
	"strings"
	"testing"
)

// twoModes is, on 4 agents, one tenant of a leased rule in bursts (ten times its rate for half a
// second every 5 s) and 2,000 tenants, each checked about every 4 s, of a direct rule.
const twoModes = `
seed: 5
duration: 20s
agents: 4
policy: |
  version: "1"
  rules:
    - {name: bursty, routes: ["/bursty/*"], operations: [read], limit: 100/second, burst: 1000}
    - {name: tail, routes: ["/tail/*"], operations: [read], limit: 100/second, burst: 100, lease: off}
  default: {limit: 60/minute, burst: 10}
identities:
  - {name: bursty, tenants: 1, path: /bursty/x, operation: GET}
  - {name: tail, tenants: 2000, path: /tail/x, operation: GET}
traffic:
  - {identities: bursty, rate: 60/s, shape: {kind: bursts, every: 5s, length: 500ms, factor: 10}}
  - {identities: tail, rate: 500/s}
`

// TestStoreOpsByRule: the store operations the agents count by rule add up to what reached the
// store (no call fails here); the direct rule takes one operation per check, the leased key a
// small fraction of one; the report gives each rule's figure. (Leases handed back on their own,
// counted as returns, are rare in the simulator's traffic: agent's TestStoreOperationsByRule
// covers them.)
func TestStoreOpsByRule(t *testing.T) {
	sc := parse(t, twoModes)
	res := run(t, sc)
	if res.Failed() {
		t.Fatal(res.Violations)
	}
	var sum int64
	for _, n := range res.RuleOps {
		sum += n
	}
	if sum != res.Backend.StoreOps || res.Backend.FailedCalls != 0 {
		t.Errorf("the agents count %d store operations by rule (%v); %d reached the store, %d calls failed",
			sum, res.RuleOps, res.Backend.StoreOps, res.Backend.FailedCalls)
	}
	checks := res.ChecksByRule()
	if n, c := res.RuleOps["tail"], checks["tail"]; c == 0 || n != c {
		t.Errorf("direct rule: %d store operations for %d checks, want one each", n, c)
	}
	if n, c := res.RuleOps["bursty"], checks["bursty"]; c == 0 || n*5 > c {
		t.Errorf("leased rule: %d store operations for %d checks, want under one per 5", n, c)
	}
	out := string(report(t, res, sc))
	for _, row := range []string{"| `bursty` | on |", "| `tail` | off |"} {
		if !strings.Contains(out, row) {
			t.Errorf("the report has no row %q of store operations by rule", row)
		}
	}
}
