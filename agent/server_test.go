package agent_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/internal/bucket"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

// TestCheckOverUnixSocket is the card's example through the native API: orders-read allows 100
// per minute with bursts of 20. With the global bucket's clock standing still, exactly 20 checks
// are allowed, then every check is denied with a Retry-After.
func TestCheckOverUnixSocket(t *testing.T) {
	s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{})
	client, _, _, _ := s.serve(t)
	req := &agentv1.CheckRequest{Tenant: "acme", Route: "/orders/7", Operation: "GET"}
	var allowed, denied int
	lastRemaining := int64(1 << 62)
	for i := range 25 {
		resp, err := client.Check(ctxTimeout(t, 5*time.Second), req)
		if err != nil {
			t.Fatalf("check %d: %v", i+1, err)
		}
		if resp.Rule != "orders-read" || resp.Limit != 100 || resp.WindowMs != 60_000 {
			t.Fatalf("check %d: rule %q limit %d window %d ms, want orders-read 100 per 60000 ms", i+1, resp.Rule, resp.Limit, resp.WindowMs)
		}
		if resp.Degraded || resp.ShadowDeny || resp.Replayed {
			t.Fatalf("check %d: %v, want no flags", i+1, resp)
		}
		switch resp.Decision {
		case agentv1.Decision_DECISION_ALLOW:
			if denied > 0 {
				t.Fatalf("check %d allowed after a denial (bucket clock stands still)", i+1)
			}
			if resp.RetryAfterMs != 0 {
				t.Fatalf("check %d: allow with retry_after_ms %d", i+1, resp.RetryAfterMs)
			}
			if resp.Remaining > lastRemaining {
				t.Fatalf("check %d: remaining grew from %d to %d", i+1, lastRemaining, resp.Remaining)
			}
			lastRemaining = resp.Remaining
			allowed++
		case agentv1.Decision_DECISION_DENY:
			// 1 token at 100/minute is 600 ms away at most.
			if resp.RetryAfterMs <= 0 || resp.RetryAfterMs > 600 {
				t.Fatalf("check %d: deny with retry_after_ms %d, want 1..600", i+1, resp.RetryAfterMs)
			}
			if resp.Remaining != 0 || resp.ResetMs <= 0 || resp.ResetMs > 12_000 {
				t.Fatalf("check %d: deny with remaining %d reset %d ms, want 0 and 1..12000 ms", i+1, resp.Remaining, resp.ResetMs)
			}
			denied++
		default:
			t.Fatalf("check %d: %v", i+1, resp)
		}
	}
	if allowed != 20 || denied != 5 {
		t.Fatalf("allowed %d, denied %d; want 20 then 5", allowed, denied)
	}
}

func TestCheckErrors(t *testing.T) {
	s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{})
	client, _, _, _ := s.serve(t)
	for _, tc := range []struct {
		name string
		req  *agentv1.CheckRequest
		code codes.Code
		msg  string
	}{
		{"empty tenant", &agentv1.CheckRequest{Route: "/orders/7", Operation: "GET"}, codes.InvalidArgument, "invalid tenant"},
		{"cost above the burst", &agentv1.CheckRequest{Tenant: "acme", Route: "/orders/7", Operation: "GET", Cost: 21}, codes.InvalidArgument, "cost 21 is not in 1..20"},
		{"negative cost", &agentv1.CheckRequest{Tenant: "acme", Route: "/orders/7", Operation: "GET", Cost: -1}, codes.InvalidArgument, "invalid cost"},
		{"encoded NUL", &agentv1.CheckRequest{Tenant: "acme", Route: "/orders/%00", Operation: "GET"}, codes.InvalidArgument, "invalid route"},
		{"relative path", &agentv1.CheckRequest{Tenant: "acme", Route: "orders", Operation: "GET"}, codes.InvalidArgument, "invalid route"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := client.Check(ctxTimeout(t, 5*time.Second), tc.req)
			st := status.Convert(err)
			if st.Code() != tc.code || !strings.Contains(st.Message(), tc.msg) {
				t.Fatalf("Check = %v %q, want %v containing %q", st.Code(), st.Message(), tc.code, tc.msg)
			}
		})
	}
}

// TestShutdown: health turns NOT_SERVING, checks after the Limiter closed answer UNAVAILABLE, and
// every lease is back in the global bucket.
func TestShutdown(t *testing.T) {
	s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{})
	client, conn, hs, _ := s.serve(t)
	hc := healthpb.NewHealthClient(conn)
	for _, svc := range []string{"", "leasebucket.agent.v1.AgentService"} {
		resp, err := hc.Check(ctxTimeout(t, 5*time.Second), &healthpb.HealthCheckRequest{Service: svc})
		if err != nil || resp.Status != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("health %q = %v, %v; want SERVING", svc, resp, err)
		}
	}
	req := &agentv1.CheckRequest{Tenant: "acme", Route: "/products/42", Operation: "GET"}
	for range 5 {
		if resp, err := client.Check(ctxTimeout(t, 5*time.Second), req); err != nil || resp.Decision != agentv1.Decision_DECISION_ALLOW {
			t.Fatalf("Check = %v, %v", resp, err)
		}
	}
	capacity := 60 * bucket.PerToken
	if lvl := s.level(t, "/products/42", "GET", "acme"); lvl > capacity-5*bucket.PerToken {
		t.Fatalf("bucket holds %d µ after 5 allows; leases should hold more than the 5 tokens spent", lvl)
	}
	hs.Shutdown()
	resp, err := hc.Check(ctxTimeout(t, 5*time.Second), &healthpb.HealthCheckRequest{})
	if err != nil || resp.Status != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf("health after Shutdown = %v, %v; want NOT_SERVING", resp, err)
	}
	s.stop(t)
	if _, err := client.Check(ctxTimeout(t, 5*time.Second), req); status.Code(err) != codes.Unavailable {
		t.Fatalf("Check after Stop = %v, want UNAVAILABLE", err)
	}
	// The bucket's clock stood still: it holds exactly the capacity less the 5 tokens spent.
	if lvl := s.level(t, "/products/42", "GET", "acme"); lvl != capacity-5*bucket.PerToken {
		t.Fatalf("bucket holds %d µ after shutdown, want %d (capacity less 5 spent)", lvl, capacity-5*bucket.PerToken)
	}
	if n, _ := s.lim.Pending(); n != 0 {
		t.Fatalf("%d refills still queued after Stop", n)
	}
}

// TestShutdownBounded: with the coordinator hanging, Stop gives up at its deadline and reports
// the tokens it could not return.
func TestShutdownBounded(t *testing.T) {
	s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{callTimeout: 100 * time.Millisecond})
	q := agent.Query{Tenant: "acme", Path: "/products/1", Operation: "GET"}
	s.warm(t, q) // a lease to hand back at shutdown
	s.coord.setFault(hang)
	s.lossOK = true
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := s.ref.Stop(ctx)
	var re *agent.ReturnError
	if !errors.As(err, &re) || re.LostMicro == 0 {
		t.Fatalf("Stop with a hanging coordinator = %v, want a ReturnError", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("Stop took %v with a 300 ms deadline", took)
	}
	if got := s.lim.Stats().LostMicro.Load(); got != re.LostMicro {
		t.Fatalf("LostMicro = %d, ReturnError says %d", got, re.LostMicro)
	}
}

// TestMetrics: decisions by rule and outcome, the core's counters and the outstanding-lease gauge
// are exported; no metric carries a tenant.
func TestMetrics(t *testing.T) {
	s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{})
	client, _, _, _ := s.serve(t)
	for range 25 {
		if _, err := client.Check(ctxTimeout(t, 5*time.Second), &agentv1.CheckRequest{Tenant: "acme", Route: "/orders/7", Operation: "GET"}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := client.Check(ctxTimeout(t, 5*time.Second), &agentv1.CheckRequest{Route: "/orders/7", Operation: "GET"}); err == nil {
		t.Fatal("check without tenant succeeded")
	}
	settle(t, s)
	families, err := s.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	values := map[string]float64{}
	for _, f := range families {
		for _, m := range f.Metric {
			name := f.GetName()
			for _, l := range m.Label {
				if l.GetName() == "tenant" || l.GetValue() == "acme" {
					t.Fatalf("metric %s carries the tenant: %v", name, m.Label)
				}
				name += "," + l.GetName() + "=" + l.GetValue()
			}
			switch {
			case m.Counter != nil:
				values[name] = m.Counter.GetValue()
			case m.Gauge != nil:
				values[name] = m.Gauge.GetValue()
			case m.Histogram != nil:
				values[name] = float64(m.Histogram.GetSampleCount())
			}
		}
	}
	held := float64(s.lim.Outstanding()) / float64(bucket.PerToken)
	for name, want := range map[string]float64{
		"leasebucket_agent_decisions_total,outcome=allow,rule=orders-read": 20,
		"leasebucket_agent_decisions_total,outcome=deny,rule=orders-read":  5,
		"leasebucket_agent_invalid_checks_total":                           1,
		"leasebucket_agent_keys":                                           1,
		"leasebucket_agent_outstanding_lease_tokens":                       held,
		"leasebucket_agent_lease_grants_total":                             float64(s.lim.Stats().Grants.Load()),
		"leasebucket_agent_refill_duration_seconds":                        float64(s.lim.Stats().Acquires.Load()),
	} {
		if got, ok := values[name]; !ok || got != want {
			t.Errorf("%s = %v (present %v), want %v", name, got, ok, want)
		}
	}
	for _, name := range []string{"leasebucket_agent_lease_returns_total", "leasebucket_agent_tokens_lost_total",
		"leasebucket_agent_lease_expiries_total", "leasebucket_agent_degraded_admissions_total",
		"leasebucket_agent_coordinator_calls_in_flight"} {
		if _, ok := values[name]; !ok {
			t.Errorf("metric %s missing", name)
		}
	}
}
