package agent_test

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/leasebucket/leasebucket/agent"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

// TestIdempotentRepeats: on the card's bucket (burst 20, the global clock standing still), a
// repeat of an idempotency key on the same bucket is answered with the first allow, marked
// replayed, and charges nothing; the same key on another tenant is another request.
func TestIdempotentRepeats(t *testing.T) {
	s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{})
	client, _, _, _ := s.serve(t)
	check := func(tenant, key string) *agentv1.CheckResponse {
		t.Helper()
		resp, err := client.Check(ctxTimeout(t, 5*time.Second), &agentv1.CheckRequest{Tenant: tenant, Route: "/orders/7", Operation: "GET", IdempotencyKey: key})
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	for i := range 10 {
		key := fmt.Sprintf("req-%d", i)
		first := check("acme", key)
		if first.Decision != agentv1.Decision_DECISION_ALLOW || first.Replayed {
			t.Fatalf("first %s = %v", key, first)
		}
		for range 3 {
			again := check("acme", key)
			if !again.Replayed || again.Decision != first.Decision || again.Remaining != first.Remaining || again.Rule != first.Rule {
				t.Fatalf("repeat of %s = %v, want the first answer %v replayed", key, again, first)
			}
		}
	}
	if r := check("bigcorp", "req-0"); r.Replayed || r.Decision != agentv1.Decision_DECISION_ALLOW {
		t.Fatalf("the same key on another tenant's bucket = %v, want a fresh allow", r)
	}
	// 40 checks, 10 charged: 10 of the burst are left.
	allowed := 0
	for i := range 15 {
		if check("acme", fmt.Sprintf("fresh-%d", i)).Decision == agentv1.Decision_DECISION_ALLOW {
			allowed++
		}
	}
	if allowed != 10 {
		t.Fatalf("%d fresh keys allowed after 10 charged, want 10", allowed)
	}
	values := metricValues(t, s.reg)
	if values["leasebucket_agent_idempotent_replays_total"] != 30 || values["leasebucket_agent_idempotency_keys"] < 21 {
		t.Fatalf("replays %v, keys %v; want 30 and at least 21", values["leasebucket_agent_idempotent_replays_total"],
			values["leasebucket_agent_idempotency_keys"])
	}
}

// TestIdempotentDenyNotRemembered: a deny charges nothing and is not remembered: a repeat is
// decided again, and once the bucket refilled it is allowed (and that allow is remembered).
func TestIdempotentDenyNotRemembered(t *testing.T) {
	s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{})
	client, _, _, _ := s.serve(t)
	req := &agentv1.CheckRequest{Tenant: "acme", Route: "/orders/7", Operation: "GET", Cost: 20}
	if r, err := client.Check(ctxTimeout(t, 5*time.Second), req); err != nil || r.Decision != agentv1.Decision_DECISION_ALLOW {
		t.Fatalf("spending the burst = %v, %v", r, err)
	}
	req.Cost, req.IdempotencyKey = 1, "retry-me"
	for range 2 {
		r, err := client.Check(ctxTimeout(t, 5*time.Second), req)
		if err != nil || r.Decision != agentv1.Decision_DECISION_DENY || r.Replayed {
			t.Fatalf("over the limit = %v, %v; want a deny, not replayed", r, err)
		}
	}
	// orders-read refills 100 per minute: 600 ms is a token. The deny cache holds until its
	// Retry-After.
	s.storeMs.Add(600)
	var r *agentv1.CheckResponse
	eventually(t, 10*time.Second, "the repeat is allowed after the refill", func() bool {
		var err error
		r, err = client.Check(ctxTimeout(t, 5*time.Second), req)
		return err == nil && r.Decision == agentv1.Decision_DECISION_ALLOW
	})
	if r.Replayed {
		t.Fatal("the first allow of the key is marked replayed")
	}
	if again, err := client.Check(ctxTimeout(t, 5*time.Second), req); err != nil || !again.Replayed || again.Decision != agentv1.Decision_DECISION_ALLOW {
		t.Fatalf("repeat after the allow = %v, %v; want the allow replayed", again, err)
	}
}

// TestIdempotentConcurrentRepeats: the same key sent at once from many goroutines, through Check
// and within one batch, is charged once.
func TestIdempotentConcurrentRepeats(t *testing.T) {
	s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{})
	client, _, _, _ := s.serve(t)
	const n = 32
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		fresh    int
		replayed int
	)
	for range n {
		wg.Go(func() {
			r, err := client.Check(ctxTimeout(t, 5*time.Second), &agentv1.CheckRequest{Tenant: "acme", Route: "/orders/1", Operation: "GET", IdempotencyKey: "once"})
			if err != nil || r.Decision != agentv1.Decision_DECISION_ALLOW {
				t.Errorf("Check = %v, %v", r, err)
				return
			}
			mu.Lock()
			defer mu.Unlock()
			if r.Replayed {
				replayed++
			} else {
				fresh++
			}
		})
	}
	wg.Wait()
	if fresh != 1 || replayed != n-1 {
		t.Fatalf("%d fresh and %d replayed, want 1 and %d", fresh, replayed, n-1)
	}
	// A batch repeating one key (the first check of a new key waits for its refill; the repeats
	// wait for it in the same batch) and a stream doing the same.
	batch := &agentv1.CheckBatchRequest{}
	for range 5 {
		batch.Checks = append(batch.Checks, &agentv1.CheckRequest{Tenant: "acme", Route: "/orders", Operation: "GET", IdempotencyKey: "b"})
	}
	resp, err := client.CheckBatch(ctxTimeout(t, 5*time.Second), batch)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range resp.Results {
		if r.Decision != agentv1.Decision_DECISION_ALLOW || r.Replayed != (i > 0) {
			t.Fatalf("batch check %d = %v, want allow, replayed from the second on", i, r)
		}
	}
	// Charged once each: /orders/1 and /orders have 19 left.
	for _, route := range []string{"/orders/1", "/orders"} {
		allowed := 0
		for range 25 {
			r, err := client.Check(ctxTimeout(t, 5*time.Second), &agentv1.CheckRequest{Tenant: "acme", Route: route, Operation: "GET"})
			if err != nil {
				t.Fatal(err)
			}
			if r.Decision == agentv1.Decision_DECISION_ALLOW {
				allowed++
			}
		}
		if allowed != 19 {
			t.Fatalf("%s: %d allowed after the repeats, want 19", route, allowed)
		}
	}
}

// TestIdempotencyErrorsAndOff: an oversized key is INVALID_ARGUMENT; with idempotency off every
// repeat is charged.
func TestIdempotencyErrorsAndOff(t *testing.T) {
	s := newStack(t, loadPolicy(t, examplePolicy), stackOptions{})
	client, _, _, _ := s.serve(t)
	_, err := client.Check(ctxTimeout(t, 5*time.Second), &agentv1.CheckRequest{Tenant: "acme", Route: "/orders/7", Operation: "GET",
		IdempotencyKey: strings.Repeat("k", agent.MaxIdempotencyKey+1)})
	if st := status.Convert(err); st.Code() != codes.InvalidArgument || !strings.Contains(st.Message(), "invalid idempotency key") {
		t.Fatalf("oversized key = %v", err)
	}
	if n := s.lim.Keys(); n != 0 {
		t.Fatalf("%d keys after an invalid check", n)
	}

	off := newStack(t, loadPolicy(t, examplePolicy), stackOptions{idemWindow: -1})
	client, _, _, _ = off.serve(t)
	allowed := 0
	for range 25 {
		r, err := client.Check(ctxTimeout(t, 5*time.Second), &agentv1.CheckRequest{Tenant: "acme", Route: "/orders/7", Operation: "GET", IdempotencyKey: "same"})
		if err != nil || r.Replayed {
			t.Fatalf("Check with idempotency off = %v, %v", r, err)
		}
		if r.Decision == agentv1.Decision_DECISION_ALLOW {
			allowed++
		}
	}
	if allowed != 20 {
		t.Fatalf("%d allowed with idempotency off, want every repeat charged: 20", allowed)
	}
}
