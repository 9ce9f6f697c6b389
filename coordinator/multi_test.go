package coordinator_test

import (
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/coordinator/storetest"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/policy"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

const directPolicy = `version: d1
default: {limit: 100/minute}
rules:
  - name: chat
    routes: [/chat]
    operations: [write]
    lease: off
    limits: [{limit: 10/second, burst: 20}, {limit: 100/minute, burst: 8}]
  - name: leased
    routes: [/leased]
    operations: [write]
    limit: 10/second
  - name: budget
    scope: tenant
    operations: [write]
    limit: 100/hour
    burst: 5
`

// TestAcquireDirectCharges: a direct check of a route with charges is one item naming every
// bucket; the coordinator checks the names against its policy and takes all of them or none.
func TestAcquireDirectCharges(t *testing.T) {
	set, err := policy.Parse("d.yaml", []byte(directPolicy))
	if err != nil {
		t.Fatal(err)
	}
	store := memstore.New()
	svc := coordinator.NewService(store, set)
	own := &coordinatorv1.BucketRef{Rule: "chat", Route: "/chat", Operation: "write", Tenant: "acme"}
	second := &coordinatorv1.BucketRef{Rule: "chat#2", Route: "/chat", Operation: "write", Tenant: "acme"}
	budget := &coordinatorv1.BucketRef{Rule: "budget", Route: "", Operation: "*", Tenant: "acme"}
	direct := func(want, least bucket.Micro, also ...*coordinatorv1.BucketRef) *coordinatorv1.AcquireItem {
		it := item(own, want, least)
		it.Also = also
		return it
	}
	seq := uint64(0)
	call := func(items ...*coordinatorv1.AcquireItem) []*coordinatorv1.AcquireResult {
		t.Helper()
		seq++
		resp, err := svc.Acquire(ctxFor(t, 10*time.Second), acquire("agent-1", seq, "d1", items...))
		if err != nil {
			t.Fatal(err)
		}
		return resp.Results
	}
	level := func(r *coordinatorv1.BucketRef) bucket.Micro {
		t.Helper()
		lvl, err := storetest.Probe(ctxFor(t, time.Second), store, key(t, set, r), limit(t, set, r))
		if err != nil {
			t.Fatal(err)
		}
		return lvl
	}
	// Names other than the route's charges, in order, are invalid, and nothing is charged.
	for i, it := range []*coordinatorv1.AcquireItem{
		direct(tok, tok),                 // none
		direct(tok, tok, second),         // too few
		direct(tok, tok, budget, second), // out of order
		direct(tok, tok, second, second), // twice
		direct(tok, tok, second, &coordinatorv1.BucketRef{Rule: "budget", Operation: "*", Tenant: "beta"}),                                                                                                // another tenant
		{Bucket: &coordinatorv1.BucketRef{Rule: "leased", Route: "/leased", Operation: "write", Tenant: "acme"}, NeededMicro: int64(tok), MinMicro: int64(tok), Also: []*coordinatorv1.BucketRef{budget}}, // a leased route names none
	} {
		if r := call(it)[0]; r.Status != coordinatorv1.Status_STATUS_INVALID {
			t.Errorf("item %d: %v, want INVALID", i, r)
		}
	}
	if l := level(budget); l != 5*tok {
		t.Fatalf("budget holds %d µ after invalid items, want full", l)
	}
	// Three checks waiting: one take of 3 tokens from each bucket.
	r := call(direct(3*tok, tok, second, budget))[0]
	if r.Status != coordinatorv1.Status_STATUS_OK || r.GrantedMicro != int64(3*tok) || r.RemainingMicro != int64(2*tok) {
		t.Fatalf("direct take: %v, want 3 tokens with 2 left in the budget", r)
	}
	// Each bucket refills while the test runs: a level is at least what the take left, and at most
	// a tenth of a token more.
	if a, b, c := level(own), level(second), level(budget); a > 17*tok+tok/10 || b < 5*tok || b > 5*tok+tok/10 || c < 2*tok || c > 2*tok+tok/10 {
		t.Errorf("levels %d %d %d, want about 17, 5 and 2 tokens", a, b, c)
	}
	// The budget holds 2: a check of 3 is refused by it, and nothing is charged anywhere.
	r = call(direct(3*tok, 3*tok, second, budget))[0]
	if r.Status != coordinatorv1.Status_STATUS_DENIED || r.RefusedBucket != 2 || r.RetryAfterMs < 35_000 {
		t.Fatalf("direct take over the budget: %v, want denied by bucket 2 for about 36 s", r)
	}
	if b, c := level(second), level(budget); b < 5*tok || b > 5*tok+tok/10 || c < 2*tok || c > 2*tok+tok/10 {
		t.Errorf("after a refusal: levels %d %d, want 5 and 2 tokens (and what the budget refilled since)", b, c)
	}
	// A cost above the smallest burst can never be granted.
	r = call(direct(9*tok, 9*tok, second, budget))[0]
	if r.Status != coordinatorv1.Status_STATUS_DENIED || r.RetryAfterMs != int64(bucket.Never) {
		t.Fatalf("above the budget's burst: %v, want denied for good", r)
	}
}
