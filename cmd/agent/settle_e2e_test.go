package main

import (
	"context"
	"math"
	"testing"
	"time"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

// settleE2EPolicy's llm bucket refills one token a day, so Redis' level is a ledger of what was
// charged.
const settleE2EPolicy = `version: settle-1
rules:
  - name: llm
    routes: [/llm]
    operations: [write]
    limit: 1/day
    burst: 100
    max_debt: 30
default:
  limit: 10/minute
`

// TestSettleAcrossAgents: two agent processes behind two coordinators, on a standalone Redis and
// on a Cluster. Checks of estimates settled with their actual costs through the sockets, and an
// Envoy descriptor sent after the stream, leave Redis charged exactly the actual costs; then
// settles beyond what the bucket holds take it into debt, down to max_debt below zero, where the
// rest is forgiven (and said so), and a check in debt is refused.
func TestSettleAcrossAgents(t *testing.T) {
	redistest.Require(t)
	for _, mode := range []string{"standalone", "cluster"} {
		t.Run(mode, func(t *testing.T) {
			addrs, rdb, file, set := redisAndPolicy(t, mode, settleE2EPolicy)
			r, _ := set.Match("/llm", "POST")
			key, err := set.Key(r, "acme", "")
			if err != nil {
				t.Fatal(err)
			}
			level := func() float64 { return float64(redisTokens(t, rdb, key)) / float64(bucket.PerToken) }
			coords := []*coordinatorNode{startCoordinator(t, file, addrs), startCoordinator(t, file, addrs)}
			agents := []*agentNode{startAgent(t, file, coords), startAgent(t, file, coords)}

			// Estimates settled: 5 checks of 2 used 1 each, 5 checks of 1 used 10 each; an Envoy
			// descriptor sent when its stream ended charges 5.
			for i := range 10 {
				a := agents[i%2]
				estimate, actual := int64(2), int64(1)
				if i%2 == 1 {
					estimate, actual = 1, 10
				}
				id := settleCheck(t, a, estimate)
				got := settle(t, a, id, actual)
				if got.Pending || got.Forgiven != 0 {
					t.Fatalf("settle %d: %v, want confirmed with nothing forgiven", i, got)
				}
			}
			envoyAfter(t, agents[0], 5)
			for _, a := range agents {
				a.Terminate(t) // hands every lease back
			}
			// 5·1 + 5·10 + 5 = 60 charged; the bucket refills 1/86400 token a second.
			if got := level(); math.Abs(got-40) > 0.01 {
				t.Fatalf("after the settles Redis holds %.6f tokens, want 40: charged exactly the actual costs", got)
			}

			// Into debt: two checks of 1 (38 left), settled with 60 (59 beyond: −21) and 20 (19
			// beyond: 9 to reach −30, 10 forgiven).
			a := startAgent(t, file, coords)
			first, second := settleCheck(t, a, 1), settleCheck(t, a, 1)
			if got := settle(t, a, first, 60); got.Pending || got.Forgiven != 0 || got.Charged != 59 {
				t.Fatalf("settle of 60: %v, want 59 charged, nothing forgiven", got)
			}
			// About 10 forgiven: the refill since the start (a few µ) and what the lease held
			// move it by a token at most.
			if got := settle(t, a, second, 20); got.Pending || got.Forgiven < 9 || got.Forgiven > 11 || got.Charged != 19 {
				t.Fatalf("settle of 20: %v, want 19 charged of which about 10 forgiven (max_debt 30)", got)
			}
			if resp := a.check(t, "acme", "/llm", "POST"); resp.Decision != agentv1.Decision_DECISION_DENY {
				t.Fatalf("a check in debt: %v, want DENY until the debt is repaid", resp)
			}
			a.Terminate(t)
			if got := level(); math.Abs(got-(-30)) > 0.01 {
				t.Fatalf("in debt Redis holds %.6f tokens, want −30 (max_debt)", got)
			}
		})
	}
}

// settleCheck makes a check of an estimate to settle, allowed with a settle id. A bucket that
// refills one token a day has its agents compete for it at once (docs/leases.md, "Many agents on
// one key"): a check may be paced for a few milliseconds, then asked again.
func settleCheck(t *testing.T, a *agentNode, estimate int64) uint64 {
	t.Helper()
	for range 20 {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		resp, err := a.client.Check(ctx, &agentv1.CheckRequest{Tenant: "acme", Route: "/llm", Operation: "POST", Cost: estimate, Settle: true})
		cancel()
		switch {
		case err == nil && resp.Decision == agentv1.Decision_DECISION_DENY && resp.RetryAfterMs < 1000:
			time.Sleep(time.Duration(resp.RetryAfterMs) * time.Millisecond)
			continue
		case err != nil || resp.Decision != agentv1.Decision_DECISION_ALLOW || resp.SettleId == 0:
			t.Fatalf("check of an estimate of %d: %v, %v; want ALLOW with a settle id", estimate, resp, err)
		}
		return resp.SettleId
	}
	t.Fatalf("check of an estimate of %d paced 20 times", estimate)
	return 0
}

func settle(t *testing.T, a *agentNode, id uint64, cost int64) *agentv1.SettleResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := a.client.Settle(ctx, &agentv1.SettleRequest{SettleId: id, Cost: cost})
	if err != nil {
		t.Fatalf("settle %d at %d: %v", id, cost, err)
	}
	return resp
}

// envoyAfter sends what Envoy's rate limit filter sends when a stream ends, for a rate limit
// entry of apply_on_stream_done: the request's descriptor with the settle entry and its hits.
func envoyAfter(t *testing.T, a *agentNode, hits uint32) {
	t.Helper()
	conn, err := grpc.NewClient("unix:"+a.socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	d := &commonv3.RateLimitDescriptor{}
	for _, kv := range [][2]string{{"tenant", "acme"}, {"path", "/llm"}, {"method", "POST"}, {"settle", "true"}} {
		d.Entries = append(d.Entries, &commonv3.RateLimitDescriptor_Entry{Key: kv[0], Value: kv[1]})
	}
	resp, err := ratelimitv3.NewRateLimitServiceClient(conn).ShouldRateLimit(ctx,
		&ratelimitv3.RateLimitRequest{Domain: "leasebucket", Descriptors: []*commonv3.RateLimitDescriptor{d}, HitsAddend: hits})
	if err != nil || resp.OverallCode != ratelimitv3.RateLimitResponse_OK {
		t.Fatalf("ShouldRateLimit after the stream: %v, %v", resp, err)
	}
}
