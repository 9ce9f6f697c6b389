package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
	"github.com/leasebucket/leasebucket/policy"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

const chargesE2EPolicy = `version: charges-1
rules:
  - name: chat
    routes: [/chat]
    operations: [read]
    limits:
      - {limit: 1000/second, burst: 100}
      - {quota: 30/day}
  - name: search
    routes: [/search]
    operations: [read]
    limit: 1000/second
    burst: 100
  - name: budget
    scope: tenant
    quota: 50/day
default:
  limit: 10/minute
`

// TestChargesAcrossAgents: three agent processes behind two coordinators, on a standalone Redis
// and on a Cluster of three masters (the buckets of one check live on different nodes). /chat
// charges chat, chat#2 (30 a day) and the tenant budget (50 a day); /search charges search and
// the budget. Clients hammer /chat, then /search, through the agents' sockets: /chat admits at
// most 30, both together at most 50, refusals name the bucket that refused, and once every agent
// has handed its leases back, each day counter holds exactly its quota less the checks it
// admitted: no refused check was charged anywhere.
func TestChargesAcrossAgents(t *testing.T) {
	redistest.Require(t)
	for _, mode := range []string{"standalone", "cluster"} {
		t.Run(mode, func(t *testing.T) {
			addrs, rdb, file, set := redisAndPolicy(t, mode, chargesE2EPolicy)
			coords := []*coordinatorNode{startCoordinator(t, file, addrs), startCoordinator(t, file, addrs)}
			var agents []*agentNode
			for range 3 {
				agents = append(agents, startAgent(t, file, coords, "--max-wait", "500ms"))
			}
			admitted := map[string]int{}
			for _, route := range []string{"/chat", "/search"} {
				allowed, outcomes := hammer(t, agents, &agentv1.CheckRequest{Tenant: "acme", Route: route, Operation: "GET"}, 1500*time.Millisecond)
				t.Logf("%s: %v", route, outcomes)
				if outcomes["error"] > 0 {
					t.Fatalf("%d checks failed", outcomes["error"])
				}
				admitted[route] = len(allowed)
				resp := agents[0].check(t, "acme", route, "GET")
				if want := map[string]string{"/chat": "chat#2", "/search": "budget"}[route]; resp.Decision != agentv1.Decision_DECISION_DENY || resp.Rule != want {
					// /chat runs out of chat#2 (30) before the budget (50); /search then of the budget.
					t.Fatalf("%s after the hammer: %v, want a denial by %s", route, resp, want)
				}
			}
			if admitted["/chat"] > 30 || admitted["/chat"]+admitted["/search"] > 50 || admitted["/chat"] == 0 || admitted["/search"] == 0 {
				t.Fatalf("admitted %v: want /chat at most 30, both at most 50", admitted)
			}
			for _, a := range agents {
				a.Terminate(t) // hands every lease back
			}
			left := func(route string, rule string) int64 {
				t.Helper()
				r, err := set.Match(route, "GET")
				if err != nil {
					t.Fatal(err)
				}
				for _, id := range append([]uint32{r.ID}, r.Charges()...) {
					c := set.RouteByID(id)
					if c.Rule.Name != rule {
						continue
					}
					key, err := set.Key(c, "acme", "")
					if err != nil {
						t.Fatal(err)
					}
					return redisTokens(t, rdb, key)
				}
				t.Fatalf("%s charges no %s", route, rule)
				return 0
			}
			tok := int64(bucket.PerToken)
			if got, want := left("/chat", "chat#2"), (30-int64(admitted["/chat"]))*tok; got != want {
				t.Errorf("chat#2's counter holds %d µ, want %d µ (30 less %d admitted)", got, want, admitted["/chat"])
			}
			if got, want := left("/search", "budget"), (50-int64(admitted["/chat"]+admitted["/search"]))*tok; got != want {
				t.Errorf("the budget's counter holds %d µ, want %d µ (50 less %d admitted)", got, want, admitted["/chat"]+admitted["/search"])
			}
		})
	}
}

// TestChargesAdmissionBound: the admission bound C + r·(w + τ) holds for a bucket checked
// together with others. /paced charges its own 10/second (burst 20) bucket, a second limit that
// never binds and a tenant budget; three agents behind two coordinators on one Redis are hammered,
// and every window of the allowed checks keeps the first bucket's bound.
func TestChargesAdmissionBound(t *testing.T) {
	redistest.Require(t)
	const text = `version: charges-bound-1
rules:
  - name: paced
    routes: [/paced]
    operations: [read]
    limits:
      - {limit: 10/second, burst: 20}
      - {limit: 100000/hour, burst: 10000}
  - name: budget
    scope: tenant
    limit: 100000/hour
    burst: 10000
default:
  limit: 10/minute
`
	rdb := redistest.Start(t)
	file := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(file, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	set, err := policy.Parse(file, []byte(text))
	if err != nil {
		t.Fatal(err)
	}
	coords := []*coordinatorNode{startCoordinator(t, file, rdb.Addr()), startCoordinator(t, file, rdb.Addr())}
	var agents []*agentNode
	for range 3 {
		agents = append(agents, startAgent(t, file, coords, "--max-wait", "500ms"))
	}
	allowed, outcomes := hammer(t, agents, &agentv1.CheckRequest{Tenant: "acme", Route: "/paced", Operation: "GET"}, 3*time.Second)
	t.Logf("outcomes: %v", outcomes)
	if outcomes["error"] > 0 || len(allowed) == 0 || outcomes[agentv1.Decision_DECISION_DENY.String()] == 0 {
		t.Fatalf("want allows and denials: %v", outcomes)
	}
	q := set.Rule("paced").Quota
	tightest, err := checkAdmission(allowed, float64(q.Burst), float64(q.Requests)/q.Period.Seconds(), lease.TTL(q.Bucket))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d allowed; tightest window: %s", len(allowed), tightest)
}

// redisAndPolicy starts a standalone Redis or a Cluster of three masters (mode "standalone" or
// "cluster"), writes the policy text to a file and parses it: the setup of the tests that run
// agent processes on both.
// redisTokens is the µ the bucket of key holds in Redis (its t field), as the store last wrote it.
func redisTokens(t *testing.T, rdb redis.Cmdable, key string) int64 {
	t.Helper()
	n, err := rdb.HGet(context.Background(), key, "t").Int64()
	if err != nil {
		t.Fatalf("%s: %v", key, err)
	}
	return n
}

func redisAndPolicy(t *testing.T, mode, text string) (addrs string, rdb redis.UniversalClient, file string, set *policy.Set) {
	t.Helper()
	if mode == "standalone" {
		srv := redistest.Start(t)
		addrs, rdb = srv.Addr(), srv.Client(t)
	} else {
		c := redistest.StartCluster(t, 3)
		addrs, rdb = strings.Join(c.Addrs(), ","), c.Client(t)
	}
	file = filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(file, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	set, err := policy.Parse(file, []byte(text))
	if err != nil {
		t.Fatal(err)
	}
	return addrs, rdb, file, set
}
