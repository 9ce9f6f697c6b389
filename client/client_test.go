package client_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap/zaptest"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/client"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func newClient(t testing.TB, socket string, opts client.Options) *client.Client {
	t.Helper()
	opts.Socket = socket
	if opts.Logger == nil {
		opts.Logger = zaptest.NewLogger(t)
	}
	c, err := client.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func ctxTimeout(t testing.TB, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func TestDefaultSocketIsTheAgents(t *testing.T) {
	if client.DefaultSocket != agent.DefaultSocket {
		t.Fatalf("client.DefaultSocket = %q, want the agent's %q", client.DefaultSocket, agent.DefaultSocket)
	}
}

// TestDecisions: every field of the agent's answer arrives in the Result, on both paths.
func TestDecisions(t *testing.T) {
	srv := startFake(t, streamServe)
	for _, unary := range []bool{true, false} {
		t.Run(fmt.Sprintf("unary=%v", unary), func(t *testing.T) {
			c := newClient(t, srv.socket, client.Options{Unary: unary})
			tests := []struct {
				req  client.Request
				want client.Result
			}{
				{client.Request{Tenant: "acme", Route: "/orders/7", Operation: "GET", Cost: 3},
					client.Result{Decision: client.Allow, Remaining: 3, Limit: 100, Window: time.Minute, Reset: 1200 * time.Millisecond, Rule: "r-acme"}},
				{client.Request{Tenant: "deny", Route: "/orders/7", Operation: "GET"},
					client.Result{Decision: client.Deny, RetryAfter: 1500 * time.Millisecond, Limit: 100, Window: time.Minute, Reset: 1200 * time.Millisecond, Rule: "r-deny"}},
				{client.Request{Tenant: "down", Route: "/orders/7", Operation: "POST"},
					client.Result{Decision: client.Unavailable, RetryAfter: 2 * time.Second, Limit: 100, Window: time.Minute, Reset: 1200 * time.Millisecond, Rule: "r-down"}},
				{client.Request{Tenant: "degraded", Route: "/p", Operation: "GET"},
					client.Result{Decision: client.Allow, Degraded: true, Limit: 100, Window: time.Minute, Reset: 1200 * time.Millisecond, Rule: "r-degraded"}},
				{client.Request{Tenant: "acme", Route: "/p", Operation: "GET", IdempotencyKey: "k1"},
					client.Result{Decision: client.Allow, Replayed: true, Limit: 100, Window: time.Minute, Reset: 1200 * time.Millisecond, Rule: "r-acme"}},
			}
			for _, tt := range tests {
				got, err := c.Check(ctxTimeout(t, 5*time.Second), tt.req)
				if err != nil {
					t.Fatalf("Check(%+v): %v", tt.req, err)
				}
				if got != tt.want {
					t.Errorf("Check(%+v) = %+v, want %+v", tt.req, got, tt.want)
				}
			}
			st := c.Stats()
			if unary && (st.UnaryChecks != uint64(len(tests)) || st.StreamChecks != 0) {
				t.Errorf("unary client: stats %+v, want %d unary checks and none streamed", st, len(tests))
			}
			if !unary && st.StreamChecks == 0 {
				t.Errorf("streaming client: stats %+v, want streamed checks", st)
			}
		})
	}
}

// TestInvalidCheck: a malformed check is an *InvalidError on both paths, never a decision or an
// unreachable agent.
func TestInvalidCheck(t *testing.T) {
	srv := startFake(t, streamServe)
	for _, unary := range []bool{true, false} {
		c := newClient(t, srv.socket, client.Options{Unary: unary})
		_, err := c.Check(ctxTimeout(t, 5*time.Second), client.Request{Tenant: "bad", Route: "/", Operation: "GET"})
		var inv *client.InvalidError
		if !errors.As(err, &inv) || inv.Msg != "tenant is bad" {
			t.Errorf("unary=%v: Check(bad) error = %v, want *InvalidError with the agent's message", unary, err)
		}
		var ue *client.UnreachableError
		if errors.As(err, &ue) {
			t.Errorf("unary=%v: Check(bad) error %v is also an *UnreachableError", unary, err)
		}
	}
}

// TestInvalidUTF8: a check with a string that is not UTF-8, which protobuf cannot carry, is an
// *InvalidError naming the field on both paths, and the agent is not asked.
func TestInvalidUTF8(t *testing.T) {
	srv := startFake(t, streamServe)
	for _, unary := range []bool{true, false} {
		c := newClient(t, srv.socket, client.Options{Unary: unary})
		for _, req := range []client.Request{
			{Tenant: "a\xff", Route: "/", Operation: "GET"},
			{Tenant: "a", Route: "/\xc0", Operation: "GET"},
			{Tenant: "a", Route: "/", Operation: "G\xffT"},
			{Tenant: "a", Route: "/", Operation: "GET", IdempotencyKey: "k\xfe"},
		} {
			_, err := c.Check(ctxTimeout(t, 5*time.Second), req)
			var inv *client.InvalidError
			if !errors.As(err, &inv) || !strings.Contains(inv.Msg, "not valid UTF-8") {
				t.Errorf("unary=%v: Check(%+v) error = %v, want an *InvalidError about UTF-8", unary, req, err)
			}
		}
		if st := c.Stats(); st.UnaryChecks != 0 || st.StreamChecks != 0 {
			t.Errorf("unary=%v: stats %+v, want no check sent", unary, st)
		}
	}
	if n, b := srv.unary.Load(), srv.batchSizes(); n != 0 || len(b) != 0 {
		t.Errorf("the agent was asked: %d unary checks, stream batches %v", n, b)
	}
}

// TestIdempotencyPending: a repeat of an idempotency key still being decided is
// ErrIdempotencyPending on both paths, neither malformed nor unreachable.
func TestIdempotencyPending(t *testing.T) {
	srv := startFake(t, streamServe)
	for _, unary := range []bool{true, false} {
		c := newClient(t, srv.socket, client.Options{Unary: unary})
		if !unary {
			streamUp(t, c)
		}
		_, err := c.Check(ctxTimeout(t, 5*time.Second), client.Request{Tenant: "pending", Route: "/", Operation: "POST", IdempotencyKey: "k"})
		if !errors.Is(err, client.ErrIdempotencyPending) {
			t.Errorf("unary=%v: Check = %v, want ErrIdempotencyPending", unary, err)
		}
	}
}

// TestStreamCoalesces: concurrent checks travel in batches of at most MaxBatch, and every caller
// gets its own answer although batches are answered out of order.
func TestStreamCoalesces(t *testing.T) {
	srv := startFake(t, streamServe)
	const maxBatch = 8
	c := newClient(t, srv.socket, client.Options{MaxBatch: maxBatch, Linger: 200 * time.Microsecond})
	warm := streamUp(t, c)
	const goroutines, each = 64, 30
	var wg sync.WaitGroup
	errs := make(chan error, goroutines)
	for g := range goroutines {
		wg.Go(func() {
			for i := range each {
				tenant := tenantN(g*each + i)
				res, err := c.Check(context.Background(), client.Request{Tenant: tenant, Route: "/x", Operation: "GET", Cost: int64(i + 1)})
				if err != nil {
					errs <- err
					return
				}
				if res.Rule != "r-"+tenant || res.Remaining != int64(i+1) {
					errs <- fmt.Errorf("check of %s (cost %d) got the answer %+v", tenant, i+1, res)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	sizes := srv.batchSizes()[warm.StreamBatches:]
	total, biggest := 0, 0
	for _, n := range sizes {
		total += n
		biggest = max(biggest, n)
	}
	st := c.Stats()
	t.Logf("%d checks in %d batches, largest %d; stats %+v", total, len(sizes), biggest, st)
	switch {
	case total != goroutines*each || st.StreamChecks-warm.StreamChecks != goroutines*each:
		t.Errorf("the agent saw %d streamed checks, the client counted %d; want %d", total, st.StreamChecks-warm.StreamChecks, goroutines*each)
	case biggest > maxBatch:
		t.Errorf("a batch of %d checks, above MaxBatch %d", biggest, maxBatch)
	case biggest < 2 || len(sizes) >= total:
		t.Errorf("64 concurrent callers were never coalesced (%d batches for %d checks)", len(sizes), total)
	case st.UnaryChecks != warm.UnaryChecks:
		t.Errorf("%d unary checks while the stream worked", st.UnaryChecks-warm.UnaryChecks)
	}
}

// TestStreamPartialAnswers: the client sends every batch with partial and puts each batch's
// answers together from responses that answer one check each, out of order; a check its agent
// leaves waiting holds back no other check of its batch.
func TestStreamPartialAnswers(t *testing.T) {
	srv := startFake(t, streamPartial)
	c := newClient(t, srv.socket, client.Options{MaxBatch: 8, Linger: 200 * time.Microsecond})
	warm := streamUp(t, c)
	hangCtx, stopHangs := context.WithCancel(context.Background())
	defer stopHangs()
	const goroutines, each, hangs = 64, 40, 4
	var wg, hung sync.WaitGroup
	errs := make(chan error, goroutines+hangs)
	for g := range goroutines {
		wg.Go(func() {
			for i := range each {
				if g < hangs && i == each/2 { // mid-load: a check never answered, among the others
					hung.Go(func() {
						if _, err := c.Check(hangCtx, client.Request{Tenant: "hang", Route: "/x", Operation: "GET"}); !errors.Is(err, context.Canceled) {
							errs <- fmt.Errorf("a check never answered ended with %w, want its caller's cancel", err)
						}
					})
				}
				tenant := tenantN(g*each + i)
				res, err := c.Check(ctxTimeout(t, 5*time.Second), client.Request{Tenant: tenant, Route: "/x", Operation: "GET", Cost: int64(i + 1)})
				if err != nil {
					errs <- fmt.Errorf("check of %s: %w", tenant, err)
					return
				}
				if res.Rule != "r-"+tenant || res.Remaining != int64(i+1) {
					errs <- fmt.Errorf("check of %s (cost %d) got the answer %+v", tenant, i+1, res)
					return
				}
			}
		})
	}
	wg.Wait() // every other check answered while the hanging ones still wait
	stopHangs()
	hung.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	partial, withHang := srv.partialBatches()
	sizes := srv.batchSizes()[warm.StreamBatches:]
	shared := 0
	for _, n := range withHang {
		shared += n
	}
	st := c.Stats()
	t.Logf("%d batches, %d with partial; batches with a hanging check carried %v other checks; stats %+v", len(srv.batchSizes()), partial, withHang, st)
	switch {
	case partial != len(srv.batchSizes()):
		t.Errorf("%d of %d batches sent with partial", partial, len(srv.batchSizes()))
	case len(sizes) >= goroutines*each:
		t.Errorf("%d batches for %d checks: never coalesced", len(sizes), goroutines*each)
	case shared == 0:
		t.Errorf("no batch carried a hanging check with others (%v): nothing shown", withHang)
	case st.UnaryChecks != warm.UnaryChecks:
		t.Errorf("%d unary checks while the stream worked", st.UnaryChecks-warm.UnaryChecks)
	}
}

// TestStreamBadIndexes: a partial answer naming a check its batch does not have fails that
// batch's checks as unreachable.
func TestStreamBadIndexes(t *testing.T) {
	srv := startFake(t, streamBadIndexes)
	c := newClient(t, srv.socket, client.Options{})
	deadline := time.Now().Add(5 * time.Second)
	for c.Stats().StreamBatches == 0 { // unary answers, until a check travels on the stream
		if time.Now().After(deadline) {
			t.Fatalf("no check travelled on the stream: %+v", c.Stats())
		}
		_, err := c.Check(ctxTimeout(t, 5*time.Second), client.Request{Tenant: "a", Route: "/x", Operation: "GET"})
		if c.Stats().StreamBatches == 0 {
			if err != nil {
				t.Fatal(err)
			}
			continue
		}
		var unreachable *client.UnreachableError
		if !errors.As(err, &unreachable) || !strings.Contains(err.Error(), "indexes [1] for 1 checks") {
			t.Fatalf("a check answered with a bad index: %v, want unreachable naming the indexes", err)
		}
	}
}

// streamUp checks until a check has travelled on the stream (the first checks go unary while
// the connection is being made) and returns the client's stats then.
func streamUp(t *testing.T, c *client.Client) client.Stats {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for c.Stats().StreamChecks == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no check travelled on the stream: %+v", c.Stats())
		}
		if _, err := c.Check(ctxTimeout(t, 5*time.Second), client.Request{Tenant: "warm", Route: "/", Operation: "GET"}); err != nil {
			t.Fatal(err)
		}
	}
	return c.Stats()
}

// TestOneCheckAtATimeIsNotDelayed: a lone check goes out at once, in a batch of one.
func TestOneCheckAtATimeIsNotDelayed(t *testing.T) {
	srv := startFake(t, streamServe)
	c := newClient(t, srv.socket, client.Options{Linger: time.Second})
	for i := range 5 {
		start := time.Now()
		if _, err := c.Check(ctxTimeout(t, 5*time.Second), client.Request{Tenant: tenantN(i), Route: "/", Operation: "GET"}); err != nil {
			t.Fatal(err)
		}
		if d := time.Since(start); d > 500*time.Millisecond {
			t.Fatalf("a lone check took %v with a 1 s linger: it waited for company", d)
		}
	}
	for _, n := range srv.batchSizes() {
		if n != 1 {
			t.Fatalf("batch sizes %v, want all 1 for sequential checks", srv.batchSizes())
		}
	}
}

// TestStreamUnimplementedFallsBackToUnary: against an agent without CheckStream every check is
// answered (unary), the stream is not retried before StreamReprobe, and it is used once the
// agent serves it.
func TestStreamUnimplementedFallsBackToUnary(t *testing.T) {
	srv := startFake(t, streamUnimplemented)
	c := newClient(t, srv.socket, client.Options{StreamReprobe: 300 * time.Millisecond})
	for i := range 20 {
		res, err := c.Check(ctxTimeout(t, 5*time.Second), client.Request{Tenant: tenantN(i), Route: "/", Operation: "GET"})
		if err != nil || res.Rule != "r-"+tenantN(i) {
			t.Fatalf("check %d: %+v, %v", i, res, err)
		}
	}
	if opens := srv.opens.Load(); opens != 1 {
		t.Errorf("%d stream opens within the reprobe interval, want 1", opens)
	}
	if st := c.Stats(); st.UnaryChecks != 20 || st.StreamChecks != 0 || st.StreamErrors != 1 {
		t.Errorf("stats %+v, want 20 unary checks, none streamed, 1 stream error", st)
	}
	srv.mode.Store(int32(streamServe)) // the agent was upgraded
	deadline := time.Now().Add(5 * time.Second)
	for c.Stats().StreamChecks == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the stream was not used again after the reprobe interval: %+v", c.Stats())
		}
		if _, err := c.Check(ctxTimeout(t, 5*time.Second), client.Request{Tenant: "acme", Route: "/", Operation: "GET"}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestBrokenStreamRetriesUnary: a check in flight on a stream that breaks is answered by a unary
// Check, and the caller sees only the answer. (The agent breaks every stream after its first
// batch; each check is therefore answered by exactly one unary call, directly or as a retry.)
func TestBrokenStreamRetriesUnary(t *testing.T) {
	srv := startFake(t, streamBreak)
	c := newClient(t, srv.socket, client.Options{})
	checks := 0
	deadline := time.Now().Add(5 * time.Second)
	for srv.opens.Load() < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("%d stream opens in 5 s, want 2 (a broken stream is reopened)", srv.opens.Load())
		}
		res, err := c.Check(ctxTimeout(t, 5*time.Second), client.Request{Tenant: tenantN(checks), Route: "/", Operation: "GET"})
		if err != nil || res.Decision != client.Allow || res.Rule != "r-"+tenantN(checks) {
			t.Fatalf("check %d = %+v, %v; want its allow from a unary retry", checks, res, err)
		}
		checks++
	}
	st := c.Stats()
	if srv.unary.Load() != int64(checks) || st.UnaryChecks != uint64(checks) || st.StreamChecks != 0 || st.StreamErrors < 1 {
		t.Errorf("%d checks: %d unary calls, stats %+v; want one unary call per check, a stream error per broken stream",
			checks, srv.unary.Load(), st)
	}
}

// TestMalformedStreamAnswerRetriesUnary: an answer on the stream that does not decode fails the
// stream (a stream error); its checks are asked again unary and each caller gets its own answer.
func TestMalformedStreamAnswerRetriesUnary(t *testing.T) {
	srv := startFake(t, streamMalformed)
	c := newClient(t, srv.socket, client.Options{})
	checks := 0
	deadline := time.Now().Add(5 * time.Second)
	for c.Stats().StreamErrors == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no stream error in 5 s: %+v", c.Stats())
		}
		res, err := c.Check(ctxTimeout(t, 5*time.Second), client.Request{Tenant: tenantN(checks), Route: "/", Operation: "GET"})
		if err != nil || res.Decision != client.Allow || res.Rule != "r-"+tenantN(checks) {
			t.Fatalf("check %d = %+v, %v; want its allow from a unary retry", checks, res, err)
		}
		checks++
	}
	if st := c.Stats(); st.StreamChecks != 0 || st.UnaryChecks != uint64(checks) || srv.unary.Load() != int64(checks) {
		t.Errorf("%d checks: stats %+v, %d unary calls; want every check answered unary", checks, st, srv.unary.Load())
	}
}

// TestDeadline: a check the agent does not answer returns by the caller's deadline as an
// *UnreachableError that is also context.DeadlineExceeded; a cancelled caller gets
// context.Canceled, which is neither.
func TestDeadline(t *testing.T) {
	srv := startFake(t, streamServe)
	for _, unary := range []bool{true, false} {
		c := newClient(t, srv.socket, client.Options{Unary: unary})
		const deadline = 100 * time.Millisecond
		start := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), deadline)
		_, err := c.Check(ctx, client.Request{Tenant: "hang", Route: "/", Operation: "GET"})
		cancel()
		took := time.Since(start)
		var ue *client.UnreachableError
		if !errors.As(err, &ue) || !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("unary=%v: Check past its deadline = %v, want *UnreachableError wrapping DeadlineExceeded", unary, err)
		}
		if took > deadline+400*time.Millisecond {
			t.Errorf("unary=%v: Check returned %v after its %v deadline", unary, took-deadline, deadline)
		}

		ctx, cancel = context.WithCancel(context.Background())
		time.AfterFunc(20*time.Millisecond, cancel)
		_, err = c.Check(ctx, client.Request{Tenant: "hang", Route: "/", Operation: "GET"})
		if !errors.Is(err, context.Canceled) || errors.As(err, &ue) {
			t.Errorf("unary=%v: cancelled Check = %v, want context.Canceled and no *UnreachableError", unary, err)
		}
	}
}

// TestTimeoutBoundsChecksWithoutDeadline: Options.Timeout applies to a context without one.
func TestTimeoutBoundsChecksWithoutDeadline(t *testing.T) {
	srv := startFake(t, streamServe)
	c := newClient(t, srv.socket, client.Options{Timeout: 80 * time.Millisecond})
	start := time.Now()
	_, err := c.Check(context.Background(), client.Request{Tenant: "hang", Route: "/", Operation: "GET"})
	if ue := (*client.UnreachableError)(nil); !errors.As(err, &ue) {
		t.Fatalf("Check = %v, want *UnreachableError", err)
	}
	if took := time.Since(start); took > time.Second {
		t.Fatalf("Check took %v with an 80 ms Timeout", took)
	}
}

// TestNoAgent: without an agent on the socket a check fails fast with an *UnreachableError
// naming the socket.
func TestNoAgent(t *testing.T) {
	socket := filepath.Join(shortTempDir(t), "none.sock")
	for _, unary := range []bool{true, false} {
		c := newClient(t, socket, client.Options{Unary: unary, Timeout: 3 * time.Second})
		start := time.Now()
		res, err := c.Check(context.Background(), client.Request{Tenant: "acme", Route: "/", Operation: "GET"})
		var ue *client.UnreachableError
		if !errors.As(err, &ue) || ue.Target != "unix:"+socket {
			t.Fatalf("unary=%v: Check = %+v, %v; want *UnreachableError for %s", unary, res, err, socket)
		}
		if res.Decision != 0 {
			t.Errorf("unary=%v: an unreachable agent produced a decision %v", unary, res.Decision)
		}
		if took := time.Since(start); took > 2*time.Second {
			t.Errorf("unary=%v: took %v to find no agent; want a fast failure, not the timeout", unary, took)
		}
	}
}

// TestOneConnection: many concurrent checks share one connection.
func TestOneConnection(t *testing.T) {
	srv := startFake(t, streamServe)
	for _, unary := range []bool{true, false} {
		before := srv.accepts.Load()
		c := newClient(t, srv.socket, client.Options{Unary: unary})
		var wg sync.WaitGroup
		for g := range 16 {
			wg.Go(func() {
				for i := range 20 {
					if _, err := c.Check(ctxTimeout(t, 5*time.Second), client.Request{Tenant: tenantN(g*20 + i), Route: "/", Operation: "GET"}); err != nil {
						t.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
		if n := srv.accepts.Load() - before; n != 1 {
			t.Errorf("unary=%v: %d connections for 320 checks, want 1", unary, n)
		}
	}
}

// TestAgentRestart: when the agent restarts on its socket the client reconnects within about a
// second (gRPC's default backoff would wait up to two minutes), and the stream resumes.
func TestAgentRestart(t *testing.T) {
	srv := startFake(t, streamServe)
	c := newClient(t, srv.socket, client.Options{Timeout: 200 * time.Millisecond})
	check := func() error {
		_, err := c.Check(context.Background(), client.Request{Tenant: "acme", Route: "/", Operation: "GET"})
		return err
	}
	if err := check(); err != nil {
		t.Fatal(err)
	}
	srv.stop()
	// Fail a few checks while it is down, so the connection backs off.
	for range 5 {
		if err := check(); err == nil {
			t.Fatal("a check succeeded with the agent stopped")
		}
		time.Sleep(100 * time.Millisecond)
	}
	restarted := serveFake(t, &fakeAgent{}, srv.socket, streamServe)
	start := time.Now()
	for check() != nil {
		if time.Since(start) > 5*time.Second {
			t.Fatal("no reconnection 5 s after the agent restarted")
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("reconnected %v after the restart", time.Since(start))
	before := c.Stats().StreamChecks
	deadline := time.Now().Add(5 * time.Second)
	for c.Stats().StreamChecks == before {
		if time.Now().After(deadline) {
			t.Fatalf("the stream did not resume after the restart: %+v", c.Stats())
		}
		if err := check(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if restarted.opens.Load() == 0 {
		t.Error("no stream opened on the restarted agent")
	}
}

// TestClose: checks after Close fail as unreachable, and Close leaves no goroutine (TestMain).
func TestClose(t *testing.T) {
	srv := startFake(t, streamServe)
	c, err := client.New(client.Options{Socket: srv.socket, Logger: zaptest.NewLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Check(ctxTimeout(t, 5*time.Second), client.Request{Tenant: "acme", Route: "/", Operation: "GET"}); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	_, err = c.Check(ctxTimeout(t, 5*time.Second), client.Request{Tenant: "acme", Route: "/", Operation: "GET"})
	if ue := (*client.UnreachableError)(nil); !errors.As(err, &ue) {
		t.Fatalf("Check after Close = %v, want *UnreachableError", err)
	}
}
