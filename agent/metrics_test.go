package agent_test

import (
	"strings"
	"testing"
	"time"

	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

// TestMetricsOfTheEdges: near-limit allows, failure-mode answers, batch sizes and open streams
// are exported by rule and outcome, never by tenant.
func TestMetricsOfTheEdges(t *testing.T) {
	s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{})
	s.lossOK = true
	client, _, _, _ := s.serve(t)
	batch := &agentv1.CheckBatchRequest{}
	for range 25 {
		batch.Checks = append(batch.Checks, &agentv1.CheckRequest{Tenant: "acme", Route: "/orders/7", Operation: "GET"})
	}
	if _, err := client.CheckBatch(ctxTimeout(t, 5*time.Second), batch); err != nil {
		t.Fatal(err)
	}
	st, _ := openStream(t, client)
	if err := st.Send(streamMsg(1, 3, "acme", "/products/1", "GET")); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); err != nil {
		t.Fatal(err)
	}
	s.coord.setFault(unreachable)
	for _, c := range []*agentv1.CheckRequest{
		{Tenant: "acme", Route: "/orders/7", Operation: "POST"},     // fail closed
		{Tenant: "bigcorp", Route: "/products/1", Operation: "GET"}, // emergency
	} {
		if _, err := client.Check(ctxTimeout(t, 5*time.Second), c); err != nil {
			t.Fatal(err)
		}
	}
	values := metricValues(t, s.reg)
	for name := range values {
		if strings.Contains(name, "acme") || strings.Contains(name, "bigcorp") || strings.Contains(name, "tenant=") {
			t.Fatalf("metric %s carries a tenant", name)
		}
	}
	near := values["leasebucket_agent_near_limit_allows_total,rule=orders-read"]
	if near < 1 || near >= 20 {
		t.Errorf("near-limit allows %v, want some of the 20 (those leaving under 2 of 20)", near)
	}
	for name, want := range map[string]float64{
		"leasebucket_agent_failure_mode_answers_total,outcome=unavailable,rule=orders-write": 1,
		"leasebucket_agent_failure_mode_answers_total,outcome=allow,rule=catalog-read":       1,
		"leasebucket_agent_batch_checks,api=batch":                                           1,
		"leasebucket_agent_batch_checks,api=stream":                                          1,
		"leasebucket_agent_check_streams":                                                    1,
		"leasebucket_agent_decisions_total,outcome=deny,rule=orders-read":                    5,
	} {
		if got := values[name]; got != want {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
}
