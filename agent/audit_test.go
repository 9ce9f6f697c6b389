package agent_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/agent/audit"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

// auditRecorder is an audit.Sink keeping the records it is given.
type auditRecorder struct {
	mu      sync.Mutex
	records []audit.Record
}

func (r *auditRecorder) Write(rec *audit.Record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.records = append(r.records, *rec)
	return nil
}

func (r *auditRecorder) Sync() error { return nil }

func (r *auditRecorder) all() []audit.Record {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]audit.Record(nil), r.records...)
}

// auditStack is a stack whose server audits into a recorder; closeAudit writes what is queued.
func auditStack(t *testing.T, sample float64) (*stack, *auditRecorder, func()) {
	t.Helper()
	rec := &auditRecorder{}
	s0 := newStack(t, loadPolicy(t, examplePolicy), stackOptions{}) // for its clock
	q, err := audit.New(audit.Config{SampleAllow: sample, Sink: rec, Clock: s0.clk})
	if err != nil {
		t.Fatal(err)
	}
	q.Start()
	closeQ := func() { _ = q.Close(context.Background()) }
	t.Cleanup(closeQ)
	s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{audit: q})
	return s, rec, closeQ
}

// TestAuditTrail: every deny, unavailable, degraded and shadow-would-deny answer leaves an
// event with its rule, route template, operation, tenant, cost and Retry-After; allows are
// sampled (all of them at rate 1, none at 0); replays say so.
func TestAuditTrail(t *testing.T) {
	s, rec, closeQ := auditStack(t, 1)
	client, conn, _, _ := s.serve(t)
	for range 25 { // the card's example: 20 allows, 5 denies
		if _, err := client.Check(ctxTimeout(t, 5*time.Second), &agentv1.CheckRequest{Tenant: "acme", Route: "/orders/7", Operation: "GET"}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := client.Check(ctxTimeout(t, 5*time.Second), &agentv1.CheckRequest{Tenant: "acme", Route: "/orders/7", Operation: "GET", IdempotencyKey: "k"}); err != nil {
		t.Fatal(err)
	}
	rls := ratelimitv3.NewRateLimitServiceClient(conn)
	for range 6 { // shadow: burst 5, the sixth would deny
		if _, err := rls.ShouldRateLimit(ctxTimeout(t, 5*time.Second), &ratelimitv3.RateLimitRequest{Domain: "leasebucket",
			Descriptors: []*commonv3.RateLimitDescriptor{descriptor("tenant", "acme", "path", "/reports/x/y", "method", "GET")}}); err != nil {
			t.Fatal(err)
		}
	}
	s.coord.setFault(unreachable)
	s.lossOK = true
	resp, err := client.CheckBatch(ctxTimeout(t, 5*time.Second), &agentv1.CheckBatchRequest{Checks: []*agentv1.CheckRequest{
		{Tenant: "bigcorp", Route: "/orders/7", Operation: "POST"},  // fail closed
		{Tenant: "bigcorp", Route: "/products/1", Operation: "GET"}, // degraded
	}})
	if err != nil || resp.Results[0].Decision != agentv1.Decision_DECISION_UNAVAILABLE || !resp.Results[1].Degraded {
		t.Fatalf("batch in an outage = %v, %v", resp, err)
	}
	closeQ()
	counts := map[string]int{}
	for _, r := range rec.all() {
		key := r.API + " " + r.Decision + " " + r.Rule + " " + r.Priority.String()
		switch {
		case r.Degraded:
			key += " degraded"
		case r.Shadow:
			key += " shadow"
		case r.Replayed:
			key += " replayed"
		}
		counts[key]++
		switch r.Rule {
		case "orders-read":
			if r.Route != "/orders/{id}" || r.Operation != "read" || r.Tenant != "acme" || r.Cost != 1 {
				t.Fatalf("record %+v", r)
			}
			if (r.Decision == "deny") != (r.RetryAfter > 0) {
				t.Fatalf("record %+v: Retry-After on the wrong decision", r)
			}
		case "orders-write":
			if r.RetryAfter != time.Second || r.Route != "/orders/{id}" || r.Operation != "write" {
				t.Fatalf("record %+v", r)
			}
		}
		// The record's time comes from the check's coarse clock read against the queue's: two
		// coarse clocks (1 ms ticks), so it may lead the wall clock by a tick.
		if time.Since(r.Time) > time.Minute || time.Since(r.Time) < -2*time.Millisecond {
			t.Fatalf("record time %v", r.Time)
		}
	}
	// The idempotent check came after the bucket was empty: a deny, not remembered, not replayed.
	want := map[string]int{
		"check allow orders-read sampled":        20,
		"check deny orders-read high":            6,
		"envoy allow reports-read sampled":       5,
		"envoy allow reports-read high shadow":   1,
		"batch unavailable orders-write high":    1,
		"batch allow catalog-read high degraded": 1,
	}
	if fmt.Sprint(counts) != fmt.Sprint(want) {
		t.Fatalf("events %v\nwant   %v", counts, want)
	}
}

// TestAuditSamplesNoAllows: at sample rate 0 allows leave nothing, denies everything.
func TestAuditSamplesNoAllows(t *testing.T) {
	s, rec, closeQ := auditStack(t, 0)
	for range 22 {
		if _, err := s.srv.Decide(ctxTimeout(t, 5*time.Second), agent.Query{Tenant: "acme", Path: "/orders/7", Operation: "GET"}); err != nil {
			t.Fatal(err)
		}
	}
	closeQ()
	records := rec.all()
	if len(records) != 2 {
		t.Fatalf("%d events, want the 2 denies: %+v", len(records), records)
	}
	for _, r := range records {
		if r.Decision != "deny" || r.API != "check" {
			t.Fatalf("event %+v", r)
		}
	}
}
