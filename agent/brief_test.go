package agent_test

import (
	"testing"
	"time"

	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

// TestBriefAnswers: a check sent brief is answered, when allowed, without its RateLimit fields
// (remaining, limit, window, reset) and with everything else (decision, rule); a check not sent
// brief, and a denied one whatever it was sent, is answered in full. The same through Check,
// CheckBatch and CheckStream. orders-read allows 100 a minute with bursts of 20, the global
// bucket's clock standing still: each API's tenant gets 20 allows, then denials.
func TestBriefAnswers(t *testing.T) {
	s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{})
	client, _, _, _ := s.serve(t)
	// 24 checks, every other one brief: the first 20 allowed, the last 4 denied.
	checks := func(tenant string) []*agentv1.CheckRequest {
		var cs []*agentv1.CheckRequest
		for i := range 24 {
			cs = append(cs, &agentv1.CheckRequest{Tenant: tenant, Route: "/orders/7", Operation: "GET", Brief: i%2 == 0})
		}
		return cs
	}
	verify := func(t *testing.T, reqs []*agentv1.CheckRequest, answers []*agentv1.CheckResponse) {
		t.Helper()
		if len(answers) != len(reqs) {
			t.Fatalf("%d answers for %d checks", len(answers), len(reqs))
		}
		for i, resp := range answers {
			if resp.Rule != "orders-read" {
				t.Errorf("check %d: rule %q, want orders-read", i+1, resp.Rule)
			}
			full := resp.Limit == 100 && resp.WindowMs == 60_000
			empty := resp.Remaining == 0 && resp.Limit == 0 && resp.WindowMs == 0 && resp.ResetMs == 0
			switch {
			case i < 20 && resp.Decision != agentv1.Decision_DECISION_ALLOW, i >= 20 && resp.Decision != agentv1.Decision_DECISION_DENY:
				t.Errorf("check %d: %v, want 20 allows then denials", i+1, resp.Decision)
			case resp.Decision == agentv1.Decision_DECISION_ALLOW && reqs[i].Brief && !empty:
				t.Errorf("check %d, brief, allowed: %v; want no RateLimit fields", i+1, resp)
			case resp.Decision == agentv1.Decision_DECISION_ALLOW && !reqs[i].Brief && (!full || resp.Remaining != int64(19-i)):
				t.Errorf("check %d, not brief, allowed: %v; want limit 100 per 60000 ms, remaining %d", i+1, resp, 19-i)
			case resp.Decision == agentv1.Decision_DECISION_DENY && (!full || resp.RetryAfterMs <= 0 || resp.ResetMs <= 0):
				t.Errorf("check %d (brief %v), denied: %v; want every field", i+1, reqs[i].Brief, resp)
			}
		}
	}
	t.Run("Check", func(t *testing.T) {
		reqs := checks("acme-check")
		var answers []*agentv1.CheckResponse
		for i, req := range reqs {
			resp, err := client.Check(ctxTimeout(t, 5*time.Second), req)
			if err != nil {
				t.Fatalf("check %d: %v", i+1, err)
			}
			answers = append(answers, resp)
		}
		verify(t, reqs, answers)
	})
	t.Run("CheckBatch", func(t *testing.T) {
		reqs := checks("acme-batch")
		resp, err := client.CheckBatch(ctxTimeout(t, 5*time.Second), &agentv1.CheckBatchRequest{Checks: reqs})
		if err != nil {
			t.Fatal(err)
		}
		verify(t, reqs, resp.Results)
	})
	t.Run("CheckStream", func(t *testing.T) {
		reqs := checks("acme-stream")
		st, _ := openStream(t, client)
		var answers []*agentv1.CheckResponse
		for i := 0; i < len(reqs); i += 6 { // four messages of six checks
			if err := st.Send(&agentv1.CheckStreamRequest{Id: uint64(i), Checks: reqs[i : i+6]}); err != nil {
				t.Fatal(err)
			}
			resp, err := st.Recv()
			if err != nil {
				t.Fatal(err)
			}
			if resp.Id != uint64(i) {
				t.Fatalf("answer to message %d, want %d", resp.Id, i)
			}
			answers = append(answers, resp.Results...)
		}
		verify(t, reqs, answers)
	})
}
