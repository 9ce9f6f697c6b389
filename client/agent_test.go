package client_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/client"
	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/policy"
)

// startAgent serves the real agent (Limiter, Refresher, Server) on a Unix socket, refilled by a
// coordinator Service on the in-memory store, with examples/policy.yaml.
func startAgent(t testing.TB) string {
	t.Helper()
	return serveAgent(t, examplePolicy(t))
}

func examplePolicy(t testing.TB) *policy.Set {
	t.Helper()
	set, err := policy.Load("../examples/policy.yaml")
	if err != nil {
		t.Fatal(err)
	}
	return set
}

// serveAgent serves the real agent with set.
func serveAgent(t testing.TB, set *policy.Set) string {
	t.Helper()
	socket := filepath.Join(shortTempDir(t), "agent.sock")
	serveAgentOn(t, set, socket)
	return socket
}

// serveAgentOn serves the real agent with set on socket, which answers once it returns, and
// returns a function that stops it (also called when the test ends) and its health server.
func serveAgentOn(t testing.TB, set *policy.Set, socket string) (stop func(), hs *health.Server) {
	t.Helper()
	log := zaptest.NewLogger(t)
	svc := coordinator.NewService(memstore.New(), set)
	clk := clock.NewCoarse(time.Millisecond)
	ref := agent.NewRefresher(agent.RefresherConfig{Coordinator: svc, Clock: clk, Logger: log})
	lim := agent.New(agent.Config{AgentID: "client-test", Region: "eu-west", Guard: clock.Guard}, set)
	ref.Start(lim)
	// A check on a key without a lease waits for a refill; on a loaded test machine that can
	// outlast the production wait bound, which would answer with the failure mode.
	srv := agent.NewServer(agent.ServerConfig{Limiter: lim, Clock: clk, Logger: log, MaxWait: time.Second})
	ln, err := agent.ListenUnix(socket, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	hs = srv.Register(g)
	served := make(chan struct{})
	go func() { _ = g.Serve(ln); close(served) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			g.Stop()
			<-served
			_ = ln.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if err := ref.Stop(ctx); err != nil {
				t.Errorf("Refresher.Stop: %v", err)
			}
			clk.Close()
		})
	}
	t.Cleanup(stop)
	return stop, hs
}

// TestAgentStartedAfterClient: a client started before its agent finds none, at once, as
// unreachable; the first check after the agent's socket answers is decided by the agent, not
// answered from gRPC's reconnect backoff (about a second); the same after the agent restarts.
// On both paths.
func TestAgentStartedAfterClient(t *testing.T) {
	set := examplePolicy(t)
	for _, unary := range []bool{true, false} {
		t.Run(fmt.Sprintf("unary=%v", unary), func(t *testing.T) {
			socket := filepath.Join(shortTempDir(t), "agent.sock")
			c := newClient(t, socket, client.Options{Unary: unary})
			req := client.Request{Tenant: "late", Route: "/orders/7", Operation: "GET"}
			for _, phase := range []string{"started after the client", "restarted"} {
				// Without an agent, checks are unreachable; after the second at the latest,
				// gRPC's connection waits out its reconnect backoff.
				var lastTry time.Time
				for i := range 2 {
					res, err := c.Check(ctxTimeout(t, 5*time.Second), req)
					if ue := (*client.UnreachableError)(nil); !errors.As(err, &ue) {
						t.Fatalf("agent %s: check %d before it = %+v, %v; want *UnreachableError", phase, i, res, err)
					}
					lastTry = time.Now()
				}
				stop, _ := serveAgentOn(t, set, socket) // the socket answers from here on
				// A check retries an unreachable agent if the last retry is at least
				// RedialFloor old: let the last one age that much.
				time.Sleep(time.Until(lastTry.Add(client.RedialFloor)))
				res, err := c.Check(ctxTimeout(t, 5*time.Second), req)
				if err != nil || res.Decision != client.Allow || res.Rule != "orders-read" {
					t.Fatalf("agent %s: the first check after its socket answered = %+v, %v; want the agent's allow by orders-read",
						phase, res, err)
				}
				if err := c.Ready(ctxTimeout(t, 5*time.Second)); err != nil {
					t.Errorf("agent %s: Ready = %v", phase, err)
				}
				stop()
			}
		})
	}
}

// TestReady: Ready is nil while the agent serves checks, an *UnreachableError without an agent
// and while it is not serving (shutting down), and nil for an agent without a health service.
func TestReady(t *testing.T) {
	socket := filepath.Join(shortTempDir(t), "agent.sock")
	c := newClient(t, socket, client.Options{})
	unreachable := func(what string) {
		t.Helper()
		err := c.Ready(ctxTimeout(t, 5*time.Second))
		if ue := (*client.UnreachableError)(nil); !errors.As(err, &ue) {
			t.Errorf("%s: Ready = %v, want *UnreachableError", what, err)
		}
	}
	unreachable("no agent")
	_, hs := serveAgentOn(t, examplePolicy(t), socket)
	// Ready retries the connection at most every RedialFloor: poll.
	deadline := time.Now().Add(5 * time.Second)
	for err := c.Ready(ctxTimeout(t, 5*time.Second)); err != nil; err = c.Ready(ctxTimeout(t, 5*time.Second)) {
		if time.Now().After(deadline) {
			t.Fatalf("Ready = %v 5 s after the agent started", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	hs.Shutdown() // what the agent does first when it shuts down
	unreachable("agent not serving")

	fake := startFake(t, streamServe)
	if err := newClient(t, fake.socket, client.Options{}).Ready(ctxTimeout(t, 5*time.Second)); err != nil {
		t.Errorf("agent without a health service: Ready = %v, want nil", err)
	}
}

// TestRealAgentCardExample: the design card's example through the real agent, with concurrent
// callers: tenant acme reading orders (100 per minute, burst 20) is allowed exactly the burst,
// then denied with a Retry-After of at most one token's time (600 ms). The client uses the
// stream where the agent serves it and unary Check where it does not; the decisions are the same.
func TestRealAgentCardExample(t *testing.T) {
	socket := startAgent(t)
	for _, unary := range []bool{true, false} {
		tenant := "acme-unary"
		if !unary {
			tenant = "acme-stream"
		}
		c := newClient(t, socket, client.Options{Unary: unary})
		var (
			mu             sync.Mutex
			allowed        int
			denied         int
			maxRetry       time.Duration
			wg             sync.WaitGroup
			firstErr       error
			rules          = map[string]int{}
			limits, window = map[int64]int{}, map[time.Duration]int{}
		)
		for range 5 {
			wg.Go(func() {
				for range 6 {
					res, err := c.Check(ctxTimeout(t, 5*time.Second), client.Request{Tenant: tenant, Route: "/orders/7", Operation: "GET"})
					mu.Lock()
					switch {
					case err != nil:
						firstErr = err
					case res.Decision == client.Allow:
						allowed++
					case res.Decision == client.Deny:
						denied++
						maxRetry = max(maxRetry, res.RetryAfter)
					}
					rules[res.Rule]++
					limits[res.Limit]++
					window[res.Window]++
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		if firstErr != nil {
			t.Fatalf("unary=%v: %v", unary, firstErr)
		}
		if allowed != 20 || denied != 10 {
			t.Errorf("unary=%v: %d allowed, %d denied of 30; want the burst of 20, then 10 denials", unary, allowed, denied)
		}
		if maxRetry <= 0 || maxRetry > 600*time.Millisecond {
			t.Errorf("unary=%v: Retry-After up to %v, want within one token's 600 ms", unary, maxRetry)
		}
		if rules["orders-read"] != 30 || limits[100] != 30 || window[time.Minute] != 30 {
			t.Errorf("unary=%v: rules %v, limits %v, windows %v; want orders-read, 100 per 1m", unary, rules, limits, window)
		}
		st := c.Stats()
		t.Logf("unary=%v: stats %+v", unary, st)
		if !unary && (st.StreamChecks == 0 || st.StreamErrors != 0) {
			t.Errorf("the agent serves CheckStream, but the client did not use it: %+v", st)
		}
	}
}

// TestRealAgentIdempotency: the client sends the idempotency key and reports a repeat as
// replayed, with the first decision, on both paths.
func TestRealAgentIdempotency(t *testing.T) {
	socket := startAgent(t)
	for _, unary := range []bool{true, false} {
		c := newClient(t, socket, client.Options{Unary: unary})
		tenant := fmt.Sprintf("idem-%v", unary)
		check := func(key string) client.Result {
			t.Helper()
			res, err := c.Check(ctxTimeout(t, 5*time.Second), client.Request{Tenant: tenant, Route: "/orders/7", Operation: "GET", IdempotencyKey: key})
			if err != nil || res.Decision != client.Allow {
				t.Fatalf("unary=%v: check with key %q = %+v, %v", unary, key, res, err)
			}
			return res
		}
		first := check("k-1")
		again := check("k-1")
		other := check("k-2")
		if first.Replayed || !again.Replayed || other.Replayed {
			t.Errorf("unary=%v: replayed %v, %v, %v; want only the repeat replayed", unary, first.Replayed, again.Replayed, other.Replayed)
		}
		// The repeat is the first answer; a fresh key is charged. (Remaining is the agent's
		// estimate, which a refill landing in between moves on a real clock: the exact charge is
		// the agent's TestIdempotentRepeats, on a store whose clock stands still.)
		if again.Remaining != first.Remaining || other.Remaining >= first.Remaining {
			t.Errorf("unary=%v: remaining %d, %d, %d; want the repeat's the same as the first, then less", unary, first.Remaining, again.Remaining, other.Remaining)
		}
	}
}

// loadPolicy has two rules, so a caller can tell its answer from another's; neither denies
// within a test.
const loadPolicy = `
version: "load"
rules:
  - name: hot
    routes: ["/hot/{id}"]
    operations: [read]
    limit: 100000000/second
    burst: 100000000
  - name: cold
    routes: ["/cold/{id}"]
    operations: [write]
    limit: 100000000/second
    burst: 100000000
default:
  limit: 60/minute
  burst: 10
`

// TestRealAgentStreamUnderLoad: 64 callers on the stream, on a hot key and on new keys (whose
// first check waits for a refill, so the agent answers batches out of order): every check is
// answered, within its deadline, with its own rule, and the checks were coalesced.
func TestRealAgentStreamUnderLoad(t *testing.T) {
	set, err := policy.Parse("load.yaml", []byte(loadPolicy))
	if err != nil {
		t.Fatal(err)
	}
	c := newClient(t, serveAgent(t, set), client.Options{})
	const callers, each = 64, 100
	var wg sync.WaitGroup
	for g := range callers {
		wg.Go(func() {
			for i := range each {
				req, want := client.Request{Tenant: "hot", Route: "/hot/1", Operation: "GET"}, "hot"
				if i%10 == g%10 {
					req, want = client.Request{Tenant: fmt.Sprintf("t%d-%d", g, i), Route: "/cold/2", Operation: "POST"}, "cold"
				}
				res, err := c.Check(ctxTimeout(t, 5*time.Second), req)
				if err != nil || res.Decision != client.Allow || res.Rule != want {
					t.Errorf("caller %d check %d (%s): %+v, %v", g, i, want, res, err)
					return
				}
			}
		})
	}
	wg.Wait()
	st := c.Stats()
	t.Logf("stats %+v", st)
	if st.StreamErrors != 0 || st.StreamChecks < callers*each/2 || st.StreamBatches >= st.StreamChecks {
		t.Errorf("stats %+v: want most checks streamed, coalesced, no stream error", st)
	}
}

// TestRealAgentSettle: on the stream and unary, a check with Settle gets an id, Settle replaces
// its estimate, and a second Settle of the same id is ErrUnknownSettle; a negative cost is an
// *InvalidError and leaves the check to be settled.
func TestRealAgentSettle(t *testing.T) {
	socket := startAgent(t)
	for _, unary := range []bool{true, false} {
		c := newClient(t, socket, client.Options{Unary: unary})
		ctx := ctxTimeout(t, 5*time.Second)
		res, err := c.Check(ctx, client.Request{Tenant: fmt.Sprintf("settle-%v", unary), Route: "/orders/7", Operation: "GET", Cost: 3, Settle: true})
		if err != nil || res.Decision != client.Allow || res.SettleID == 0 {
			t.Fatalf("unary=%v: check = %+v, %v; want allowed with a settle id", unary, res, err)
		}
		var invalid *client.InvalidError
		if _, err := c.Settle(ctx, res.SettleID, -1); !errors.As(err, &invalid) {
			t.Errorf("unary=%v: Settle(-1) = %v, want an *InvalidError", unary, err)
		}
		got, err := c.Settle(ctx, res.SettleID, 1)
		if err != nil || got.Credited != 2 || got.Charged != 0 {
			t.Errorf("unary=%v: Settle(1) = %+v, %v; want 2 credited", unary, got, err)
		}
		if _, err := c.Settle(ctx, res.SettleID, 1); !errors.Is(err, client.ErrUnknownSettle) {
			t.Errorf("unary=%v: second Settle = %v, want ErrUnknownSettle", unary, err)
		}
	}
}

// TestRealAgentBrief: on the stream and unary, an allowed check sent Brief has no RateLimit
// fields and keeps its rule; the same check not Brief has them all.
func TestRealAgentBrief(t *testing.T) {
	socket := startAgent(t)
	for _, unary := range []bool{true, false} {
		c := newClient(t, socket, client.Options{Unary: unary})
		req := client.Request{Tenant: fmt.Sprintf("brief-%v", unary), Route: "/orders/7", Operation: "GET", Brief: true}
		res, err := c.Check(ctxTimeout(t, 5*time.Second), req)
		if err != nil || res.Decision != client.Allow || res.Rule != "orders-read" ||
			res.Remaining != 0 || res.Limit != 0 || res.Window != 0 || res.Reset != 0 {
			t.Errorf("unary=%v: brief check = %+v, %v; want allowed by orders-read without RateLimit fields", unary, res, err)
		}
		req.Brief = false
		res, err = c.Check(ctxTimeout(t, 5*time.Second), req)
		if err != nil || res.Decision != client.Allow || res.Rule != "orders-read" ||
			res.Remaining <= 0 || res.Limit != 100 || res.Window != time.Minute || res.Reset <= 0 {
			t.Errorf("unary=%v: check = %+v, %v; want allowed by orders-read, 100 a minute, with what remains", unary, res, err)
		}
	}
}
