package agent

import (
	"context"
	"fmt"
	"testing"
	"time"

	rlqsv3 "github.com/envoyproxy/go-control-plane/envoy/service/rate_limit_quota/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/checkwire"
	"github.com/leasebucket/leasebucket/internal/clock"
)

// discardQuotaStream is a StreamRateLimitQuotas call of a benchmark (discardStream).
type discardQuotaStream = discardStream[*rlqsv3.RateLimitQuotaUsageReports, *rlqsv3.RateLimitQuotaResponse]

// quotaActions is the bucket actions of m: those of the generated message and those the stream
// encoded itself.
func quotaActions(m *rlqsv3.RateLimitQuotaResponse) int {
	n := len(m.BucketAction)
	_ = checkwire.ForFields(m.ProtoReflect().GetUnknown(), func(num protowire.Number, _ protowire.Type, _ []byte, _ uint64) error {
		if num == responseActionField {
			n++
		}
		return nil
	})
	return n
}

// BenchmarkQuotaStream is the agent's own work for the rate limit quota service, without the
// transport's: one stream of 1,000 buckets (a tenant each, as BenchmarkQuota's tenants-1k case
// has on each Envoy), each offered 10 requests a second and reported once a second, on leases of
// τ = 2.5 s. The stream's grid is driven by a manual clock, and each refill is answered at once
// with what the coordinator's grant rule gives. An op is one second of the stream: a report of
// every bucket decoded and handled, and the assignments that second brings, encoded; ns/bucket-s
// is the agent's CPU per bucket and second.
func BenchmarkQuotaStream(b *testing.B) {
	const (
		buckets = 1000
		rate    = 10
	)
	set := parseSet(b, `version: v1
envoy:
  domain: bench
rules:
  - name: items
    routes: ["/v1/items/{id}"]
    operations: [read]
    limit: 1000000/second
    burst: 10000000
default:
  limit: 10/second
  burst: 10
`)
	limit, cost := routeBucket(b, set, "/v1/items/x", "read", "t") // the rule's buckets, which every refill names
	clk := clock.NewManual(clock.Of(time.Hour))
	lim := New(Config{}, set)
	s := NewServer(ServerConfig{Limiter: lim, Clock: clk})
	items := 0 // bucket actions sent
	ds := &discardQuotaStream{ctx: context.Background(), onSend: func(m *rlqsv3.RateLimitQuotaResponse) { items += quotaActions(m) }}
	st := &quotaStream{qs: s.quota, s: s, stream: ds, ctx: ds.ctx, buckets: map[string]*quotaBucket{},
		ready: make(chan *quotaBucket, buckets), done: make(chan struct{})}
	defer st.close()

	report := &rlqsv3.RateLimitQuotaUsageReports{Domain: "bench"}
	for i := range buckets {
		report.BucketQuotaUsages = append(report.BucketQuotaUsages, &rlqsv3.RateLimitQuotaUsageReports_BucketQuotaUsage{
			BucketId:           &rlqsv3.BucketId{Bucket: map[string]string{"tenant": fmt.Sprintf("tenant-%04d", i), "path": "/v1/items/{id}", "method": "GET"}},
			NumRequestsAllowed: rate,
		})
	}
	wire, err := proto.Marshal(report)
	if err != nil {
		b.Fatal(err)
	}
	// second runs one second of the stream: the report at its start, then the grid's slots, each
	// with its refills answered at once.
	second := func() {
		m := &emptypb.Empty{} // as the stream receives a report
		if err := proto.Unmarshal(wire, m); err != nil {
			b.Fatal(err)
		}
		if err := st.onReports(m); err != nil {
			b.Fatal(err)
		}
		for range time.Second / quotaSlot {
			now := clk.Now()
			answerRefills(b, lim, now, limit, cost)
			st.drainReady()
			st.onDue()
			if err := st.flush(); err != nil {
				b.Fatal(err)
			}
			clk.Set(now + clock.Of(quotaSlot))
		}
	}
	for range 10 { // the first assignments, sized from one request, then from reports
		second()
		time.Sleep(time.Millisecond) // the first refills' waiters hand their buckets over
	}
	sent, items0 := ds.sent, items
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		second()
	}
	b.StopTimer()
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/buckets, "ns/bucket-s")
	b.ReportMetric(float64(items-items0)/float64(b.N)/buckets, "assignments/bucket-s")
	b.ReportMetric(float64(ds.sent-sent)/float64(b.N), "responses/s")
}

// answerRefills answers every call the Limiter has due at now as a coordinator with a bucket of
// lim that never runs low would (answerSized, the want).
func answerRefills(tb testing.TB, l *Limiter, now clock.Nanos, lim bucket.Limit, cost bucket.Micro) {
	for c := l.NextCall(now); c != nil; c = l.NextCall(now) {
		answerSized(tb, l, now, lim, cost, c, false)
	}
}
