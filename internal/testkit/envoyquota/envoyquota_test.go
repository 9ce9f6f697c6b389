package envoyquota

import (
	"testing"
	"time"

	rlqsv3 "github.com/envoyproxy/go-control-plane/envoy/service/rate_limit_quota/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// manual is a clock the test moves.
type manual struct{ now time.Duration }

func (m *manual) Now() time.Duration { return m.now }

func testFilter(t *testing.T) (*Filter, *manual) {
	t.Helper()
	cfg, err := ParseConfig(FilterYAML("leasebucket", time.Hour, 2*time.Second,
		Route{Prefix: "/q/", Template: "/q/{id}"},
		Route{Prefix: "/r/", Method: "GET", Template: "/r/{id}", Emergency: &Emergency{Burst: 2, PerSecond: 1}}))
	if err != nil {
		t.Fatal(err)
	}
	clk := &manual{}
	f, err := New(cfg, nil, Options{Now: clk.Now}) // no connection: reports are dropped
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	return f, clk
}

func tokenBucketAction(maxTokens, perFill uint32, ttl time.Duration) *rlqsv3.RateLimitQuotaResponse_BucketAction_QuotaAssignmentAction {
	return &rlqsv3.RateLimitQuotaResponse_BucketAction_QuotaAssignmentAction{AssignmentTimeToLive: durationpb.New(ttl),
		RateLimitStrategy: &typev3.RateLimitStrategy{Strategy: &typev3.RateLimitStrategy_TokenBucket{TokenBucket: &typev3.TokenBucket{
			MaxTokens: maxTokens, TokensPerFill: wrapperspb.UInt32(perFill), FillInterval: durationpb.New(time.Second)}}}}
}

func action(id map[string]string, qa *rlqsv3.RateLimitQuotaResponse_BucketAction_QuotaAssignmentAction) *rlqsv3.RateLimitQuotaResponse_BucketAction {
	return &rlqsv3.RateLimitQuotaResponse_BucketAction{BucketId: &rlqsv3.BucketId{Bucket: id},
		BucketAction: &rlqsv3.RateLimitQuotaResponse_BucketAction_QuotaAssignmentAction_{QuotaAssignmentAction: qa}}
}

func allowed(f *Filter, req Request, n int) (int, Source) {
	k, src := 0, Unmatched
	for range n {
		d := f.Decide(req)
		if d.Allowed {
			k++
		}
		src = d.Source
	}
	return k, src
}

// TestFilterBehaviour: the filter's documented behaviour, step by step on a manual clock: bucket
// matching (first match, method predicates, unmatched allowed), no_assignment_behavior, a token
// bucket starting full and refilling continuously, an equal assignment extending the active one
// (its tokens carried over) and another replacing it, expiry into expired_assignment_behavior for
// its timeout, then abandoned; an abandon action forgets the bucket, whose next request
// subscribes again.
func TestFilterBehaviour(t *testing.T) {
	f, clk := testFilter(t)
	q := HTTP("acme", "GET", "/q/7")
	qid := map[string]string{"tenant": "acme", "path": "/q/{id}", "method": "GET"}
	if d := f.Decide(HTTP("acme", "GET", "/elsewhere")); !d.Allowed || d.Source != Unmatched {
		t.Fatalf("unmatched: %+v, want allowed, not reported", d)
	}
	if d := f.Decide(HTTP("acme", "POST", "/r/1")); d.Source != Unmatched {
		t.Fatalf("POST /r/1 matched a GET-only matcher: %+v", d)
	}
	if n, src := allowed(f, q, 3); n != 0 || src != NoAssigned {
		t.Fatalf("before an assignment: %d allowed by %v, want DENY_ALL of no_assignment_behavior", n, src)
	}
	if n, _ := allowed(f, HTTP("acme", "GET", "/r/1"), 5); n != 2 {
		t.Fatalf("emergency route before an assignment: %d allowed, want its fallback bucket's 2", n)
	}
	f.applyAction(clk.now, action(qid, tokenBucketAction(5, 2, 3*time.Second)))
	if n, src := allowed(f, q, 10); n != 5 || src != Assignment {
		t.Fatalf("a fresh token bucket of 5: %d allowed (%v)", n, src)
	}
	clk.now += 1500 * time.Millisecond // 2 a second, continuously: 3 tokens
	if n, _ := allowed(f, q, 10); n != 3 {
		t.Fatalf("after 1.5 s at 2/s: %d allowed, want 3", n)
	}
	// The same strategy extends the active assignment: no fresh tokens, a new time to live.
	f.applyAction(clk.now, action(qid, tokenBucketAction(5, 2, 3*time.Second)))
	if n, _ := allowed(f, q, 10); n != 0 {
		t.Fatalf("an equal assignment refilled the bucket: %d allowed", n)
	}
	clk.now += 2900 * time.Millisecond // past the first ttl, within the extended one
	if n, src := allowed(f, q, 10); n != 5 || src != Assignment {
		t.Fatalf("within the extended ttl: %d allowed by %v, want the refill (capped at 5) by the assignment", n, src)
	}
	// Another strategy replaces it with a fresh bucket.
	f.applyAction(clk.now, action(qid, tokenBucketAction(4, 1, time.Second)))
	if n, _ := allowed(f, q, 10); n != 4 {
		t.Fatalf("a replacing assignment of 4: %d allowed", n)
	}
	// Expiry: the expired behaviour (DENY_ALL) for its timeout (2 s), then abandoned.
	clk.now += time.Second
	if n, src := allowed(f, q, 3); n != 0 || src != Expired {
		t.Fatalf("after expiry: %d allowed by %v, want DENY_ALL of expired_assignment_behavior", n, src)
	}
	clk.now += 2 * time.Second
	if d := f.Decide(q); d.Source != NoAssigned {
		t.Fatalf("after the expired behaviour's timeout: %v, want the bucket abandoned and subscribed again", d.Source)
	}
	// A ttl of 0 expires at once.
	f.applyAction(clk.now, action(qid, tokenBucketAction(4, 1, 0)))
	if d := f.Decide(q); d.Source != Expired {
		t.Fatalf("a ttl of 0: %v, want expired at once", d.Source)
	}
	// An abandon action forgets the bucket.
	f.applyAction(clk.now, &rlqsv3.RateLimitQuotaResponse_BucketAction{BucketId: &rlqsv3.BucketId{Bucket: qid},
		BucketAction: &rlqsv3.RateLimitQuotaResponse_BucketAction_AbandonAction_{AbandonAction: &rlqsv3.RateLimitQuotaResponse_BucketAction_AbandonAction{}}})
	if f.Buckets() != 1 { // the emergency route's bucket stays
		t.Fatalf("%d buckets after the abandon, want 1", f.Buckets())
	}
	if d := f.Decide(q); d.Source != NoAssigned || f.Buckets() != 2 {
		t.Fatalf("after the abandon: %v with %d buckets, want a new subscription", d.Source, f.Buckets())
	}
	if st := f.Stats(); st.DroppedReports == 0 {
		t.Errorf("no connection, yet no report dropped: %+v", st)
	}
}
