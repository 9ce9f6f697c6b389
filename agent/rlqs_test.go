package agent_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	rlqsv3 "github.com/envoyproxy/go-control-plane/envoy/service/rate_limit_quota/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/internal/testkit/envoyquota"
)

// quotaPolicy is the policy of the quota tests. Every rule has C = 200, r = 20/s, so leases live
// τ = 2.5 s and a fresh one backs one-second assignments; closed fails closed, emergency falls
// back to 2/s with a burst of 4.
const quotaPolicy = `
version: "rlqs-1"
rules:
  - name: quota
    routes: ["/q/{id}"]
    operations: [read]
    limit: 20/second
    burst: 200
  - name: other
    routes: ["/o/{id}"]
    operations: [read]
    limit: 20/second
    burst: 200
  - name: closed
    routes: ["/w/{id}"]
    operations: [read]
    limit: 20/second
    burst: 200
    on_failure: deny
  - name: emergency
    routes: ["/r/{id}"]
    operations: [read]
    limit: 20/second
    burst: 200
    on_failure: emergency
    emergency: {limit: 2/second, burst: 4}
  - name: direct
    routes: ["/d/{id}"]
    operations: [read]
    limit: 20/second
    burst: 200
    lease: off
  - name: shadow
    routes: ["/s/{id}"]
    operations: [read]
    limit: 20/second
    burst: 200
    shadow: true
default:
  limit: 60/minute
  burst: 10
`

// The quota rules' limits, for the bounds.
const (
	quotaC    = 200.0
	quotaRate = 20.0
)

var quotaTau = lease.TTL(func() bucket.Limit {
	l, _ := bucket.NewLimit(200*bucket.PerToken, 20*bucket.PerToken, 1000)
	return l
}())

// quotaRoutes are the filter's bucket matchers for quotaPolicy's rules, each with its failure mode.
var quotaRoutes = []envoyquota.Route{
	{Prefix: "/q/", Template: "/q/{id}"},
	{Prefix: "/o/", Template: "/o/{id}"},
	{Prefix: "/w/", Template: "/w/{id}"},
	{Prefix: "/r/", Template: "/r/{id}", Emergency: &envoyquota.Emergency{Burst: 4, PerSecond: 2}},
	{Prefix: "/d/", Template: "/d/{id}"},
	{Prefix: "/s/", Template: "/s/{id}"},
}

// quotaFilter is an Envoy-faithful rate_limit_quota filter on conn, reporting every 200 ms.
func quotaFilter(t testing.TB, conn grpc.ClientConnInterface, opts envoyquota.Options) *envoyquota.Filter {
	t.Helper()
	cfg, err := envoyquota.ParseConfig(envoyquota.FilterYAML("leasebucket", 200*time.Millisecond, time.Minute, quotaRoutes...))
	if err != nil {
		t.Fatal(err)
	}
	f, err := envoyquota.New(cfg, conn, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	return f
}

// runStoreClock makes the stack's store clock follow real time until the test ends, so buckets
// refill at their rate.
func (s *stack) runStoreClock(t testing.TB) {
	t.Helper()
	start, base := time.Now(), s.storeMs.Load()
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
				s.storeMs.Store(base + time.Since(start).Milliseconds())
			}
		}
	})
	t.Cleanup(func() { close(done); wg.Wait() })
}

// hammer sends requests through f from workers goroutines, each as fast as every pause, for d,
// and returns every decision.
func hammer(f *envoyquota.Filter, d time.Duration, workers int, pause time.Duration, req func(i int) envoyquota.Request) []envoyquota.Decision {
	var mu sync.Mutex
	var all []envoyquota.Decision
	var wg sync.WaitGroup
	end := time.Now().Add(d)
	for w := range workers {
		wg.Go(func() {
			var mine []envoyquota.Decision
			for i := 0; time.Now().Before(end); i++ {
				mine = append(mine, f.Decide(req(w*1_000_000+i)))
				time.Sleep(pause)
			}
			mu.Lock()
			all = append(all, mine...)
			mu.Unlock()
		})
	}
	wg.Wait()
	return all
}

// admitted are the times of the decisions an assignment allowed (not a fallback's), per bucket.
func admitted(ds []envoyquota.Decision) map[string][]time.Duration {
	out := map[string][]time.Duration{}
	for _, d := range ds {
		if d.Allowed && d.Source == envoyquota.Assignment {
			out[d.Bucket] = append(out[d.Bucket], d.At)
		}
	}
	return out
}

// checkWindows checks allowed ≤ capacity + rate·(w + extra) in every window of the admission
// times, and returns the fullest window for the log.
func checkWindows(t testing.TB, what string, times []time.Duration, capacity, rate float64, extra time.Duration) string {
	t.Helper()
	times = append([]time.Duration(nil), times...)
	slices.Sort(times)
	best, tightest := -1e18, ""
	for i := range times {
		for k := i; k < len(times); k++ {
			w := times[k] - times[i]
			n := float64(k - i + 1)
			bound := capacity + rate*(w+extra).Seconds()
			if n > bound {
				t.Fatalf("%s: %v admitted within %v (from %v): bound C + r·(w + τ) = %.1f", what, n, w, times[i], bound)
			}
			if n-bound > best {
				best, tightest = n-bound, fmt.Sprintf("%v admitted within %v, bound %.1f", n, w, bound)
			}
		}
	}
	return tightest
}

// TestQuotaWithinTheLeases: an Envoy-faithful filter far above the limit on one bucket, the global
// bucket refilling in real time: what the filter admits from its assignments keeps the admission
// bound C + r·(w + τ) in every window, every assignment is a token bucket of whole seconds, and
// another key's bucket is untouched.
func TestQuotaWithinTheLeases(t *testing.T) {
	s := newStack(t, parsePolicy(t, quotaPolicy), stackOptions{})
	s.runStoreClock(t)
	_, conn, _, _ := s.serve(t)
	var mu sync.Mutex
	var actions []*rlqsv3.RateLimitQuotaResponse_BucketAction
	f := quotaFilter(t, conn, envoyquota.Options{OnAction: func(_ string, a *rlqsv3.RateLimitQuotaResponse_BucketAction) {
		mu.Lock()
		actions = append(actions, a)
		mu.Unlock()
	}})
	ds := hammer(f, 4*time.Second, 4, 200*time.Microsecond, func(int) envoyquota.Request { return envoyquota.HTTP("acme", "GET", "/q/1") })
	adm := admitted(ds)["method=\"GET\",path=\"/q/{id}\",tenant=\"acme\""]
	t.Logf("%d requests, %d admitted by assignments; filter %+v", len(ds), len(adm), f.Stats())
	if len(adm) < int(quotaC) || len(ds) < 10*len(adm) {
		t.Fatalf("%d admitted of %d: want the burst and more, far below the offered load", len(adm), len(ds))
	}
	t.Logf("fullest window: %s", checkWindows(t, "quota", adm, quotaC, quotaRate, quotaTau))
	mu.Lock()
	for _, a := range actions {
		qa := a.GetQuotaAssignmentAction()
		tb := qa.GetRateLimitStrategy().GetTokenBucket()
		if tb == nil {
			continue
		}
		ttl := qa.GetAssignmentTimeToLive().AsDuration()
		if ttl < time.Second || ttl%time.Second != 0 || ttl > quotaTau || tb.FillInterval.AsDuration() != time.Second || tb.MaxTokens < 1 {
			t.Errorf("assignment %v: want a ttl of whole seconds within τ = %v, a fill interval of one second", qa, quotaTau)
		}
	}
	mu.Unlock()
	if got := s.level(t, "/o/1", "GET", "acme"); got != 200*bucket.PerToken {
		t.Errorf("another key's bucket holds %v µ, want it full", got)
	}
}

// TestQuotaRefusedKey: once the global bucket is empty (its clock stands still), the bucket gets
// DENY_ALL and the filter denies every request by its assignment; when the bucket has refilled, a
// token bucket comes back. Nothing was admitted beyond the bucket's 200 tokens.
func TestQuotaRefusedKey(t *testing.T) {
	s := newStack(t, parsePolicy(t, quotaPolicy), stackOptions{})
	_, conn, _, _ := s.serve(t)
	f := quotaFilter(t, conn, envoyquota.Options{})
	sig := "method=\"GET\",path=\"/q/{id}\",tenant=\"acme\""
	var total int
	eventually(t, 20*time.Second, "DENY_ALL assigned", func() bool {
		ds := hammer(f, 100*time.Millisecond, 2, 100*time.Microsecond, func(int) envoyquota.Request { return envoyquota.HTTP("acme", "GET", "/q/1") })
		total += len(admitted(ds)[sig])
		return f.Stats().Actions["deny_all"] > 0
	})
	if total > int(quotaC) {
		t.Fatalf("%d admitted from a bucket of %v that never refilled", total, quotaC)
	}
	if d := f.Decide(envoyquota.HTTP("acme", "GET", "/q/1")); d.Allowed || d.Source != envoyquota.Assignment {
		t.Fatalf("while refused: %+v, want denied by the assignment", d)
	}
	s.storeMs.Add(20_000) // the bucket refills
	eventually(t, 10*time.Second, "a token bucket after the refill", func() bool {
		return f.Decide(envoyquota.HTTP("acme", "GET", "/q/1")).Allowed
	})
}

// TestQuotaFailureModes: no assignment yet, the filter applies each route's no_assignment_behavior
// (the fail-closed route denies, the emergency route allows from its emergency bucket); with
// assignments it allows; with the coordinators unreachable, assignments run out within the leases,
// then the fail-closed route denies and the emergency route is served by Envoy's emergency bucket
// only; the coordinators back, assignments resume.
func TestQuotaFailureModes(t *testing.T) {
	s := newStack(t, parsePolicy(t, quotaPolicy), stackOptions{})
	s.runStoreClock(t)
	_, conn, _, _ := s.serve(t)
	f := quotaFilter(t, conn, envoyquota.Options{})
	closed, emerg := envoyquota.HTTP("acme", "GET", "/w/1"), envoyquota.HTTP("acme", "GET", "/r/1")
	if d := f.Decide(closed); d.Allowed || d.Source != envoyquota.NoAssigned {
		t.Errorf("fail-closed route, first request: %+v, want denied by no_assignment_behavior", d)
	}
	if d := f.Decide(emerg); !d.Allowed || d.Source != envoyquota.NoAssigned {
		t.Errorf("emergency route, first request: %+v, want allowed by its emergency bucket", d)
	}
	for _, r := range []envoyquota.Request{closed, emerg} {
		eventually(t, 5*time.Second, "an assignment allows", func() bool {
			d := f.Decide(r)
			return d.Allowed && d.Source == envoyquota.Assignment
		})
	}
	s.coord.setFault(unreachable)
	ds := hammer(f, quotaTau+2*time.Second, 2, 2*time.Millisecond, func(i int) envoyquota.Request {
		if i%2 == 0 {
			return closed
		}
		return emerg
	})
	var expiredAllowed []time.Duration
	cutoff := time.Duration(0)
	for _, d := range ds {
		cutoff = max(cutoff, d.At)
	}
	cutoff -= 2 * time.Second // the last two seconds: every lease from before the outage has expired
	for _, d := range ds {
		if d.At < cutoff {
			continue
		}
		switch {
		case d.Allowed && d.Source == envoyquota.Assignment:
			t.Fatalf("allowed by an assignment %v after every lease expired: %+v", d.At-cutoff, d)
		case d.Allowed && d.Bucket != "" && strings.Contains(d.Bucket, "/w/"):
			t.Fatalf("the fail-closed route allowed during the outage: %+v", d)
		case d.Allowed:
			expiredAllowed = append(expiredAllowed, d.At)
		}
	}
	// Envoy's emergency bucket: 4 at once, 2 a second.
	if len(expiredAllowed) == 0 {
		t.Fatal("the emergency route allowed nothing during the outage: want Envoy's emergency bucket")
	}
	checkWindows(t, "emergency", expiredAllowed, 4, 2, 0)
	s.coord.setFault(healthy)
	for _, r := range []envoyquota.Request{closed, emerg} {
		eventually(t, 10*time.Second, "assignments resume", func() bool {
			d := f.Decide(r)
			return d.Allowed && d.Source == envoyquota.Assignment
		})
	}
}

// TestQuotaAbandonAndClose: a bucket idle for the agent's idle time is abandoned, and what its
// assignments did not admit goes back (the reports say nothing was used); a stream that ends
// mid-assignment settles its buckets the same way. Nothing stays reserved.
func TestQuotaAbandonAndClose(t *testing.T) {
	s := newStack(t, parsePolicy(t, quotaPolicy), stackOptions{quotaIdle: 800 * time.Millisecond})
	_, conn, _, _ := s.serve(t)
	f := quotaFilter(t, conn, envoyquota.Options{})
	req := envoyquota.HTTP("acme", "GET", "/q/1")
	eventually(t, 5*time.Second, "an assignment", func() bool { return f.Decide(req).Source == envoyquota.Assignment })
	eventually(t, 5*time.Second, "the idle bucket abandoned", func() bool { return f.Stats().Actions["abandon"] > 0 })
	values := metricValues(t, s.reg)
	if got := values["leasebucket_agent_quota_reserved_tokens"]; got != 0 {
		t.Errorf("%v tokens still reserved after the abandon", got)
	}
	if got := values["leasebucket_agent_quota_released_tokens_total"]; got <= 0 {
		t.Errorf("released %v tokens of an idle bucket's assignments, want them back", got)
	}
	if f.Buckets() != 0 {
		t.Errorf("the filter holds %d buckets after the abandon", f.Buckets())
	}
	// Subscribed again, then the stream ends mid-assignment.
	eventually(t, 5*time.Second, "an assignment again", func() bool { return f.Decide(req).Source == envoyquota.Assignment })
	f.Close()
	eventually(t, 5*time.Second, "the stream settled", func() bool {
		v := metricValues(t, s.reg)
		return v["leasebucket_agent_quota_streams"] == 0 && v["leasebucket_agent_quota_reserved_tokens"] == 0 &&
			v["leasebucket_agent_quota_buckets"] == 0
	})
}

// quotaStream opens a raw StreamRateLimitQuotas call.
func quotaStream(t testing.TB, conn grpc.ClientConnInterface) grpc.BidiStreamingClient[rlqsv3.RateLimitQuotaUsageReports, rlqsv3.RateLimitQuotaResponse] {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	st, err := rlqsv3.NewRateLimitQuotaServiceClient(conn).StreamRateLimitQuotas(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func usage(id map[string]string, allowed, denied uint64) *rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage {
	return &rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage{BucketId: &rlqsv3.BucketId{Bucket: id},
		TimeElapsed: durationpb.New(time.Second), NumRequestsAllowed: allowed, NumRequestsDenied: denied}
}

func bucketID(tenant, path, method string) map[string]string {
	return map[string]string{"tenant": tenant, "path": path, "method": method}
}

// TestQuotaBadInput: malformed messages end the stream with INVALID_ARGUMENT (RESOURCE_EXHAUSTED
// for too many buckets) and a message saying what is wrong, and nothing of them is charged; a
// bucket that maps to no key gets DENY_ALL while the message's other buckets are served; absurd
// counts and reports for buckets never seen before do no harm. No other key's bucket moves.
func TestQuotaBadInput(t *testing.T) {
	s := newStack(t, parsePolicy(t, quotaPolicy), stackOptions{})
	_, conn, _, _ := s.serve(t)
	valid := usage(bucketID("acme", "/q/{id}", "GET"), 1, 0)
	many := make([]*rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage, agent.MaxQuotaUsages+1)
	for i := range many {
		many[i] = usage(bucketID(fmt.Sprintf("t%d", i), "/q/{id}", "GET"), 1, 0)
	}
	wide := bucketID("acme", "/q/{id}", "GET")
	for i := range 9 {
		wide[fmt.Sprintf("k%d", i)] = "v"
	}
	for _, tc := range []struct {
		name string
		msgs []*rlqsv3.RateLimitQuotaUsageReports
		code codes.Code
		want string
	}{
		{"no domain", []*rlqsv3.RateLimitQuotaUsageReports{{BucketQuotaUsages: []*rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage{valid}}},
			codes.InvalidArgument, "names no domain"},
		{"another domain", []*rlqsv3.RateLimitQuotaUsageReports{{Domain: "other", BucketQuotaUsages: []*rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage{valid}}},
			codes.InvalidArgument, `domain "other" is not served here`},
		{"a second domain", []*rlqsv3.RateLimitQuotaUsageReports{{Domain: "leasebucket"}, {Domain: "x", BucketQuotaUsages: []*rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage{valid}}},
			codes.InvalidArgument, "a stream serves one domain"},
		{"too many usages", []*rlqsv3.RateLimitQuotaUsageReports{{Domain: "leasebucket", BucketQuotaUsages: many}},
			codes.InvalidArgument, "bucket usages in one message"},
		{"an oversized bucket id", []*rlqsv3.RateLimitQuotaUsageReports{{Domain: "leasebucket",
			BucketQuotaUsages: []*rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage{valid, usage(wide, 1, 0)}}},
			codes.InvalidArgument, "bucket_id of more than 8 entries"},
		{"an oversized value", []*rlqsv3.RateLimitQuotaUsageReports{{Domain: "leasebucket",
			BucketQuotaUsages: []*rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage{valid, usage(bucketID(strings.Repeat("x", 3000), "/q/{id}", "GET"), 1, 0)}}},
			codes.InvalidArgument, "3000-byte value"},
		{"no bucket id", []*rlqsv3.RateLimitQuotaUsageReports{{Domain: "leasebucket",
			BucketQuotaUsages: []*rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage{valid, {}}}},
			codes.InvalidArgument, "usage 1 has no bucket_id"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := quotaStream(t, conn)
			for _, m := range tc.msgs {
				if err := st.Send(m); err != nil {
					t.Fatal(err)
				}
			}
			_, err := st.Recv()
			if status.Code(err) != tc.code || !strings.Contains(status.Convert(err).Message(), tc.want) {
				t.Fatalf("stream ended with %v, want %v saying %q", err, tc.code, tc.want)
			}
		})
	}
	if got := s.level(t, "/q/1", "GET", "acme"); got != 200*bucket.PerToken {
		t.Fatalf("refused messages charged the bucket: %v µ left of 200 tokens", got)
	}

	// Buckets that map to no key get DENY_ALL; the valid bucket beside them a token bucket.
	st := quotaStream(t, conn)
	bad := []map[string]string{
		{"tenant": "acme", "path": "/q/{id}", "method": "GET", "env": "prod"}, // an unknown key
		{"path": "/q/{id}", "method": "GET"},                                  // no tenant
		{"tenant": "acme", "method": "GET"},                                   // no path
		bucketID("acme", "/d/{id}", "GET"),                                    // lease: off
		bucketID("bad tenant\x00", "/q/{id}", "GET"),                          // an invalid tenant
	}
	msg := &rlqsv3.RateLimitQuotaUsageReports{Domain: "leasebucket", BucketQuotaUsages: []*rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage{
		usage(bucketID("beta", "/q/{id}", "GET"), ^uint64(0), ^uint64(0)), // absurd counts, never seen before
	}}
	for _, id := range bad {
		msg.BucketQuotaUsages = append(msg.BucketQuotaUsages, usage(id, 1, 0))
	}
	if err := st.Send(msg); err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for len(got) < len(bad)+1 {
		resp, err := st.Recv()
		if err != nil {
			t.Fatalf("after %v: %v", got, err)
		}
		for _, a := range resp.BucketAction {
			rs := a.GetQuotaAssignmentAction().GetRateLimitStrategy()
			kind := rs.GetBlanketRule().String()
			if rs.GetTokenBucket() != nil {
				kind = "token_bucket"
			}
			got[envoyquota.Sig(a.GetBucketId().GetBucket())] = kind
		}
	}
	for _, id := range bad {
		if k := got[envoyquota.Sig(id)]; k != "DENY_ALL" {
			t.Errorf("bucket %v: %s, want DENY_ALL", id, k)
		}
	}
	if k := got[envoyquota.Sig(bucketID("beta", "/q/{id}", "GET"))]; k != "token_bucket" {
		t.Errorf("the valid bucket beside them: %s, want a token bucket", k)
	}
	if n := metricValues(t, s.reg)["leasebucket_agent_quota_invalid_buckets_total"]; n != float64(len(bad)) {
		t.Errorf("invalid buckets counted %v, want %d", n, len(bad))
	}
	if err := st.CloseSend(); err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := st.Recv(); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("the stream ended with %v, want its end", err)
		}
	}
	for _, k := range []struct{ path, tenant string }{{"/q/1", "acme"}, {"/o/1", "acme"}, {"/d/1", "acme"}} {
		if got := s.level(t, k.path, "GET", k.tenant); got != 200*bucket.PerToken {
			t.Errorf("%s %s: %v µ left, want the bucket untouched", k.tenant, k.path, got)
		}
	}
}

// TestQuotaRefreshTogether: forty buckets subscribed a millisecond apart each get a token bucket;
// a report of steady use gets no action in answer; before the first assignments end, every bucket
// gets its next one, and those due within a slot of the stream's grid leave together: a few
// responses, not one a bucket.
func TestQuotaRefreshTogether(t *testing.T) {
	const n = 40
	s := newStack(t, parsePolicy(t, quotaPolicy), stackOptions{})
	s.runStoreClock(t)
	_, conn, _, _ := s.serve(t)
	st := quotaStream(t, conn)
	report := func(allowed uint64) {
		t.Helper()
		m := &rlqsv3.RateLimitQuotaUsageReports{Domain: "leasebucket"}
		for i := range n {
			m.BucketQuotaUsages = append(m.BucketQuotaUsages, usage(bucketID(fmt.Sprintf("t%d", i), "/q/{id}", "GET"), allowed, 0))
		}
		if err := st.Send(m); err != nil {
			t.Fatal(err)
		}
	}
	type response struct {
		at      time.Time
		buckets []string // of its token bucket actions
		ttl     time.Duration
	}
	resps := make(chan response, 4*n)
	go func() {
		for {
			r, err := st.Recv()
			if err != nil {
				close(resps)
				return
			}
			got := response{at: time.Now()}
			for _, a := range r.BucketAction {
				qa := a.GetQuotaAssignmentAction()
				if qa.GetRateLimitStrategy().GetTokenBucket() == nil {
					t.Errorf("action %v, want a token bucket", a)
					continue
				}
				got.buckets = append(got.buckets, envoyquota.Sig(a.GetBucketId().GetBucket()))
				got.ttl = qa.GetAssignmentTimeToLive().AsDuration()
			}
			resps <- got
		}
	}()
	// round collects responses until every bucket had a token bucket; it returns when each got
	// it, the shortest ttl, and how many responses carried them.
	round := func(what string) (at map[string]time.Time, ttl time.Duration, msgs int) {
		t.Helper()
		at = map[string]time.Time{}
		for len(at) < n {
			select {
			case r, ok := <-resps:
				if !ok {
					t.Fatalf("%s: the stream ended", what)
				}
				if msgs == 0 || r.ttl < ttl {
					ttl = r.ttl
				}
				msgs++
				for _, b := range r.buckets {
					if _, ok := at[b]; !ok {
						at[b] = r.at
					}
				}
			case <-time.After(5 * time.Second):
				t.Fatalf("%s: %d of %d buckets got a token bucket", what, len(at), n)
			}
		}
		return at, ttl, msgs
	}
	for i := range n {
		m := &rlqsv3.RateLimitQuotaUsageReports{Domain: "leasebucket", BucketQuotaUsages: []*rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage{
			usage(bucketID(fmt.Sprintf("t%d", i), "/q/{id}", "GET"), 1, 0)}}
		if err := st.Send(m); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Millisecond)
	}
	first, ttl, _ := round("first assignments")
	if ttl < time.Second {
		t.Fatalf("ttl %v, want whole seconds", ttl)
	}
	report(5) // steady use: nothing ran out
	next, _, msgs := round("next assignments")
	for b, at := range next {
		// Sent 200–250 ms before the first one ends; a steady report is not answered.
		if el := at.Sub(first[b]); el < ttl-quotaLead-100*time.Millisecond || el >= ttl {
			t.Errorf("bucket %s: next assignment %v after the first, want it within %v before the first's ttl of %v ends",
				b, el, quotaLead, ttl)
		}
	}
	if msgs > n/5 {
		t.Errorf("the next assignments of %d buckets came in %d responses, want them together", n, msgs)
	}
}

// quotaLead is how long before an assignment ends the agent refreshes it, at most (its refresh
// lead and a slot of its grid).
const quotaLead = 250 * time.Millisecond
