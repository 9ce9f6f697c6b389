package agent_test

import (
	"context"
	"errors"
	"testing"
	"time"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

const settlePolicy = `
version: "v1"
rules:
  - name: llm
    routes: ["/v1/complete"]
    operations: [write]
    limit: 600/minute
    burst: 100
    max_debt: 50
  - name: multi
    routes: ["/v1/multi"]
    operations: [write]
    limits:
      - {limit: 600/minute, burst: 100}
      - {limit: 6000/hour, burst: 200}
    max_debt: 20
default:
  limit: 60/minute
  burst: 10
`

// settleCheck decides one check of an estimate to settle and fails unless it is allowed with a
// settle id.
func settleCheck(t *testing.T, s *stack, path string, estimate int64) uint64 {
	t.Helper()
	v, err := s.srv.Decide(context.Background(), agent.Query{Tenant: "acme", Path: path, Operation: "POST", Cost: estimate, Settle: true})
	if err != nil {
		t.Fatal(err)
	}
	if v.Outcome != agent.Allow || v.SettleID == 0 {
		t.Fatalf("check of %s on an estimate of %d = %v, settle id %d; want allowed with an id", path, estimate, v.Outcome, v.SettleID)
	}
	return v.SettleID
}

// TestSettleExact: on a store whose clock stands still, estimates replaced by actual costs leave
// each bucket charged exactly the actual costs once the agent has handed its leases back: an
// unused estimate goes back into its lease, extra cost is spent from the lease as far as it
// holds (a cold key's lease holds what its check needed) and debited from the bucket as debt.
func TestSettleExact(t *testing.T) {
	s := newStack(t, parsePolicy(t, settlePolicy), stackOptions{})
	var want bucket.Micro
	for i, c := range []struct{ estimate, actual int64 }{{10, 4}, {2, 7}, {5, 5}, {3, 0}, {1, 12}} {
		id := settleCheck(t, s, "/v1/complete", c.estimate)
		r, err := s.lim.Settle(s.clk.Now(), id, c.actual)
		if err != nil {
			t.Fatalf("settle %d: %v", i, err)
		}
		credited, charged := max(0, c.estimate-c.actual), max(0, c.actual-c.estimate)
		if r.Credited != bucket.Micro(credited)*bucket.PerToken || r.Charged != bucket.Micro(charged)*bucket.PerToken || r.Debt > r.Charged {
			t.Errorf("Settle(estimate %d, actual %d) = %+v, want %d credited, %d charged (from the lease or as debt)",
				c.estimate, c.actual, r, credited, charged)
		}
		want += bucket.Micro(c.actual) * bucket.PerToken
	}
	s.stop(t)
	st := s.lim.Stats()
	if got := s.level(t, "/v1/complete", "POST", "acme"); got != 100*bucket.PerToken-want {
		t.Errorf("bucket holds %d µ, want %d µ: charged exactly the actual costs (lost %d, skipped %d, uncredited %d, debt lost %d, forgiven %d, refunds lost %d)",
			got, 100*bucket.PerToken-want, st.LostMicro.Load(), st.SkippedMicro.Load(), st.SettleUncredited.Load(), st.DebtLost.Load(), st.DebtForgiven.Load(), st.RefundsLost.Load())
	}
	if st.Settles.Load() != 5 || st.SettleUncredited.Load() != 0 {
		t.Errorf("stats: %d settles, %d µ uncredited; want 5 and 0", st.Settles.Load(), st.SettleUncredited.Load())
	}
}

// TestSettleSeveralBuckets: a check of a rule with two limits settles in both buckets.
func TestSettleSeveralBuckets(t *testing.T) {
	set := parsePolicy(t, settlePolicy)
	s := newStack(t, set, stackOptions{})
	id := settleCheck(t, s, "/v1/multi", 10)
	if _, err := s.lim.Settle(s.clk.Now(), id, 3); err != nil {
		t.Fatal(err)
	}
	id = settleCheck(t, s, "/v1/multi", 1)
	if _, err := s.lim.Settle(s.clk.Now(), id, 6); err != nil {
		t.Fatal(err)
	}
	s.stop(t)
	// Exact, but for what a refund lost (a refill replaced the lease a cost was refunded to, on a
	// loaded machine: docs/agent.md): those tokens stay spent, counted, in either bucket.
	first, second := s.level(t, "/v1/multi", "POST", "acme"), chargeLevelOf(t, s, "/v1/multi", "POST", "multi#2")
	lost := bucket.Micro(s.lim.Stats().RefundsLostMicro.Load())
	if first > (100-9)*bucket.PerToken || second > (200-9)*bucket.PerToken || (100-9+200-9)*bucket.PerToken-first-second != lost {
		t.Errorf("the limits hold %d and %d µ, want %d and %d µ less the %d µ of lost refunds",
			first, second, (100-9)*bucket.PerToken, (200-9)*bucket.PerToken, lost)
	}
}

// TestSettleBadInput: unknown and settled ids, negative costs and costs above a bucket's
// capacity plus its max_debt are refused; nothing is charged twice, and a refused cost leaves
// the check to be settled.
func TestSettleBadInput(t *testing.T) {
	s := newStack(t, parsePolicy(t, settlePolicy), stackOptions{})
	now := s.clk.Now
	if _, err := s.lim.Settle(now(), 12345, 1); !errors.Is(err, agent.ErrUnknownSettle) {
		t.Errorf("Settle(unknown id) = %v, want ErrUnknownSettle", err)
	}
	id := settleCheck(t, s, "/v1/complete", 5)
	for _, cost := range []int64{-1, 151, 1 << 62} {
		if _, err := s.lim.Settle(now(), id, cost); !errors.Is(err, agent.ErrInvalidCost) {
			t.Errorf("Settle(cost %d) = %v, want ErrInvalidCost", cost, err)
		}
	}
	if _, err := s.lim.Settle(now(), id, 150); err != nil { // capacity 100 + max_debt 50
		t.Fatalf("Settle(150) after refused costs: %v", err)
	}
	if _, err := s.lim.Settle(now(), id, 1); !errors.Is(err, agent.ErrUnknownSettle) {
		t.Errorf("second Settle = %v, want ErrUnknownSettle: nothing is settled twice", err)
	}
	// A check without Settle has no id.
	v, err := s.srv.Decide(context.Background(), agent.Query{Tenant: "acme", Path: "/v1/complete", Operation: "POST"})
	if err != nil || v.SettleID != 0 {
		t.Errorf("check without settle: id %d, %v; want 0", v.SettleID, err)
	}
}

// TestSettleWindow: a hold not settled within the window is dropped (its estimate stays
// charged); so is the oldest when the table is full.
func TestSettleWindow(t *testing.T) {
	set := parsePolicy(t, settlePolicy)
	l := agent.New(agent.Config{AgentID: "a", SettleWindow: time.Minute, MaxHolds: 16 * 4}, set)
	q := agent.Query{Tenant: "acme", Path: "/v1/complete", Operation: "POST", Cost: 1, Settle: true}
	var ids []uint64
	for i := range 400 {
		id := l.HoldForTest(q, clock.Of(time.Duration(i)*time.Millisecond))
		if id == 0 {
			t.Fatal("no hold kept")
		}
		ids = append(ids, id)
	}
	if n := l.Holds(); n > 16*4 {
		t.Errorf("%d holds kept, want at most 64", n)
	}
	if st := l.Stats(); st.HoldsDropped.Load() < 400-64 {
		t.Errorf("%d holds dropped to make room, want at least %d", st.HoldsDropped.Load(), 400-64)
	}
	if _, err := l.Settle(clock.Of(time.Second), ids[399], 1); err != nil {
		t.Errorf("settling the newest hold: %v", err)
	}
	if _, err := l.Settle(clock.Of(time.Second), ids[0], 1); !errors.Is(err, agent.ErrUnknownSettle) {
		t.Errorf("settling a hold dropped for room = %v, want ErrUnknownSettle", err)
	}
	if _, err := l.Settle(clock.Of(2*time.Minute), ids[398], 1); !errors.Is(err, agent.ErrUnknownSettle) {
		t.Errorf("settling past the window = %v, want ErrUnknownSettle", err)
	}
}

// TestSettleRPC: the native API gives settle ids, settles them and maps errors to status codes.
func TestSettleRPC(t *testing.T) {
	s := newStack(t, parsePolicy(t, settlePolicy), stackOptions{})
	api, _, _, _ := s.serve(t)
	ctx := ctxTimeout(t, 10*time.Second)
	resp, err := api.Check(ctx, &agentv1.CheckRequest{Tenant: "acme", Route: "/v1/complete", Operation: "POST", Cost: 8, Settle: true})
	if err != nil || resp.Decision != agentv1.Decision_DECISION_ALLOW || resp.SettleId == 0 {
		t.Fatalf("Check = %v, %v; want ALLOW with a settle id", resp, err)
	}
	got, err := api.Settle(ctx, &agentv1.SettleRequest{SettleId: resp.SettleId, Cost: 3})
	if err != nil || got.Credited != 5 || got.Charged != 0 {
		t.Fatalf("Settle = %v, %v; want 5 credited", got, err)
	}
	for _, c := range []struct {
		req  *agentv1.SettleRequest
		code codes.Code
	}{
		{&agentv1.SettleRequest{SettleId: resp.SettleId, Cost: 3}, codes.NotFound},
		{&agentv1.SettleRequest{SettleId: 0, Cost: 3}, codes.NotFound},
	} {
		if _, err := api.Settle(ctx, c.req); status.Code(err) != c.code {
			t.Errorf("Settle(%v) = %v, want %v", c.req, err, c.code)
		}
	}
	batch, err := api.CheckBatch(ctx, &agentv1.CheckBatchRequest{Checks: []*agentv1.CheckRequest{
		{Tenant: "acme", Route: "/v1/complete", Operation: "POST", Cost: 2, Settle: true},
		{Tenant: "acme", Route: "/v1/complete", Operation: "POST", Cost: 2},
	}})
	if err != nil || batch.Results[0].SettleId == 0 || batch.Results[1].SettleId != 0 {
		t.Fatalf("CheckBatch = %v, %v; want an id for the first check only", batch, err)
	}
	if _, err := api.Settle(ctx, &agentv1.SettleRequest{SettleId: batch.Results[0].SettleId, Cost: -4}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("Settle(negative) = %v, want InvalidArgument", err)
	}
}

// TestEnvoyAfterResponse: a descriptor with the settle entry (Envoy's apply_on_stream_done) is
// charged its hits_addend after the fact, never refused, in every bucket its check charges, down
// to max_debt below zero; mixing it with descriptors of the request is refused, as are costs
// above a bucket's capacity plus max_debt.
func TestEnvoyAfterResponse(t *testing.T) {
	s := newStack(t, parsePolicy(t, settlePolicy), stackOptions{})
	client := envoyClient(t, s)
	call := envoyCaller(t, client)
	after := descriptor("tenant", "acme", "path", "/v1/complete", "method", "POST", "settle", "true")
	for range 3 {
		resp := call(60, after)
		if resp.OverallCode != ratelimitv3.RateLimitResponse_OK {
			t.Fatalf("after-response call = %v, want OK", resp.OverallCode)
		}
	}
	eventually(t, 5*time.Second, "debt debited", func() bool {
		return s.level(t, "/v1/complete", "POST", "acme") == -50*bucket.PerToken
	})
	st := s.lim.Stats()
	if st.DebtCharged.Load() != uint64(150*bucket.PerToken) || st.DebtForgiven.Load() != uint64(30*bucket.PerToken) {
		t.Errorf("debt charged %d µ, forgiven %d µ; want 150 and 30 tokens (max_debt 50 below a bucket of 100)",
			st.DebtCharged.Load(), st.DebtForgiven.Load())
	}
	// The bucket is in debt: a check waits until it is repaid.
	v, err := s.srv.Decide(context.Background(), agent.Query{Tenant: "acme", Path: "/v1/complete", Operation: "POST"})
	if err != nil || v.Outcome != agent.Deny || v.RetryAfter < 4*time.Second {
		t.Errorf("check in debt = %v after %v, %v; want denied for the 5.1 s until 51 tokens refill", v.Outcome, v.RetryAfter, err)
	}
	for _, req := range []*ratelimitv3.RateLimitRequest{
		{Domain: "leasebucket", Descriptors: []*commonv3.RateLimitDescriptor{after, descriptor("tenant", "acme", "path", "/v1/complete", "method", "POST")}},
		{Domain: "leasebucket", Descriptors: []*commonv3.RateLimitDescriptor{after}, HitsAddend: 151},
	} {
		if _, err := client.ShouldRateLimit(ctxTimeout(t, 5*time.Second), req); status.Code(err) != codes.InvalidArgument {
			t.Errorf("ShouldRateLimit(%v) = %v, want InvalidArgument", req, err)
		}
	}
}
