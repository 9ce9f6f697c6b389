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

// TestReturnDirectCharges: the grant of a direct take of several buckets that no check spent is
// handed back to every bucket in one Return item naming the same others; the coordinator checks
// the names as for the take, and credits each bucket (on a store whose clock stands still, all of
// it). Such an item is refused among an Acquire's returns, and a return naming no others credits
// the route's own bucket alone.
func TestReturnDirectCharges(t *testing.T) {
	set, err := policy.Parse("d.yaml", []byte(directPolicy))
	if err != nil {
		t.Fatal(err)
	}
	store := memstore.New(memstore.WithClock(func() bucket.Millis { return 1_000_000 }))
	svc := coordinator.NewService(store, set)
	own := &coordinatorv1.BucketRef{Rule: "chat", Route: "/chat", Operation: "write", Tenant: "acme"}
	second := &coordinatorv1.BucketRef{Rule: "chat#2", Route: "/chat", Operation: "write", Tenant: "acme"}
	budget := &coordinatorv1.BucketRef{Rule: "budget", Route: "", Operation: "*", Tenant: "acme"}
	seq := uint64(0)
	levels := func() [3]bucket.Micro {
		t.Helper()
		var out [3]bucket.Micro
		for i, r := range []*coordinatorv1.BucketRef{own, second, budget} {
			lvl, err := storetest.Probe(ctxFor(t, time.Second), store, key(t, set, r), limit(t, set, r))
			if err != nil {
				t.Fatal(err)
			}
			out[i] = lvl
		}
		return out
	}
	it := item(own, 3*tok, tok)
	it.Also = []*coordinatorv1.BucketRef{second, budget}
	seq++
	resp, err := svc.Acquire(ctxFor(t, 10*time.Second), acquire("agent-1", seq, "d1", it))
	if err != nil {
		t.Fatal(err)
	}
	g := resp.Results[0]
	if g.Status != coordinatorv1.Status_STATUS_OK || g.GrantedMicro != int64(3*tok) {
		t.Fatalf("direct take: %v, want 3 tokens", g)
	}
	if l := levels(); l != [3]bucket.Micro{17 * tok, 5 * tok, 2 * tok} {
		t.Fatalf("levels after the take %v, want 17, 5 and 2 tokens", l)
	}
	back := func(also ...*coordinatorv1.BucketRef) *coordinatorv1.ReturnItem {
		return &coordinatorv1.ReturnItem{Bucket: own, UnspentMicro: int64(3 * tok), GrantedAtMs: g.GrantedAtMs, Also: also}
	}
	ret := func(s uint64, items ...*coordinatorv1.ReturnItem) []*coordinatorv1.ReturnResult {
		t.Helper()
		resp, err := svc.Return(ctxFor(t, 10*time.Second), &coordinatorv1.ReturnRequest{AgentId: "agent-1", Seq: s, PolicyVersion: "d1", Items: items})
		if err != nil {
			t.Fatal(err)
		}
		return resp.Results
	}
	// Names other than the route's charges, in order, are invalid, and nothing is credited.
	for i, r := range []*coordinatorv1.ReturnItem{
		back(second),         // too few
		back(budget, second), // out of order
		back(second, &coordinatorv1.BucketRef{Rule: "budget", Operation: "*", Tenant: "beta"}), // another tenant
	} {
		seq++
		if res := ret(seq, r)[0]; res.Status != coordinatorv1.Status_STATUS_INVALID {
			t.Errorf("return %d: %v, want INVALID", i, res)
		}
	}
	// Among an Acquire's returns it is refused too: a take of several buckets credits nothing.
	seq++
	resp, err = svc.Acquire(ctxFor(t, 10*time.Second), &coordinatorv1.AcquireRequest{AgentId: "agent-1", Seq: seq, PolicyVersion: "d1",
		Returns: []*coordinatorv1.ReturnItem{back(second, budget)}})
	if err != nil {
		t.Fatal(err)
	}
	if res := resp.Returns[0]; res.Status != coordinatorv1.Status_STATUS_INVALID {
		t.Errorf("an Acquire's return of several buckets: %v, want INVALID", res)
	}
	if l := levels(); l != [3]bucket.Micro{17 * tok, 5 * tok, 2 * tok} {
		t.Fatalf("levels after refused returns %v, want 17, 5 and 2 tokens", l)
	}
	// Handed back to all three: each gets its 3 tokens back; a repeat credits nothing more.
	seq++
	for range 2 {
		res := ret(seq, back(second, budget))[0]
		if res.Status != coordinatorv1.Status_STATUS_OK || res.CreditedMicro != int64(9*tok) {
			t.Fatalf("return to every bucket: %v, want 9 tokens credited (3 to each)", res)
		}
		if l := levels(); l != [3]bucket.Micro{20 * tok, 8 * tok, 5 * tok} {
			t.Fatalf("levels after the return %v, want 20, 8 and 5 tokens: every bucket full again", l)
		}
	}
	// A return naming no others (an agent of an earlier version) credits the route's own bucket
	// alone.
	it = item(own, 3*tok, tok)
	it.Also = []*coordinatorv1.BucketRef{second, budget}
	seq++
	if resp, err = svc.Acquire(ctxFor(t, 10*time.Second), acquire("agent-1", seq, "d1", it)); err != nil || resp.Results[0].Status != coordinatorv1.Status_STATUS_OK {
		t.Fatalf("second direct take: %v, %v", resp, err)
	}
	seq++
	if res := ret(seq, back())[0]; res.Status != coordinatorv1.Status_STATUS_OK || res.CreditedMicro != int64(3*tok) {
		t.Fatalf("return to the own bucket: %v, want 3 tokens credited", res)
	}
	if l := levels(); l != [3]bucket.Micro{20 * tok, 5 * tok, 2 * tok} {
		t.Fatalf("levels after a return to the own bucket %v, want 20, 5 and 2 tokens", l)
	}
}
