package agent

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/policy"
)

const testPolicy = `
version: "v1"
rules:
  - name: api
    routes: ["/api/*"]
    operations: [read]
    limit: 600000/minute
    burst: 100000
default:
  limit: 60/minute
  burst: 10
`

func testSet(t testing.TB) *policy.Set { return parseSet(t, testPolicy) }

// TestConcurrentSpendAndRetire: goroutines spend one lease while another retires it; every token
// is spent or returned exactly once and none is spent after the lease is retired.
func TestConcurrentSpendAndRetire(t *testing.T) {
	for round := range 20 {
		l := New(Config{AgentID: "a"}, testSet(t))
		q := Query{Tenant: "acme", Path: "/api/x", Operation: "GET"}
		v, err := l.Check(0, q)
		if err != nil || v.Outcome != Wait {
			t.Fatalf("first Check = %v, %v; want wait", v.Outcome, err)
		}
		const granted = 5000 * bucket.PerToken
		grantAll(t, l, 0, granted)
		if got := v.Ticket.Verdict(); got.Outcome != Allow {
			t.Fatalf("the waiting check got %v, want allow from the grant", got.Outcome)
		}
		var allowed atomic.Int64
		allowed.Add(1)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for range 8 {
			wg.Go(func() {
				<-start
				for range 1000 {
					v, err := l.Check(1, q)
					if errors.Is(err, ErrClosed) {
						return
					}
					if err != nil {
						t.Error(err)
						return
					}
					if v.Outcome == Allow {
						allowed.Add(1)
					}
				}
			})
		}
		close(start)
		if round%2 == 1 {
			runtime.Gosched()
		}
		l.Close()
		wg.Wait()
		_, returned := handedBack(t, l, 1)
		if got := allowed.Load()*int64(bucket.PerToken) + returned; got != int64(granted) {
			t.Fatalf("round %d: spent %d tokens + returned %d µ = %d µ, want %d µ granted", round, allowed.Load(), returned, got, granted)
		}
	}
}

// TestEvictionBound: unbounded key churn keeps the table within MaxKeys, and every evicted key's
// lease is handed back, at once.
func TestEvictionBound(t *testing.T) {
	const maxKeys = 1000 // not a multiple of the shard count: the bound is still exact
	l := New(Config{AgentID: "a", MaxKeys: maxKeys}, testSet(t))
	for i := range 50_000 {
		q := Query{Tenant: fmt.Sprintf("tenant-%d", i), Path: "/api/x", Operation: "GET"}
		if _, err := l.Check(0, q); err != nil {
			t.Fatal(err)
		}
		grantAll(t, l, 0, 10*bucket.PerToken) // the waiting check takes 1, 9 stay in the lease
		if v, _ := l.Check(0, q); v.Outcome != Allow {
			t.Fatalf("check after grant = %v", v.Outcome)
		}
	}
	if n := l.Keys(); n > maxKeys {
		t.Fatalf("Keys() = %d after churn, want <= %d", n, maxKeys)
	}
	evicted := l.Stats().Evicted.Load()
	returned := l.Stats().Returns.Load()
	if returned != evicted || evicted < 50_000-maxKeys || l.Stats().ReturnedMicro.Load() != 8*evicted*uint64(bucket.PerToken) {
		t.Fatalf("evicted %d keys, handed back %d leases (%d µ); want >= %d, equal, 8 tokens each",
			evicted, returned, l.Stats().ReturnedMicro.Load(), 50_000-maxKeys)
	}
}

// TestRecentlyUsedSurvivesEviction: a key checked between insertions keeps its lease (the second
// chance), while untouched keys are evicted.
func TestRecentlyUsedSurvivesEviction(t *testing.T) {
	l := New(Config{AgentID: "a", MaxKeys: 512}, testSet(t)) // eight keys per shard
	hot := Query{Tenant: "hot", Path: "/api/x", Operation: "GET"}
	l.Check(0, hot)
	grantAll(t, l, 0, 1_000_000*bucket.PerToken)
	for i := range 5000 {
		if v, _ := l.Check(0, hot); v.Outcome != Allow {
			t.Fatalf("hot key lost its lease after %d other keys: %v", i, v.Outcome)
		}
		l.Check(0, Query{Tenant: fmt.Sprintf("cold-%d", i), Path: "/api/x", Operation: "GET"})
	}
}

func BenchmarkCheck(b *testing.B) {
	l := New(Config{AgentID: "a"}, testSet(b))
	q := Query{Tenant: "acme", Path: "/api/orders", Operation: "GET"}
	l.Check(0, q)
	grantAll(b, l, 0, bucket.MaxExact/4)
	b.ReportAllocs()
	for b.Loop() {
		if v, _ := l.Check(1, q); v.Outcome != Allow {
			b.Fatal(v.Outcome)
		}
	}
}

const twoLimitsPolicy = `
version: "v1"
rules:
  - name: api
    routes: ["/api/*"]
    operations: [read]
    limits:
      - {limit: 600000/minute, burst: 100000}
      - {limit: 6000000/hour, burst: 100000}
default:
  limit: 60/minute
  burst: 10
`

// BenchmarkCheckTwoLimits is BenchmarkCheck on a rule of two limits: both leases spent, all or
// nothing (the target: at most 1.3 times the one-limit check's CPU).
func BenchmarkCheckTwoLimits(b *testing.B) {
	set, err := policy.Parse("test.yaml", []byte(twoLimitsPolicy))
	if err != nil {
		b.Fatal(err)
	}
	l := New(Config{AgentID: "a"}, set)
	q := Query{Tenant: "acme", Path: "/api/orders", Operation: "GET"}
	for range 3 {
		if v, _ := l.Check(0, q); v.Outcome == Allow {
			break
		}
		grantAll(b, l, 0, bucket.MaxExact/4)
	}
	b.ReportAllocs()
	for b.Loop() {
		if v, _ := l.Check(1, q); v.Outcome != Allow {
			b.Fatal(v.Outcome)
		}
	}
}

// BenchmarkSpend is the lease itself: a live entry's compare-and-swap decrement.
func BenchmarkSpend(b *testing.B) {
	l := New(Config{AgentID: "a"}, testSet(b))
	q := Query{Tenant: "acme", Path: "/api/orders", Operation: "GET"}
	l.Check(0, q)
	grantAll(b, l, 0, bucket.MaxExact/4)
	v := l.view.Load()
	r, _ := v.set.Match(q.Path, q.Operation)
	b.ReportAllocs()
	for b.Loop() {
		e := v.table.get(v.table.hash(r.ID, q.Tenant), r.ID, q.Tenant)
		if _, ok := e.spend(1, int64(bucket.PerToken)); !ok {
			b.Fatal("spend failed")
		}
	}
}

var parallelKey atomic.Int64

// BenchmarkCheckParallel: every goroutine its own key, or all on one hot key.
func BenchmarkCheckParallel(b *testing.B) {
	for _, hot := range []bool{false, true} {
		name := "distinct-keys"
		if hot {
			name = "hot-key"
		}
		b.Run(name, func(b *testing.B) {
			l := New(Config{AgentID: "a"}, testSet(b))
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				tenant := "hot"
				if !hot {
					tenant = fmt.Sprintf("t%d", parallelKey.Add(1))
				}
				q := Query{Tenant: tenant, Path: "/api/orders", Operation: "GET"}
				// Another goroutine may have taken this key's refill and not applied it yet: wait
				// for it rather than count its Wait as a failure.
				for v, _ := l.Check(0, q); v.Outcome == Wait; v, _ = l.Check(0, q) {
					grantAll(b, l, 0, bucket.MaxExact/4)
					<-v.Ticket.Ready()
				}
				for pb.Next() {
					if v, _ := l.Check(1, q); v.Outcome != Allow {
						b.Error(v.Outcome)
						return
					}
				}
			})
		})
	}
}

// BenchmarkMemoryPerKey reports the heap held per live key of the lease table, with a million
// keys each holding a lease.
func BenchmarkMemoryPerKey(b *testing.B) {
	const keys = 1 << 20
	for b.Loop() {
		tenants := make([]string, keys)
		for i := range tenants {
			tenants[i] = fmt.Sprintf("tenant-%07d", i)
		}
		set := testSet(b)
		runtime.GC()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		l := New(Config{AgentID: "a", MaxKeys: keys}, set)
		for i, tenant := range tenants {
			l.Check(0, Query{Tenant: tenant, Path: "/api/x", Operation: "GET"})
			if i%MaxBatch == MaxBatch-1 {
				grantAll(b, l, 0, 100*bucket.PerToken)
			}
		}
		grantAll(b, l, 0, 100*bucket.PerToken)
		runtime.GC()
		runtime.ReadMemStats(&after)
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/keys, "bytes/key")
		b.ReportMetric(float64(l.Keys()), "keys")
		runtime.KeepAlive(l)
		runtime.KeepAlive(tenants)
	}
}

var _ = time.Second

// TestEmergencyBucketSurvivesEviction: during an outage, a key whose entry the table's bound
// evicted comes back with the emergency bucket it had, not a full one, so one agent never
// allows more than C_e + r_e·w degraded on a key however the keys churn.
func TestEmergencyBucketSurvivesEviction(t *testing.T) {
	set, err := policy.Parse("test.yaml", []byte(`
version: "v1"
rules:
  - name: catalog
    routes: ["/products/{id}"]
    operations: [read]
    limit: 600/minute
    burst: 50
    on_failure: emergency
    emergency: {limit: 1/hour, burst: 3}
default:
  limit: 60/minute
  burst: 10
`))
	if err != nil {
		t.Fatal(err)
	}
	l := New(Config{AgentID: "a", MaxKeys: 1}, set)
	down := errors.New("coordinators unreachable")
	var now clock.Nanos
	// check answers q during the outage: a first check of a new entry waits for a refill, which
	// fails, and the failure mode answers the waiting check.
	check := func(tenant string) Verdict {
		t.Helper()
		q := Query{Tenant: tenant, Path: "/products/1", Operation: "GET"}
		for range 3 {
			v, err := l.Check(now, q)
			if err != nil {
				t.Fatal(err)
			}
			if v.Outcome != Wait {
				return v
			}
			for c := l.NextCall(now); c != nil; c = l.NextCall(now) {
				_ = l.Apply(now, c, Reply{Failure: Classify(down)})
			}
			now += clock.Nanos(time.Millisecond)
			select {
			case <-v.Ticket.Ready():
				if v := v.Ticket.Verdict(); v.Outcome != Wait {
					return v
				}
			default:
			}
		}
		t.Fatalf("%s: still waiting for a refill", tenant)
		return Verdict{}
	}
	degraded := 0
	for round := range 5 {
		for _, tenant := range []string{"acme", "bigcorp"} { // MaxKeys 1: each evicts the other
			for range 3 {
				if v := check(tenant); v.Outcome == Allow && v.Degraded {
					degraded++
				}
			}
		}
		if l.Keys() != 1 || l.Stats().Evicted.Load() < uint64(2*round+1) {
			t.Fatalf("round %d: %d keys, %d evictions; want the two tenants evicting each other", round, l.Keys(), l.Stats().Evicted.Load())
		}
	}
	if degraded != 6 {
		t.Fatalf("%d degraded allows on two keys whose emergency buckets hold 3 each (and refill 1 an hour), want 6", degraded)
	}
}
