package agent_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/leasebucket/leasebucket/agent/audit"
	agentv1 "github.com/leasebucket/leasebucket/proto/leasebucket/agent/v1"
)

// Shape of the streamed load: streams on one connection (as a gateway's client holds), messages
// in flight per stream, tenants per stream.
const (
	benchStreams = 4
	benchWindow  = 8
	benchTenants = 16
)

// streamDrive sends n checks over conn in messages of batch checks, on benchStreams streams with
// benchWindow messages in flight each, checks that every answer is an allow, and returns the
// wall time.
func streamDrive(b *testing.B, conn *grpc.ClientConn, n, batch int) time.Duration {
	b.Helper()
	client := agentv1.NewAgentServiceClient(conn)
	var wg sync.WaitGroup
	start := time.Now()
	for si := range benchStreams {
		msgs := n / benchStreams / batch
		if si < n/batch%benchStreams {
			msgs++
		}
		if msgs == 0 {
			continue
		}
		// One message, sent again and again: the client marshals it on each Send and never
		// changes it.
		msg := &agentv1.CheckStreamRequest{Checks: make([]*agentv1.CheckRequest, batch)}
		for i := range msg.Checks {
			msg.Checks[i] = &agentv1.CheckRequest{Tenant: "tenant-" + strconv.Itoa(si*benchTenants+i%benchTenants), Route: "/api/items", Operation: "GET"}
		}
		wg.Go(func() {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			st, err := client.CheckStream(ctx)
			if err != nil {
				b.Error(err)
				return
			}
			window := make(chan struct{}, benchWindow)
			recvErr := make(chan error, 1)
			go func() {
				for range msgs {
					resp, err := st.Recv()
					if err == nil && len(resp.Results) != batch {
						err = fmt.Errorf("%d results for %d checks", len(resp.Results), batch)
					}
					if err == nil {
						for _, r := range resp.Results {
							if r.Decision != agentv1.Decision_DECISION_ALLOW {
								err = fmt.Errorf("check answered %v", r)
								break
							}
						}
					}
					if err != nil {
						recvErr <- err
						return
					}
					<-window
				}
				recvErr <- nil
			}()
			for i := range msgs {
				window <- struct{}{}
				msg.Id = uint64(i)
				if err := st.Send(msg); err != nil {
					b.Error(err)
					return
				}
			}
			if err := errors.Join(<-recvErr, st.CloseSend()); err != nil {
				b.Error(err)
			}
			if _, err := st.Recv(); !errors.Is(err, io.EOF) {
				b.Errorf("stream end: %v", err)
			}
		})
	}
	wg.Wait()
	return time.Since(start)
}

// selfCPU is this process's user+system CPU time (the benchmark's client side).
func selfCPU(b *testing.B) time.Duration {
	b.Helper()
	return procCPU(b, "/proc/self/stat")
}

// BenchmarkUnixCheckStream is the streamed check API against the unary ceiling, measured as
// BenchmarkUnixCheck measures unary Check: one separate server process (the real agent on one
// socket, an empty unary handler on another), one client connection per server, server CPU from
// /proc/<pid>/stat. In five alternating slices it sends b.N checks in CheckStream messages of
// batch checks (4 streams, 8 messages in flight each, 64 tenants) and b.N/20 unary calls to the
// empty handler at concurrency 64, the ceiling of unary checks on this machine.
//
// Metrics: checks/s (streamed checks per second of wall time), srv-µs/check (server CPU per
// streamed check), client-µs/check (this process's CPU per check: the client side shares the
// machine), unary-ceiling/s (empty unary calls per second) and x-unary (checks/s over the
// ceiling, from the same run).
func BenchmarkUnixCheckStream(b *testing.B) {
	srv := startBenchServer(b)
	agentConn, emptyConn := srv.dial(b, "agent.sock"), srv.dial(b, "empty.sock")
	drive(b, emptyConn, 2000, 64)
	streamDrive(b, agentConn, 100_000, 256) // leases for every tenant
	for _, batch := range []int{64, 256} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			const slices = 5
			n := max(b.N, batch*benchStreams)
			var streamWall, unaryWall, streamCPU, clientCPU time.Duration
			unary := 0
			for range slices {
				k := n / slices
				u := max(1000, k/20)
				unary += u
				t0 := time.Now()
				drive(b, emptyConn, u, 64)
				unaryWall += time.Since(t0)
				cpu0, self0 := srv.cpu(b), selfCPU(b)
				streamWall += streamDrive(b, agentConn, k, batch)
				streamCPU += srv.cpu(b) - cpu0
				clientCPU += selfCPU(b) - self0
			}
			checks := float64(n/slices/batch*batch) * slices // whole messages only
			b.ReportMetric(float64(streamWall.Nanoseconds())/checks, "ns/op")
			b.ReportMetric(checks/streamWall.Seconds(), "checks/s")
			b.ReportMetric(float64(streamCPU.Microseconds())/checks, "srv-µs/check")
			b.ReportMetric(float64(clientCPU.Microseconds())/checks, "client-µs/check")
			b.ReportMetric(float64(unary)/unaryWall.Seconds(), "unary-ceiling/s")
			b.ReportMetric((checks/streamWall.Seconds())/(float64(unary)/unaryWall.Seconds()), "x-unary")
		})
	}
}

// BenchmarkAuditOverhead is the check path with audit off and on, in process on a live lease:
// the Check handler as in BenchmarkServerCheck. On is the agent's default (allows sampled at
// 0.1 %, JSON written to io.Discard by the queue's goroutine), ten times that, and every allow
// audited, which is what each check of a deny flood costs (the queue overflows: most events
// are counted drops).
// Each sub-benchmark runs b.N checks on each of two identical agents, one with audit, in 50
// alternating slices (load from elsewhere on the machine falls on both alike); overhead-%
// compares them.
func BenchmarkAuditOverhead(b *testing.B) {
	for _, sample := range []float64{0.001, 0.01, 1} {
		b.Run(fmt.Sprintf("sample=%v", sample), func(b *testing.B) {
			set := parsePolicy(b, benchPolicy)
			off := newStack(b, set, stackOptions{})
			on := newStack(b, set, stackOptions{audit: benchAudit(b, sample, off.clk)})
			req := &agentv1.CheckRequest{Tenant: "acme", Route: "/api/items", Operation: "GET"}
			ctx := context.Background()
			run := func(s *stack, n int) time.Duration {
				start := time.Now()
				for range n {
					if resp, err := s.srv.Check(ctx, req); err != nil || resp.Decision != agentv1.Decision_DECISION_ALLOW {
						b.Fatal(resp, err)
					}
				}
				return time.Since(start)
			}
			run(off, 1000)
			run(on, 1000)
			b.ReportAllocs()
			b.ResetTimer()
			const slices = 50
			var offWall, onWall time.Duration
			for i := range slices {
				k := b.N / slices
				if i < b.N%slices {
					k++
				}
				offWall += run(off, k)
				onWall += run(on, k)
			}
			n := float64(b.N)
			b.ReportMetric(float64(onWall.Nanoseconds())/n, "ns/op")
			b.ReportMetric(float64(offWall.Nanoseconds())/n, "off-ns/check")
			b.ReportMetric(float64(onWall.Nanoseconds())/n, "on-ns/check")
			b.ReportMetric(100*(onWall.Seconds()-offWall.Seconds())/offWall.Seconds(), "overhead-%")
		})
	}
}

// BenchmarkServerCheckBatch is the streamed path's per-check server work in process, without
// gRPC: a CheckBatch of 256 checks (64 tenants) on live leases, decided, counted, audited (at
// the default sampling) and answered. The answer's messages share one allocation per batch, so
// allocs/check shows what a check costs beyond protobuf decoding: nothing.
func BenchmarkServerCheckBatch(b *testing.B) {
	set := parsePolicy(b, benchPolicy)
	clkStack := newStack(b, set, stackOptions{})
	s := newStack(b, set, stackOptions{audit: benchAudit(b, audit.DefaultSampleAllow, clkStack.clk)})
	const batch = 256
	req := &agentv1.CheckBatchRequest{Checks: make([]*agentv1.CheckRequest, batch)}
	for i := range req.Checks {
		req.Checks[i] = &agentv1.CheckRequest{Tenant: "tenant-" + strconv.Itoa(i%64), Route: "/api/items", Operation: "GET"}
	}
	ctx := context.Background()
	for range 3 { // leases for every tenant
		if _, err := s.srv.CheckBatch(ctx, req); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	start := time.Now()
	for b.Loop() {
		resp, err := s.srv.CheckBatch(ctx, req)
		if err != nil || resp.Results[batch-1].Decision != agentv1.Decision_DECISION_ALLOW {
			b.Fatal(resp, err)
		}
	}
	b.ReportMetric(float64(time.Since(start).Nanoseconds())/float64(b.N*batch), "ns/check")
}
