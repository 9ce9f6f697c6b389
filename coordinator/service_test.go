package coordinator_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/coordinator/storetest"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/policy"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// TestAcquireItems checks how each kind of item is answered, in one batch, and that only the
// items granted were charged.
func TestAcquireItems(t *testing.T) {
	set := mustPolicy(t, "v1")
	store := memstore.New()
	levels := storetest.NewLevels(store)
	svc := coordinator.NewService(levels, set)
	hot := ref("hot", "acme")
	eu := &coordinatorv1.BucketRef{Rule: "search", Route: "/search", Operation: "read", Tenant: "acme", Region: "eu-west"}
	global := ref("hot", "beta")
	globalAgain := proto.Clone(global).(*coordinatorv1.BucketRef)
	globalAgain.Region = "eu-west" // ignored by a global rule: the same bucket as global
	items := []*coordinatorv1.AcquireItem{
		0:  item(hot, 5*tok, tok),
		1:  item(ref("nope", "acme"), tok, tok),                                                                                           // no such rule
		2:  item(&coordinatorv1.BucketRef{Rule: "search", Route: "/search", Operation: "read", Tenant: "acme", Region: "mars"}, tok, tok), // no such region
		3:  item(ref("hot", "acme"), tok, 0),                                                                                              // min 0
		4:  item(ref("hot", "bad tenant\n"), tok, tok),                                                                                    // invalid tenant
		5:  item(hot, tok, tok),                                                                                                           // the same key again
		6:  item(ref("hot", "zeta"), 60*tok, 51*tok),                                                                                      // cost above capacity 50
		7:  item(eu, 2*tok, tok),
		8:  {Bucket: nil, NeededMicro: 1, MinMicro: 1},
		9:  item(global, tok, tok),
		10: item(globalAgain, tok, tok),
	}
	resp, err := svc.Acquire(ctxFor(t, 10*time.Second), acquire("agent-1", 1, "v1", items...))
	if err != nil {
		t.Fatal(err)
	}
	S := coordinatorv1.Status_STATUS_OK
	want := []coordinatorv1.Status{
		S, coordinatorv1.Status_STATUS_UNKNOWN_ROUTE, coordinatorv1.Status_STATUS_UNKNOWN_ROUTE,
		coordinatorv1.Status_STATUS_INVALID, coordinatorv1.Status_STATUS_INVALID, coordinatorv1.Status_STATUS_INVALID,
		coordinatorv1.Status_STATUS_DENIED, S, coordinatorv1.Status_STATUS_INVALID, S, coordinatorv1.Status_STATUS_INVALID,
	}
	if len(resp.Results) != len(want) {
		t.Fatalf("%d results, want %d", len(resp.Results), len(want))
	}
	for i, w := range want {
		if got := resp.Results[i].Status; got != w {
			t.Errorf("item %d: status %v, want %v", i, got, w)
		}
	}
	if r := resp.Results[6]; r.RetryAfterMs != int64(bucket.Never) || r.GrantedMicro != 0 {
		t.Errorf("cost above capacity: %v, want denied with retry_after_ms -1", r)
	}
	// The hot key's lease: share 500‰ of a full 50-token bucket allows the 5 tokens asked (a first
	// lease without demand may be up to C/8 = 6.25 tokens), for τ = C/(4r) = 62 ms → 200 ms floor.
	if r := resp.Results[0]; r.GrantedMicro != int64(5*tok) || r.TtlMs != lease.MinTTL.Milliseconds() || r.RemainingMicro != int64(45*tok) || r.Replayed {
		t.Errorf("hot grant = %v, want 5 tokens for 200 ms with 45 tokens left", r)
	}
	// Charged: only the granted items. zeta (denied) and the rejected items left no state.
	for _, c := range []struct {
		ref  *coordinatorv1.BucketRef
		left bucket.Micro
	}{{hot, 45 * tok}, {eu, 16 * tok}, {global, 49 * tok}} {
		if lvl, ok := levels.Level(key(t, set, c.ref)); !ok || lvl != c.left {
			t.Errorf("bucket %v: %d µ (charged %v), want %d µ", c.ref, lvl, ok, c.left)
		}
	}
	if n := store.Len(); n != 3 {
		t.Errorf("store holds %d keys, want 3 (nothing for rejected or denied items)", n)
	}
}

func TestReturnItems(t *testing.T) {
	set := mustPolicy(t, "v1")
	store := memstore.New()
	levels := storetest.NewLevels(store)
	svc := coordinator.NewService(levels, set)
	hot := ref("hot", "acme")
	got, err := svc.Acquire(ctxFor(t, 10*time.Second), acquire("agent-1", 1, "v1", item(hot, 5*tok, tok)))
	if err != nil {
		t.Fatal(err)
	}
	at := got.Results[0].GrantedAtMs
	resp, err := svc.Return(ctxFor(t, 10*time.Second), &coordinatorv1.ReturnRequest{AgentId: "agent-1", Seq: 2, PolicyVersion: "v1",
		Items: []*coordinatorv1.ReturnItem{
			{Bucket: hot, UnspentMicro: int64(5 * tok), GrantedAtMs: at},
			{Bucket: hot, UnspentMicro: int64(5 * tok), GrantedAtMs: at}, // the same key again
			{Bucket: ref("hot", "b"), UnspentMicro: -1, GrantedAtMs: at},
			{Bucket: ref("hot", "c"), UnspentMicro: 1 << 60, GrantedAtMs: at}, // beyond 2^52: malformed, not a store failure
			{Bucket: ref("hot", "d"), UnspentMicro: 1, GrantedAtMs: -1},
			{Bucket: ref("nope", "e"), UnspentMicro: 1, GrantedAtMs: at},
		}})
	if err != nil {
		t.Fatal(err)
	}
	want := []coordinatorv1.Status{coordinatorv1.Status_STATUS_OK, coordinatorv1.Status_STATUS_INVALID,
		coordinatorv1.Status_STATUS_INVALID, coordinatorv1.Status_STATUS_INVALID, coordinatorv1.Status_STATUS_INVALID,
		coordinatorv1.Status_STATUS_UNKNOWN_ROUTE}
	for i, w := range want {
		if got := resp.Results[i].Status; got != w {
			t.Errorf("item %d: status %v, want %v", i, got, w)
		}
	}
	// Credited at most what the bucket lacks: the 5 tokens less the refill since the grant.
	lvl, _ := levels.Level(key(t, set, hot))
	if c := resp.Results[0].CreditedMicro; c < 0 || c > int64(5*tok) || lvl > 50*tok {
		t.Errorf("credited %d µ, bucket %d µ: want at most 5 tokens and a bucket within capacity", c, lvl)
	}
	if n := store.Len(); n != 1 {
		t.Errorf("store holds %d keys, want 1", n)
	}
}

func TestCallValidation(t *testing.T) {
	svc := coordinator.NewService(memstore.New(), mustPolicy(t, "v1"))
	many := make([]*coordinatorv1.AcquireItem, coordinator.MaxItems+1)
	for i := range many {
		many[i] = item(ref("hot", "acme"), tok, tok)
	}
	for _, tc := range []struct {
		name string
		req  *coordinatorv1.AcquireRequest
		code codes.Code
	}{
		{"no agent", acquire("", 1, "v1"), codes.InvalidArgument},
		{"agent too long", acquire(strings.Repeat("a", coordinator.MaxAgentID+1), 1, "v1"), codes.InvalidArgument},
		{"seq 0", acquire("a", 0, "v1"), codes.InvalidArgument},
		{"seq beyond 2^53", acquire("a", 1<<53, "v1"), codes.InvalidArgument},
		{"too many items", acquire("a", 1, "v1", many...), codes.InvalidArgument},
		{"unknown version", acquire("a", 1, "v0"), codes.FailedPrecondition},
		{"version too long", acquire("a", 1, strings.Repeat("v", policy.MaxVersionLen+1)), codes.InvalidArgument},
		{"empty", acquire("a", 1, "v1"), codes.OK},
	} {
		_, err := svc.Acquire(ctxFor(t, 10*time.Second), tc.req)
		if got := status.Code(err); got != tc.code {
			t.Errorf("%s: Acquire error %v, want %v", tc.name, err, tc.code)
		}
		_, err = svc.Return(ctxFor(t, 10*time.Second), &coordinatorv1.ReturnRequest{AgentId: tc.req.AgentId, Seq: tc.req.Seq,
			PolicyVersion: tc.req.PolicyVersion, Items: make([]*coordinatorv1.ReturnItem, len(tc.req.Items))})
		if got := status.Code(err); got != tc.code {
			t.Errorf("%s: Return error %v, want %v", tc.name, err, tc.code)
		}
	}
}

// TestPolicyVersions: a reload keeps the previous versions known (KeepVersions in all), so
// agents that have not reloaded yet keep working; older ones are rejected with the distinct
// error that makes an agent reload.
func TestPolicyVersions(t *testing.T) {
	svc := coordinator.NewService(memstore.New(), mustPolicy(t, "v1"))
	known := func(v string) bool {
		_, err := svc.Acquire(ctxFor(t, 10*time.Second), acquire("a", 1, v))
		switch {
		case err == nil:
			return true
		case status.Code(err) == codes.FailedPrecondition && coordinatorv1.Reason(err) == coordinatorv1.ReasonUnknownPolicyVersion:
			return false
		}
		t.Fatalf("Acquire under %s: %v", v, err)
		return false
	}
	for i, v := range []string{"v2", "v3", "v4", "v5"} {
		svc.SetPolicy(mustPolicy(t, v))
		if svc.Policy().Version() != v {
			t.Fatalf("Policy().Version() = %s after SetPolicy(%s)", svc.Policy().Version(), v)
		}
		// v1 stays known while it is among the last KeepVersions.
		if got, want := known("v1"), i+2 <= coordinator.KeepVersions; got != want {
			t.Errorf("after loading %s: v1 known = %t, want %t", v, got, want)
		}
		if !known(v) {
			t.Errorf("current version %s unknown", v)
		}
	}
	// Reloading a version already held moves it to the front without forgetting another.
	svc.SetPolicy(mustPolicy(t, "v3"))
	for _, v := range []string{"v2", "v3", "v4", "v5"} {
		if !known(v) {
			t.Errorf("after reloading v3: %s unknown", v)
		}
	}
}

// fakeStore fails or blocks as a test needs.
type fakeStore struct {
	take func(ctx context.Context, reqs []coordinator.TakeRequest) ([]coordinator.TakeResult, error)
	ret  func(ctx context.Context, reqs []coordinator.ReturnRequest) ([]coordinator.ReturnResult, error)
}

func (f *fakeStore) Take(ctx context.Context, reqs []coordinator.TakeRequest) ([]coordinator.TakeResult, error) {
	return f.take(ctx, reqs)
}

func (f *fakeStore) Return(ctx context.Context, reqs []coordinator.ReturnRequest) ([]coordinator.ReturnResult, error) {
	return f.ret(ctx, reqs)
}

// secret is what a store error says that a client must never see.
const secret = "dial tcp 10.1.2.3:6379: connection refused"

func TestStoreFailures(t *testing.T) {
	set := mustPolicy(t, "v1")
	items := []*coordinatorv1.AcquireItem{item(ref("hot", "a"), tok, tok), item(ref("hot", "b"), tok, tok)}
	rets := []*coordinatorv1.ReturnItem{{Bucket: ref("hot", "a"), UnspentMicro: 1}, {Bucket: ref("hot", "b"), UnspentMicro: 1}}
	whole := errors.New("redisstore: take: " + secret)
	for _, tc := range []struct {
		name    string
		store   *fakeStore
		timeout time.Duration // the store timeout
		cancel  bool          // the caller gives up
		code    codes.Code
		reason  string
		items   []coordinatorv1.Status // when the call succeeds
	}{{
		name: "whole batch",
		store: &fakeStore{
			take: func(context.Context, []coordinator.TakeRequest) ([]coordinator.TakeResult, error) { return nil, whole },
			ret: func(context.Context, []coordinator.ReturnRequest) ([]coordinator.ReturnResult, error) {
				return nil, whole
			},
		},
		code: codes.Unavailable, reason: coordinatorv1.ReasonStoreUnavailable,
	}, {
		name: "one key",
		store: &fakeStore{
			take: func(_ context.Context, reqs []coordinator.TakeRequest) ([]coordinator.TakeResult, error) {
				return []coordinator.TakeResult{{Result: bucket.Result{Granted: tok}}, {Err: errors.New(secret)}}, nil
			},
			ret: func(_ context.Context, reqs []coordinator.ReturnRequest) ([]coordinator.ReturnResult, error) {
				return []coordinator.ReturnResult{{Result: bucket.Result{Granted: 1}}, {Err: errors.New(secret)}}, nil
			},
		},
		items: []coordinatorv1.Status{coordinatorv1.Status_STATUS_OK, coordinatorv1.Status_STATUS_STORE_UNAVAILABLE},
	}, {
		name: "short answer",
		store: &fakeStore{
			take: func(context.Context, []coordinator.TakeRequest) ([]coordinator.TakeResult, error) {
				return []coordinator.TakeResult{{}}, nil
			},
			ret: func(context.Context, []coordinator.ReturnRequest) ([]coordinator.ReturnResult, error) {
				return nil, nil
			},
		},
		code: codes.Unavailable, reason: coordinatorv1.ReasonStoreUnavailable,
	}, {
		name:    "store timeout",
		store:   &fakeStore{take: blockTake, ret: blockReturn},
		timeout: 20 * time.Millisecond,
		code:    codes.Unavailable, reason: coordinatorv1.ReasonStoreUnavailable,
	}, {
		name:   "caller cancels",
		store:  &fakeStore{take: blockTake, ret: blockReturn},
		cancel: true,
		code:   codes.Canceled,
	}} {
		t.Run(tc.name, func(t *testing.T) {
			svc := coordinator.NewService(tc.store, set, coordinator.WithStoreTimeout(tc.timeout), coordinator.WithLogger(zaptest.NewLogger(t)))
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if tc.cancel {
				time.AfterFunc(20*time.Millisecond, cancel)
			}
			check := func(op string, err error, statuses []coordinatorv1.Status) {
				t.Helper()
				if status.Code(err) != tc.code || coordinatorv1.Reason(err) != tc.reason {
					t.Fatalf("%s: error %v (reason %q), want %v with reason %q", op, err, coordinatorv1.Reason(err), tc.code, tc.reason)
				}
				if err != nil {
					if strings.Contains(err.Error(), "10.1.2.3") {
						t.Errorf("%s: the client sees the store's address: %v", op, err)
					}
					if tc.reason != "" && coordinator.StoreCause(err) == nil {
						t.Errorf("%s: StoreCause(%v) = nil, want the store's error for the log", op, err)
					}
					return
				}
				for i, w := range tc.items {
					if statuses[i] != w {
						t.Errorf("%s: item %d status %v, want %v", op, i, statuses[i], w)
					}
				}
			}
			a, err := svc.Acquire(ctx, acquire("a", 1, "v1", items...))
			var as []coordinatorv1.Status
			for _, r := range a.GetResults() {
				as = append(as, r.Status)
			}
			check("Acquire", err, as)
			r, err := svc.Return(ctx, &coordinatorv1.ReturnRequest{AgentId: "a", Seq: 2, PolicyVersion: "v1", Items: rets})
			var rs []coordinatorv1.Status
			for _, x := range r.GetResults() {
				rs = append(rs, x.Status)
			}
			check("Return", err, rs)
		})
	}
}

func blockTake(ctx context.Context, _ []coordinator.TakeRequest) ([]coordinator.TakeResult, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

func blockReturn(ctx context.Context, _ []coordinator.ReturnRequest) ([]coordinator.ReturnResult, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

func TestMetrics(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	m, err := coordinator.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	var fail atomic.Bool
	mem := memstore.New()
	store := &fakeStore{
		take: func(ctx context.Context, reqs []coordinator.TakeRequest) ([]coordinator.TakeResult, error) {
			if fail.Load() {
				return nil, errors.New(secret)
			}
			return mem.Take(ctx, reqs)
		},
		ret: mem.Return,
	}
	svc := coordinator.NewService(store, mustPolicy(t, "v1"), coordinator.WithMetrics(m))
	ctx := ctxFor(t, 10*time.Second)
	req := acquire("a", 1, "v1", item(ref("hot", "a"), 5*tok, tok), item(ref("hot", "b"), 3*tok, tok), item(ref("nope", "c"), tok, tok))
	first, err := svc.Acquire(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := svc.Acquire(ctx, req); err != nil { // a retry: replayed, not granted again
		t.Fatal(err)
	}
	if _, err := svc.Return(ctx, &coordinatorv1.ReturnRequest{AgentId: "a", Seq: 2, PolicyVersion: "v1", Items: []*coordinatorv1.ReturnItem{
		{Bucket: ref("hot", "a"), UnspentMicro: int64(5 * tok), GrantedAtMs: first.Results[0].GrantedAtMs},
	}}); err != nil {
		t.Fatal(err)
	}
	fail.Store(true)
	if _, err := svc.Acquire(ctx, acquire("a", 3, "v1", item(ref("hot", "a"), tok, tok))); status.Code(err) != codes.Unavailable {
		t.Fatalf("Acquire with a failing store: %v", err)
	}
	m.SetStoreUp(true)

	for name, want := range map[string]float64{
		"leasebucket_coordinator_grants_total":                                                                  2,
		"leasebucket_coordinator_granted_tokens_total":                                                          8,
		"leasebucket_coordinator_returns_total":                                                                 1,
		"leasebucket_coordinator_store_up":                                                                      1,
		`leasebucket_coordinator_items_total{method="acquire",status="ok"}`:                                     4,
		`leasebucket_coordinator_items_total{method="acquire",status="unknown_route"}`:                          2,
		`leasebucket_coordinator_items_total{method="return",status="ok"}`:                                      1,
		`leasebucket_coordinator_replays_total{method="acquire"}`:                                               2,
		`leasebucket_coordinator_store_errors_total{method="acquire",scope="batch"}`:                            1,
		`leasebucket_coordinator_batch_items_count{method="acquire"}`:                                           3,
		`leasebucket_coordinator_store_duration_seconds_count{method="acquire"}`:                                3,
		`leasebucket_coordinator_policy_info{version="v1"}`:                                                     1,
		"leasebucket_coordinator_returned_tokens_total + leasebucket_coordinator_return_forfeited_tokens_total": 5,
	} {
		if got := gather(t, reg, name); got != want {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
}

// gather returns a sample's value: "name" or `name{label="value",...}` (the labels given must
// match), or the sum of such terms joined by " + ".
func gather(t *testing.T, reg prometheus.Gatherer, expr string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var total float64
	for term := range strings.SplitSeq(expr, " + ") {
		name, labels, _ := strings.Cut(strings.TrimSuffix(term, "}"), "{")
		want := map[string]string{}
		for kv := range strings.SplitSeq(labels, ",") {
			if k, v, ok := strings.Cut(kv, "="); ok {
				want[k] = strings.Trim(v, `"`)
			}
		}
		found := false
		for _, f := range families {
			base, suffix := f.GetName(), ""
			if !strings.HasPrefix(name, base) {
				continue
			}
			suffix = strings.TrimPrefix(name, base)
			for _, m := range f.GetMetric() {
				match := true
				for k, v := range want {
					ok := false
					for _, l := range m.GetLabel() {
						ok = ok || (l.GetName() == k && l.GetValue() == v)
					}
					match = match && ok
				}
				if !match {
					continue
				}
				switch suffix {
				case "":
					found = true
					total += m.GetCounter().GetValue() + m.GetGauge().GetValue()
				case "_count":
					found = true
					total += float64(m.GetHistogram().GetSampleCount())
				}
			}
		}
		if !found {
			t.Fatalf("no sample %s", term)
		}
	}
	return total
}

// TestAcquireHandsBack: leases handed back ride in an Acquire, in the same store round trip: a
// key's own lease in its item is credited before its take, other keys' in Returns are credited
// alone; a key named twice in one call, or a return of a key the call refills, is refused; a
// retry of the call (same seq) is answered from the records, charging and crediting nothing.
func TestAcquireHandsBack(t *testing.T) {
	set := mustPolicy(t, "v1")
	store := memstore.New(memstore.WithClock(func() bucket.Millis { return 1_000_000 })) // no refill: exact credits
	svc := coordinator.NewService(store, set)
	a, b := ref("slow", "a"), ref("slow", "b")
	first, err := svc.Acquire(ctxFor(t, 10*time.Second), acquire("agent-1", 1, "v1", item(a, 10*tok, tok), item(b, 10*tok, tok)))
	if err != nil {
		t.Fatal(err)
	}
	at := first.Results[0].GrantedAtMs
	req := acquire("agent-1", 2, "v1", &coordinatorv1.AcquireItem{Bucket: a, NeededMicro: int64(2 * tok), MinMicro: int64(tok),
		ReturnMicro: int64(4 * tok), ReturnGrantedAtMs: at})
	req.Returns = []*coordinatorv1.ReturnItem{
		{Bucket: b, UnspentMicro: int64(6 * tok), GrantedAtMs: at},
		{Bucket: a, UnspentMicro: int64(tok), GrantedAtMs: at}, // a key the call refills
		{Bucket: b, UnspentMicro: int64(tok), GrantedAtMs: at}, // the same key again
		{Bucket: ref("nope", "x"), UnspentMicro: int64(tok), GrantedAtMs: at},
	}
	wantReturns := []coordinatorv1.Status{coordinatorv1.Status_STATUS_OK, coordinatorv1.Status_STATUS_INVALID,
		coordinatorv1.Status_STATUS_INVALID, coordinatorv1.Status_STATUS_UNKNOWN_ROUTE}
	for attempt, replayed := range []bool{false, true} {
		resp, err := svc.Acquire(ctxFor(t, 10*time.Second), req)
		if err != nil {
			t.Fatal(err)
		}
		// 100000 tokens, 10 taken at seq 1, 4 credited back, 2 taken.
		if r := resp.Results[0]; r.Status != coordinatorv1.Status_STATUS_OK || r.GrantedMicro != int64(2*tok) ||
			r.CreditedMicro != int64(4*tok) || r.RemainingMicro != int64(99_992*tok) || r.Replayed != replayed {
			t.Fatalf("attempt %d: a = %v, want 2 tokens granted after 4 credited, 99992 left, replayed %t", attempt, r, replayed)
		}
		if len(resp.Returns) != len(wantReturns) {
			t.Fatalf("attempt %d: %d return results, want %d", attempt, len(resp.Returns), len(wantReturns))
		}
		for i, w := range wantReturns {
			if got := resp.Returns[i].Status; got != w {
				t.Errorf("attempt %d: return %d: status %v, want %v", attempt, i, got, w)
			}
		}
		if r := resp.Returns[0]; r.CreditedMicro != int64(6*tok) || r.Replayed != replayed {
			t.Fatalf("attempt %d: b's return = %v, want 6 tokens credited, replayed %t", attempt, r, replayed)
		}
	}
	// b holds 100000 − 10 + 6: a take of one token leaves 99995.
	resp, err := svc.Acquire(ctxFor(t, 10*time.Second), acquire("agent-1", 3, "v1", item(b, tok, tok)))
	if err != nil {
		t.Fatal(err)
	}
	if r := resp.Results[0]; r.RemainingMicro != int64(99_995*tok) {
		t.Fatalf("b after its return: %v, want 99995 tokens left", r)
	}
}

// TestAcquireAmpleLease: where the bucket keeps three quarters of its capacity, a lease holds the
// agent's demand over its whole lifetime (lease.Ample); once it would not, over half of it. A
// calendar quota's take carries no ample want (the store would refuse it as invalid).
func TestAcquireAmpleLease(t *testing.T) {
	set := mustPolicy(t, "v1")
	store := memstore.New(memstore.WithClock(func() bucket.Millis { return 1_000_000 })) // no refill
	svc := coordinator.NewService(store, set)
	// hot: burst 50 at 200 tokens/s, leases of 200 ms; a demand of 25 tokens/s is 5 tokens over
	// a lifetime, and its spread √5 = 2.24 more.
	ask := func(r *coordinatorv1.BucketRef) *coordinatorv1.AcquireItem {
		it := item(r, tok, tok)
		it.DemandMicroPerSecond = int64(25 * tok)
		return it
	}
	for i, w := range []struct {
		granted, remaining bucket.Micro
	}{
		{9 * tok, 41 * tok}, // the waiting token and 8 of demand and spread: 41 left, above 37.5
		{3 * tok, 38 * tok}, // another 9 would leave 32: the waiting token and 2 of demand
	} {
		resp, err := svc.Acquire(ctxFor(t, 10*time.Second), acquire(fmt.Sprintf("agent-%d", i), 1, "v1", ask(ref("hot", "acme"))))
		if err != nil {
			t.Fatal(err)
		}
		if r := resp.Results[0]; r.Status != coordinatorv1.Status_STATUS_OK || r.GrantedMicro != int64(w.granted) || r.RemainingMicro != int64(w.remaining) {
			t.Errorf("take %d = %v, want %d µ granted, %d µ left", i, r, w.granted, w.remaining)
		}
	}
	svc = coordinator.NewService(memstore.New(), set) // a calendar window needs the wall clock
	resp, err := svc.Acquire(ctxFor(t, 10*time.Second), acquire("agent-1", 2, "v1", ask(ref("monthly", "acme"))))
	if err != nil {
		t.Fatal(err)
	}
	if r := resp.Results[0]; r.Status != coordinatorv1.Status_STATUS_OK || r.GrantedMicro < int64(tok) {
		t.Errorf("calendar take = %v, want a grant", r)
	}
}

// TestAcquireScarceThinKey: the coordinator sizes by what the agent says of the bucket. A thin
// key (under lease.ThinRequests requests of demand a lifetime) whose agent found the bucket scarce
// at its last answer gets what its waiting check needs, even where the bucket is ample now; the
// same refill without the word gets the requests its ample want rounds up besides.
func TestAcquireScarceThinKey(t *testing.T) {
	set := mustPolicy(t, "v1")
	svc := coordinator.NewService(memstore.New(memstore.WithClock(func() bucket.Millis { return 1_000_000 })), set)
	for i, w := range []struct {
		scarce  bool
		granted bucket.Micro
	}{{false, 3 * tok}, {true, tok}} { // 0.4 of a token a lifetime and its spread √0.4, rounded up: 2
		it := item(ref("hot", fmt.Sprintf("tenant-%d", i)), tok, tok)
		it.DemandMicroPerSecond, it.Scarce = int64(2*tok), w.scarce
		resp, err := svc.Acquire(ctxFor(t, 10*time.Second), acquire("agent-1", uint64(i+1), "v1", it))
		if err != nil {
			t.Fatal(err)
		}
		if r := resp.Results[0]; r.Status != coordinatorv1.Status_STATUS_OK || r.GrantedMicro != int64(w.granted) {
			t.Errorf("scarce %t: %v, want %d µ granted", w.scarce, r, w.granted)
		}
	}
}

// TestAcquireRegularKey: a refill of a key its agent calls regular (polled on a fixed period
// longer than its leases live) gets its waiting check alone where the bucket is ample; the same
// refill of a key not called regular gets the requests the ample want rounds up besides.
func TestAcquireRegularKey(t *testing.T) {
	set := mustPolicy(t, "v1")
	svc := coordinator.NewService(memstore.New(memstore.WithClock(func() bucket.Millis { return 1_000_000 })), set)
	// hot: leases of 200 ms; a demand of 2 tokens/s is 0.4 of a token over a lifetime, and its
	// spread √0.4 = 0.63 more: 2 requests rounded up, none rounded down.
	for i, w := range []struct {
		regular bool
		granted bucket.Micro
	}{{false, 3 * tok}, {true, tok}} {
		it := item(ref("hot", fmt.Sprintf("tenant-%d", i)), tok, tok)
		it.DemandMicroPerSecond, it.Regular = int64(2*tok), w.regular
		resp, err := svc.Acquire(ctxFor(t, 10*time.Second), acquire("agent-1", uint64(i+1), "v1", it))
		if err != nil {
			t.Fatal(err)
		}
		if r := resp.Results[0]; r.Status != coordinatorv1.Status_STATUS_OK || r.GrantedMicro != int64(w.granted) {
			t.Errorf("regular %t: %v, want %d µ granted", w.regular, r, w.granted)
		}
	}
}
