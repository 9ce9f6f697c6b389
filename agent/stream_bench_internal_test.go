package agent

import (
	"context"
	"io"
	"testing"
	"time"

	"go.uber.org/zap/zapcore"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/leasebucket/leasebucket/agent/audit"
	"github.com/leasebucket/leasebucket/internal/clock"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

// discardStream is a bidirectional streaming call of a benchmark that hands the agent its
// messages itself: what the agent sends is encoded, as gRPC would, then dropped; onSend, if set,
// sees each message sent.
type discardStream[Req any, Resp proto.Message] struct {
	grpc.ServerStream
	ctx    context.Context
	buf    []byte
	sent   int
	onSend func(Resp)
}

func (d *discardStream[Req, Resp]) Context() context.Context { return d.ctx }
func (d *discardStream[Req, Resp]) Recv() (Req, error) {
	select {} // not called: the benchmark hands the stream its messages
}

func (d *discardStream[Req, Resp]) Send(m Resp) error {
	var err error
	d.buf, err = proto.MarshalOptions{}.MarshalAppend(d.buf[:0], m)
	d.sent++
	if d.onSend != nil {
		d.onSend(m)
	}
	return err
}

// discardCheckStream is a CheckStream call of a benchmark.
type discardCheckStream = discardStream[*agentv1.CheckStreamRequest, *agentv1.CheckStreamResponse]

// BenchmarkStreamMessage is the agent's own work per streamed check on one hot key, without the
// transport's: a message of 17 checks (the hot-key stack benchmark's average) of one tenant,
// received as the stream receives it (all unknown fields), decoded, decided on a live lease,
// counted (metrics), audited (the default sampling), answered and encoded. Refills are answered
// at once between messages. "empty" is the empty handler's work for the same message
// (cmd emptyagent: the generated decoder, an allow per check, the generated encoder), so that
// x-empty, the agent's time over it, is from one run.
func BenchmarkStreamMessage(b *testing.B) {
	const checks = 17
	set := parseSet(b, `version: v1
rules:
  - name: hot
    routes: ["/v1/lease/{id}"]
    operations: [GET]
    limit: 1000000000/second
    burst: 1000000000
default:
  limit: 10/second
`)
	req := &agentv1.CheckStreamRequest{Id: 12345, Partial: true}
	for range checks {
		req.Checks = append(req.Checks, &agentv1.CheckRequest{Tenant: "tenant-0", Route: "/v1/lease/0", Operation: "GET"})
	}
	wire, err := proto.Marshal(req)
	if err != nil {
		b.Fatal(err)
	}
	receive := func() []byte { // as the stream receives a message: a copy, as unknown fields
		m := &emptypb.Empty{}
		if err := proto.Unmarshal(wire, m); err != nil {
			b.Fatal(err)
		}
		return m.ProtoReflect().GetUnknown()
	}
	var agentNs float64
	b.Run("agent", func(b *testing.B) {
		clk := clock.NewManual(clock.Of(time.Hour))
		lim := New(Config{}, set)
		q, err := audit.New(audit.Config{SampleAllow: audit.DefaultSampleAllow, Sink: audit.NewJSONSink(zapcore.AddSync(io.Discard), "bench"), Clock: clk})
		if err != nil {
			b.Fatal(err)
		}
		q.Start()
		defer func() { _ = q.Close(context.Background()) }()
		s := NewServer(ServerConfig{Limiter: lim, Clock: clk, Metrics: NewMetrics(), Audit: q})
		ds := &discardCheckStream{ctx: context.Background()}
		st := &checkStream{s: s, stream: ds, ctx: ds.ctx, pending: make(chan struct{}, MaxStreamPending), failed: make(chan struct{})}
		limit, cost := routeBucket(b, set, "/v1/lease/0", "GET", "tenant-0")
		var dec streamDecoder
		message := func() {
			if err := st.handle(&dec, receive()); err != nil {
				b.Fatal(err)
			}
			answerRefills(b, lim, clk.Now(), limit, cost)
			st.wg.Wait() // a message that waited for its refill
		}
		for range 100 { // the lease grows to the demand
			message()
			clk.Advance(time.Millisecond)
		}
		sent := ds.sent
		b.ReportAllocs()
		for b.Loop() {
			message()
		}
		if ds.sent-sent < b.N {
			b.Fatalf("%d answers for %d messages", ds.sent-sent, b.N)
		}
		agentNs = float64(b.Elapsed().Nanoseconds()) / float64(b.N*checks)
		b.ReportMetric(agentNs, "ns/check")
	})
	b.Run("empty", func(b *testing.B) {
		ds := &discardCheckStream{ctx: context.Background()}
		b.ReportAllocs()
		for b.Loop() {
			var m agentv1.CheckStreamRequest
			if err := proto.Unmarshal(wire, &m); err != nil {
				b.Fatal(err)
			}
			answers := make([]agentv1.CheckResponse, len(m.Checks))
			resp := &agentv1.CheckStreamResponse{Id: m.Id, Results: make([]*agentv1.CheckResponse, len(m.Checks))}
			for i := range answers {
				answers[i].Decision = agentv1.Decision_DECISION_ALLOW
				resp.Results[i] = &answers[i]
			}
			if err := ds.Send(resp); err != nil {
				b.Fatal(err)
			}
		}
		ns := float64(b.Elapsed().Nanoseconds()) / float64(b.N*checks)
		b.ReportMetric(ns, "ns/check")
		if agentNs > 0 {
			b.ReportMetric(agentNs/ns, "x-empty")
		}
	})
}
