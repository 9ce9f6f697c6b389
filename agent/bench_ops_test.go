package agent_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/agent"
	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
)

// countingStore counts the store operations (one per key of a Take or Return batch: one Lua
// script run each on Redis).
type countingStore struct {
	coordinator.Store
	ops atomic.Int64
}

func (c *countingStore) Take(ctx context.Context, reqs []coordinator.TakeRequest) ([]coordinator.TakeResult, error) {
	c.ops.Add(int64(len(reqs)))
	return c.Store.Take(ctx, reqs)
}

func (c *countingStore) Return(ctx context.Context, reqs []coordinator.ReturnRequest) ([]coordinator.ReturnResult, error) {
	c.ops.Add(int64(len(reqs)))
	return c.Store.Return(ctx, reqs)
}

// syncAgent drives the real lease core and the real coordinator Service over memstore on one
// manual clock, with no goroutines: refills are answered as soon as the core asks (the shell's
// latency is not what is measured), the sweep runs every 25 ms of simulated time as the
// Refresher's does.
type syncAgent struct {
	clk     *clock.Manual
	lim     *agent.Limiter
	svc     *coordinator.Service
	store   *countingStore
	sweepAt clock.Nanos
}

func newSyncAgent(tb testing.TB, policyText string) *syncAgent {
	set := parsePolicy(tb, policyText)
	a := &syncAgent{clk: clock.NewManual(clock.Nanos(time.Hour))}
	a.store = &countingStore{Store: memstore.New(memstore.WithClock(func() bucket.Millis {
		return bucket.Millis(a.clk.Now() / clock.Nanos(time.Millisecond))
	}))}
	a.svc = coordinator.NewService(a.store, set)
	a.lim = agent.New(agent.Config{AgentID: "sync"}, set)
	return a
}

func (a *syncAgent) pump(tb testing.TB) {
	ctx := context.Background()
	now := a.clk.Now()
	for c := a.lim.NextCall(now); c != nil; c = a.lim.NextCall(now) {
		r := agent.Reply{}
		var err error
		if c.Acquire != nil {
			r.Acquire, err = a.svc.Acquire(ctx, c.Acquire)
		} else {
			r.Return, err = a.svc.Return(ctx, c.Return)
		}
		r.Failure = agent.Classify(err)
		if err := a.lim.Apply(now, c, r); err != nil {
			tb.Fatal(err)
		}
	}
}

// check decides q at the clock's now, refilling at once when the core waits.
func (a *syncAgent) check(tb testing.TB, q agent.Query) agent.Verdict {
	now := a.clk.Now()
	if now >= a.sweepAt {
		a.lim.Expire(now, agent.DefaultSweepShards)
		a.sweepAt = now + clock.Of(agent.DefaultSweepEvery)
	}
	v, err := a.lim.Check(now, q)
	for i := 0; err == nil && v.Outcome == agent.Wait; i++ {
		if i == 3 {
			tb.Fatalf("check %v still waits after 3 refills", q)
		}
		a.pump(tb)
		select {
		case <-v.Ticket.Ready():
			v = v.Ticket.Verdict()
		default:
		}
		if v.Outcome == agent.Wait {
			v, err = a.lim.Check(now, q)
		}
	}
	if err != nil {
		tb.Fatal(err)
	}
	a.pump(tb) // prefetches and returns the check queued
	return v
}

// BenchmarkStoreOpsPerCheck counts store operations (Redis script runs) per check at steady state,
// driving the real core and coordinator Service over memstore on a manual clock. Each key sees
// half its rule's rate (a key near its limit is the one that costs Redis; a quiet key costs little
// in absolute terms): its lease holds its demand over τ/2, so a refill serves that many checks.
//
//   - hot-key: 1 key at 5,000 checks/s on 600000/minute burst 100000 (τ = 2.5 s);
//   - 10000-keys: 10,000 keys at 10 checks/s each, 100,000 checks/s in all, on 1200/minute burst
//     2400 (τ = 30 s, the longest lease).
//
// Checks are spread evenly in time, keys round robin. Before measuring, two lease lifetimes of
// traffic bring every key to its steady lease size; ns/op is the in-process cost of a check with
// its share of refills.
func BenchmarkStoreOpsPerCheck(b *testing.B) {
	for _, bc := range []struct {
		name   string
		policy string
		keys   int
		perKey float64 // checks per second per key
		warmup time.Duration
	}{
		{"hot-key", opsPolicy("600000/minute", 100000), 1, 5000, 5 * time.Second},
		{"10000-keys", opsPolicy("1200/minute", 2400), 10000, 10, 60 * time.Second},
	} {
		b.Run(bc.name, func(b *testing.B) {
			a := newSyncAgent(b, bc.policy)
			queries := tenantQueries(bc.keys)
			step := time.Duration(float64(time.Second) / (bc.perKey * float64(bc.keys)))
			i := 0
			next := func() {
				a.clk.Advance(step)
				if v := a.check(b, queries[i%bc.keys]); v.Outcome != agent.Allow {
					b.Fatalf("check %d: %v at half the rule's rate", i, v.Outcome)
				}
				i++
			}
			measureOps(b, a, int(bc.warmup/step), next)
		})
	}
}

// measureOps runs next warmup times, then b.N times timed, and reports the store operations per
// timed check.
func measureOps(b *testing.B, a *syncAgent, warmup int, next func()) {
	for range warmup {
		next()
	}
	ops0, granted0 := a.store.ops.Load(), a.lim.Stats().GrantedMicro.Load()
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		next()
	}
	b.StopTimer()
	b.ReportMetric(float64(a.store.ops.Load()-ops0)/float64(b.N), "store-ops/check")
	b.ReportMetric(float64(a.lim.Stats().GrantedMicro.Load()-granted0)/float64(bucket.PerToken)/float64(b.N), "granted-tokens/check")
}

// tenantQueries are n queries of /api/x, one per tenant.
func tenantQueries(n int) []agent.Query {
	q := make([]agent.Query, n)
	for i := range q {
		q[i] = agent.Query{Tenant: fmt.Sprintf("tenant-%05d", i), Path: "/api/x", Operation: "GET"}
	}
	return q
}

// BenchmarkColdKeys is the long tail in process: 10,000 keys on a rule of 100/second, burst 100
// (τ = 250 ms), 12,500 checks a second in all, so each key is checked every 0.8 s on average,
// colder than its lease, with leases (lease: on) and in direct mode (lease: off), through the real
// core and coordinator Service over memstore on a manual clock (syncAgent). cycle checks the keys
// in turn, each exactly every 0.8 s (the stack benchmark's uniform walk); turns is the walk
// stopped for 2 s after each 2 s of it, as the stack benchmark's modes take turns on one stack;
// random draws each check's key independently, so some checks come within τ of their key's last;
// fleet is one of four agents behind a load balancer on that walk (BenchmarkStackAgents): each
// check of the walk is this agent's with probability 1/4, so a key's gaps here are random
// multiples of its period, never shorter than it (a quarter of the checks, at the same pace).
// ns/op is the in-process cost of a check with its refill, agent and coordinator together;
// store-ops/check what it asks of the store; granted-tokens/check what the grants held (a check
// costs 1: the rest lapsed unspent or served a later check). Leases must cost no more than
// direct mode on any order, take 1 token per check on cycle and turns (a polled key is regular,
// over a pause too), and save takes on random.
func BenchmarkColdKeys(b *testing.B) {
	const keys, step = 10000, 80 * time.Microsecond
	const turn = int(2 * time.Second / step) // checks in 2 s
	for _, mode := range []string{"lease", "direct"} {
		for _, order := range []string{"cycle", "turns", "random", "fleet"} {
			b.Run(mode+"/"+order, func(b *testing.B) {
				a := newSyncAgent(b, opsPolicyLease("100/second", 100, map[string]string{"lease": "on", "direct": "off"}[mode]))
				queries := tenantQueries(keys)
				r := rand.New(rand.NewPCG(1, 2))
				i := 0
				next := func() {
					a.clk.Advance(step)
					if order == "turns" && i > 0 && i%turn == 0 {
						a.clk.Advance(2 * time.Second) // the other mode's turn
					}
					k := i % keys
					switch order {
					case "random":
						k = r.IntN(keys)
					case "fleet":
						for r.IntN(4) != 0 { // the walk's checks that go to the other three agents
							a.clk.Advance(step)
							i++
						}
						k = i % keys
					}
					if v := a.check(b, queries[k]); v.Outcome != agent.Allow {
						b.Fatalf("check %d: %v far below the rule's rate", i, v.Outcome)
					}
					i++
				}
				measureOps(b, a, 5*keys, next) // warm-up of four seconds: every key's demand and gaps measured
			})
		}
	}
}

func opsPolicy(limit string, burst int) string { return opsPolicyLease(limit, burst, "on") }

// opsPolicyLease is opsPolicy with the rule's lease option (on, off).
func opsPolicyLease(limit string, burst int, lease string) string {
	return fmt.Sprintf(`
version: "ops"
rules:
  - name: api
    routes: ["/api/*"]
    operations: [read]
    limit: %s
    burst: %d
    lease: %s
default:
  limit: 60/minute
  burst: 10
`, limit, burst, lease)
}
