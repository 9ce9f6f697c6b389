package main

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

const calendarE2EPolicy = `version: calendar-1
rules:
  - name: daily-leased
    routes: [/daily-leased]
    operations: [read]
    quota: 40/day
  - name: daily-direct
    routes: [/daily-direct]
    operations: [read]
    quota: 20/day
    lease: off
default:
  limit: 10/minute
`

// TestCalendarQuotaAcrossAgents: three agent processes behind two coordinators share calendar
// quotas in a real Redis. Clients hammer them through the agents' sockets: a quota with leases
// admits at most its count, a direct one exactly its count (every check one atomic take of the
// counter), and a refusal's Retry-After is the time until the next midnight (UTC), when the whole
// quota is there again.
func TestCalendarQuotaAcrossAgents(t *testing.T) {
	redistest.Require(t)
	rdb := redistest.Start(t)
	file := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(file, []byte(calendarE2EPolicy), 0o600); err != nil {
		t.Fatal(err)
	}
	coords := []*coordinatorNode{startCoordinator(t, file, rdb.Addr()), startCoordinator(t, file, rdb.Addr())}
	var agents []*agentNode
	for range 3 {
		agents = append(agents, startAgent(t, file, coords, "--max-wait", "500ms"))
	}
	for _, tc := range []struct {
		route string
		quota int
		exact bool
	}{{"/daily-leased", 40, false}, {"/daily-direct", 20, true}} {
		t.Run(tc.route, func(t *testing.T) {
			allowed, outcomes := hammer(t, agents, &agentv1.CheckRequest{Tenant: "acme", Route: tc.route, Operation: "GET"}, 2*time.Second)
			t.Logf("outcomes: %v", outcomes)
			if outcomes["error"] > 0 {
				t.Fatalf("%d checks failed", outcomes["error"])
			}
			if len(allowed) > tc.quota || tc.exact && len(allowed) != tc.quota || len(allowed) == 0 {
				t.Fatalf("%d allowed of a quota of %d per day (exact: %v)", len(allowed), tc.quota, tc.exact)
			}
			now := time.Now().UTC()
			midnight := time.Date(now.Year(), now.Month(), now.Day()+1, 0, 0, 0, 0, time.UTC)
			resp := agents[0].check(t, "acme", tc.route, "GET")
			wait := time.Duration(resp.RetryAfterMs) * time.Millisecond
			if resp.Decision != agentv1.Decision_DECISION_DENY || wait > time.Until(midnight)+time.Second || wait < time.Until(midnight)-30*time.Second {
				t.Fatalf("after the quota: %v, want a denial until midnight UTC (%v away)", resp, time.Until(midnight))
			}
			if resp.Limit != int64(tc.quota) || resp.WindowMs != 24*3600*1000 {
				t.Fatalf("limit %d per %d ms, want %d per day", resp.Limit, resp.WindowMs, tc.quota)
			}
		})
	}
}
