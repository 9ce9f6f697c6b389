package main

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	rlqsv3 "github.com/envoyproxy/go-control-plane/envoy/service/rate_limit_quota/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/internal/testkit/envoyquota"
	"github.com/leasebucket/leasebucket/internal/testkit/proctest"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
	"github.com/leasebucket/leasebucket/policy"
)

// quotaBucket is the bucket id every Envoy of these tests sends for tenant acme on the quota rule.
var quotaBucket = envoyquota.Sig(map[string]string{"tenant": "acme", "path": "/quota/{id}", "method": "GET"})

// envoyOn is an Envoy-faithful rate_limit_quota filter on a's socket (its own connection, as an
// Envoy on a's node holds one), reporting every 200 ms; the quota route fails closed.
func envoyOn(t testing.TB, a *agentNode) (*envoyquota.Filter, *grpc.ClientConn) {
	t.Helper()
	conn, err := grpc.NewClient("unix:"+a.socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	cfg, err := envoyquota.ParseConfig(envoyquota.FilterYAML("leasebucket", 200*time.Millisecond, time.Minute,
		envoyquota.Route{Prefix: "/quota/", Template: "/quota/{id}"}))
	if err != nil {
		t.Fatal(err)
	}
	f, err := envoyquota.New(cfg, conn, envoyquota.Options{Now: sinceStart})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	return f, conn
}

// start is the zero of every Envoy's clock in a test binary, so their decisions share one time.
var start = time.Now()

func sinceStart() time.Duration { return time.Since(start) }

// flood sends requests of the quota bucket through each filter from 3 goroutines each, far above
// the limit, until stop is closed; it returns the decisions by filter.
func flood(filters []*envoyquota.Filter, stop <-chan struct{}) [][]envoyquota.Decision {
	out := make([][]envoyquota.Decision, len(filters))
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i, f := range filters {
		for range 3 {
			wg.Go(func() {
				var mine []envoyquota.Decision
				for {
					select {
					case <-stop:
						mu.Lock()
						out[i] = append(out[i], mine...)
						mu.Unlock()
						return
					default:
					}
					mine = append(mine, f.Decide(envoyquota.HTTP("acme", "GET", "/quota/7")))
					time.Sleep(500 * time.Microsecond)
				}
			})
		}
	}
	wg.Wait()
	return out
}

// assigned are the admissions the filters' assignments made (not their fallbacks).
func assigned(ds []envoyquota.Decision) []admission {
	var out []admission
	for _, d := range ds {
		if d.Allowed && d.Source == envoyquota.Assignment && d.Bucket == quotaBucket {
			out = append(out, admission{d.At, d.At})
		}
	}
	return out
}

// twoEnvoys starts a real Redis, one coordinator process on it and two agent processes on the
// coordinator, with an Envoy-faithful filter on each agent; the quota rule's quota is returned.
func twoEnvoys(t *testing.T) (agents [2]*agentNode, filters []*envoyquota.Filter, conns [2]*grpc.ClientConn, q policy.Quota) {
	t.Helper()
	redistest.Require(t)
	rdb := redistest.Start(t)
	policyFile, set := writePolicy(t)
	coord := startCoordinator(t, policyFile, rdb.Addr())
	for i := range agents {
		agents[i] = startAgent(t, policyFile, []*coordinatorNode{coord})
		var f *envoyquota.Filter
		f, conns[i] = envoyOn(t, agents[i])
		filters = append(filters, f)
	}
	return agents, filters, conns, set.Rule("quota").Quota
}

// checkQuotaAdmission checks the admission bound of the quota rule on what the filters admitted
// from assignments.
func checkQuotaAdmission(t *testing.T, q policy.Quota, ds [][]envoyquota.Decision) string {
	t.Helper()
	var all []admission
	for _, d := range ds {
		all = append(all, assigned(d)...)
	}
	tightest, err := checkAdmission(all, float64(q.Burst), float64(q.Requests)/q.Period.Seconds(), lease.TTL(q.Bucket))
	if err != nil {
		t.Fatal(err)
	}
	return tightest
}

// TestQuotaAcrossAgents: two Envoys, each on its own agent process, the agents on one coordinator
// process and a real Redis, both far above the quota rule's limit: what the two admit locally
// from their assignments keeps C + r·(w + τ) in every window, checked from outside.
func TestQuotaAcrossAgents(t *testing.T) {
	_, filters, _, q := twoEnvoys(t)
	stop := make(chan struct{})
	time.AfterFunc(5*time.Second, func() { close(stop) })
	ds := flood(filters, stop)
	a1Adm, a2Adm := assigned(ds[0]), assigned(ds[1])
	t.Logf("envoy 1: %d requests, %d admitted; envoy 2: %d, %d", len(ds[0]), len(a1Adm), len(ds[1]), len(a2Adm))
	if len(a1Adm) == 0 || len(a2Adm) == 0 || len(ds[0])+len(ds[1]) < 5*(len(a1Adm)+len(a2Adm)) {
		t.Fatalf("want both Envoys admitting, far below what they are offered")
	}
	t.Logf("tightest window: %s", checkQuotaAdmission(t, q, ds))
}

// TestQuotaAgentKilledMidAssignment: one agent is killed with SIGKILL while its Envoy holds an
// assignment, the other's Envoy loses its stream (its connection closed): each Envoy keeps
// admitting only within the assignments it holds, then falls back (the route fails closed:
// DENY_ALL); the bound holds across both throughout; the agent whose stream broke settles it.
func TestQuotaAgentKilledMidAssignment(t *testing.T) {
	agents, filters, conns, q := twoEnvoys(t)
	stop := make(chan struct{})
	var ds [][]envoyquota.Decision
	done := make(chan struct{})
	go func() { ds = flood(filters, stop); close(done) }()
	proctest.WaitFor(t, 10*time.Second, "both Envoys hold assignments", func() bool {
		return filters[0].Active(quotaBucket) != nil && filters[1].Active(quotaBucket) != nil
	})
	killed := sinceStart()
	agents[0].Kill()
	if err := conns[1].Close(); err != nil {
		t.Fatal(err)
	}
	a2 := agents[1]
	proctest.WaitFor(t, 10*time.Second, "agent 2 settles the broken stream", func() bool {
		return a2.metric(t, "leasebucket_agent_quota_streams") == 0 && a2.metric(t, "leasebucket_agent_quota_reserved_tokens") == 0
	})
	tau := lease.TTL(q.Bucket)
	time.Sleep(tau + time.Second)
	close(stop)
	<-done
	checkQuotaAdmission(t, q, ds)
	for i, d := range ds {
		late := 0
		for _, x := range d {
			if x.At > killed+tau && x.Allowed {
				late++
			}
		}
		if late > 0 {
			t.Errorf("envoy %d admitted %d requests more than τ = %v after losing its agent: its assignments outlived their leases", i+1, late, tau)
		}
	}
}

// TestQuotaBadInputToTheProcess: an oversized bucket id ends the stream with INVALID_ARGUMENT, a
// bucket of an unknown key gets DENY_ALL; the agent serves on, and neither moved a bucket in
// Redis.
func TestQuotaBadInputToTheProcess(t *testing.T) {
	redistest.Require(t)
	rdb := redistest.Start(t)
	policyFile, _ := writePolicy(t)
	a := startAgent(t, policyFile, []*coordinatorNode{startCoordinator(t, policyFile, rdb.Addr())})
	conn, err := grpc.NewClient("unix:"+a.socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	open := func() grpc.BidiStreamingClient[rlqsv3.RateLimitQuotaUsageReports, rlqsv3.RateLimitQuotaResponse] {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		t.Cleanup(cancel)
		st, err := rlqsv3.NewRateLimitQuotaServiceClient(conn).StreamRateLimitQuotas(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	wide := map[string]string{"tenant": "acme", "path": "/quota/{id}", "method": "GET"}
	for _, k := range []string{"a", "b", "c", "d", "e", "f"} {
		wide[k] = "x"
	}
	st := open()
	if err := st.Send(&rlqsv3.RateLimitQuotaUsageReports{Domain: "leasebucket", BucketQuotaUsages: []*rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage{
		{BucketId: &rlqsv3.BucketId{Bucket: map[string]string{"tenant": "acme", "path": "/quota/{id}", "method": "GET"}}, NumRequestsAllowed: 1},
		{BucketId: &rlqsv3.BucketId{Bucket: wide}, NumRequestsAllowed: 1},
	}}); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "bucket_id of more than 8 entries") {
		t.Fatalf("oversized bucket id: %v, want INVALID_ARGUMENT naming it", err)
	}
	st = open()
	unknown := map[string]string{"tenant": "acme", "route": "/quota/{id}", "method": "GET"}
	if err := st.Send(&rlqsv3.RateLimitQuotaUsageReports{Domain: "leasebucket", BucketQuotaUsages: []*rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage{
		{BucketId: &rlqsv3.BucketId{Bucket: unknown}, NumRequestsAllowed: 1},
	}}); err != nil {
		t.Fatal(err)
	}
	resp, err := st.Recv()
	if err != nil || len(resp.BucketAction) != 1 || resp.BucketAction[0].GetQuotaAssignmentAction().GetRateLimitStrategy().GetBlanketRule().String() != "DENY_ALL" {
		t.Fatalf("a bucket of an unknown key: %v, %v; want DENY_ALL", resp, err)
	}
	if got := a.metric(t, "leasebucket_agent_quota_invalid_buckets_total"); got != 1 {
		t.Errorf("invalid buckets counted %v, want 1", got)
	}
	if resp := a.check(t, "acme", "/shared", "GET"); resp.Decision.String() != "DECISION_ALLOW" {
		t.Fatalf("the agent after the bad input: %v", resp)
	}
	keys, err := rdb.Client(t).Keys(context.Background(), "*quota*").Result()
	if err != nil || len(keys) != 0 {
		t.Fatalf("bad input reached Redis: keys %v, %v", keys, err)
	}
}
