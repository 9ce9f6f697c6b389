package agent

import (
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"weak"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
)

// TestEvictionHoldsMemoryFlat: unbounded key churn through a bounded table keeps memory bounded.
// Once the table is full, every new key evicts one (its lease is returned, as the Refresher would
// send it). Churning many more keys evicts every entry the full table held, and nothing keeps an
// evicted entry alive: weak pointers to all of them are cleared by a collection. Counted, not
// measured: the table keeps its bound of keys, its slot arrays theirs, and no evicted entry stays.
func TestEvictionHoldsMemoryFlat(t *testing.T) {
	const maxKeys = 1 << 11
	l := New(Config{AgentID: "a", MaxKeys: maxKeys}, testSet(t))
	next := 0
	churn := func(n int) {
		for range n {
			q := Query{Tenant: "tenant-" + strconv.Itoa(next), Path: "/api/x", Operation: "GET"}
			next++
			if _, err := l.Check(0, q); err != nil {
				t.Fatal(err)
			}
			if next%MaxBatch == 0 {
				grantAll(t, l, 0, 10*bucket.PerToken) // and hands back the evicted keys' leases
			}
		}
	}
	churn(4 * maxKeys)
	tb := l.view.Load().table
	var full []weak.Pointer[entry]
	tb.each(func(e *entry) { full = append(full, weak.Make(e)) })
	if len(full) != maxKeys {
		t.Fatalf("%d entries after churning %d keys, want the table full at %d", len(full), next, maxKeys)
	}
	churn(32 * maxKeys)
	l.ExpireAll(0) // the sweep, which runs every few ms, forgets the evicted entries it visits

	if l.Keys() > maxKeys {
		t.Fatalf("%d keys after churning %d, want at most %d", l.Keys(), next, maxKeys)
	}
	for i := range tb.shards {
		sh := &tb.shards[i]
		// A shard grows to the smallest power of two holding 4× its live entries, which never
		// exceed its limit.
		bound := minSlots
		for bound < 4*sh.limit {
			bound *= 2
		}
		if n := len(sh.slots.Load().s); n > bound {
			t.Fatalf("shard %d: %d slots for at most %d keys, want at most %d", i, n, sh.limit, bound)
		}
	}
	runtime.GC()
	kept := 0
	for _, w := range full {
		if w.Value() != nil {
			kept++
		}
	}
	if kept > 0 {
		t.Fatalf("%d of the %d entries of the full table still reachable after %d more keys evicted them", kept, maxKeys, 32*maxKeys)
	}
	runtime.KeepAlive(l)
}

// TestTableBoundIsExact: whatever the bound, small or not a multiple of the shard count, the
// table fills to exactly maxKeys entries and never holds more.
func TestTableBoundIsExact(t *testing.T) {
	for _, maxKeys := range []int{1, 3, 63, 64, 100, 1000} {
		evicted := 0
		tb := newTable(maxKeys, func(*entry) { evicted++ })
		const inserts = 20_000
		for i := range inserts {
			tenant := "t-" + strconv.Itoa(i)
			tb.getOrInsert(tb.hash(1, tenant), 1, tenant, func() *entry { return &entry{} })
		}
		live := 0
		for i := range tb.shards {
			live += tb.shards[i].live
		}
		if live != maxKeys || evicted != inserts-maxKeys {
			t.Errorf("maxKeys %d: %d live entries and %d evictions after %d inserts, want %d and %d",
				maxKeys, live, evicted, inserts, maxKeys, inserts-maxKeys)
		}
	}
}

// TestSweepVisitsArmed: the expiry sweep walks only the entries that hold something. Keys with a
// lease are armed; once their leases expired and went back, none is, however many keys the table
// still holds, and a key that takes a lease again is armed again.
func TestSweepVisitsArmed(t *testing.T) {
	l := New(Config{AgentID: "a"}, testSet(t))
	armed := func() int {
		n := 0
		tb := l.view.Load().table
		for i := range tb.shards {
			sh := &tb.shards[i]
			sh.armMu.Lock()
			n += len(sh.armed)
			sh.armMu.Unlock()
		}
		return n
	}
	check := func(now clock.Nanos, tenant string) {
		t.Helper()
		if _, err := l.Check(now, Query{Tenant: tenant, Path: "/api/x", Operation: "GET"}); err != nil {
			t.Fatal(err)
		}
	}
	const keys = 1000
	for i := range keys {
		check(0, "tenant-"+strconv.Itoa(i))
	}
	grantAll(t, l, 0, 10*bucket.PerToken)
	if n := armed(); n != keys {
		t.Fatalf("%d entries armed with %d leases out", n, keys)
	}
	late := clock.Of(time.Hour) // every lease expired, and the refill since covers what it held
	l.ExpireAll(late)
	grantAll(t, l, late, 10*bucket.PerToken)
	if n := armed(); n != 0 || l.Keys() != keys {
		t.Fatalf("%d of %d entries armed after every lease expired and went back, want none", n, l.Keys())
	}
	if o := l.Outstanding(); o != 0 {
		t.Fatalf("%d µ outstanding", o)
	}
	check(late, "tenant-7")
	grantAll(t, l, late, 10*bucket.PerToken)
	if n := armed(); n != 1 {
		t.Fatalf("%d entries armed after one key took a lease again, want 1", n)
	}
}

// TestSweepConcurrent: the sweep runs through the armed lists while checks spend and wait, calls
// grant short leases and take hand-backs, and keys come and go from the lists; under -race, and
// at the end every granted token was spent, handed back or given up.
func TestSweepConcurrent(t *testing.T) {
	l := New(Config{AgentID: "a"}, testSet(t))
	var now atomic.Int64
	var allowed atomic.Int64
	var returned atomic.Int64
	stop := make(chan struct{})
	var bg sync.WaitGroup
	bg.Go(func() { // the coordinator: leases of 3 tokens that live 5 ms
		for {
			select {
			case <-stop:
				return
			default:
			}
			c := l.NextCall(clock.Nanos(now.Load()))
			if c == nil {
				runtime.Gosched()
				continue
			}
			returned.Add(c.HandedBack())
			r := answerAll(c, 3*bucket.PerToken)
			if r.Acquire != nil {
				for _, res := range r.Acquire.Results {
					res.TtlMs = 5
				}
			}
			if err := l.Apply(clock.Nanos(now.Load()), c, r); err != nil {
				t.Error(err)
				return
			}
		}
	})
	bg.Go(func() { // the sweep, with time moving on
		for {
			select {
			case <-stop:
				return
			default:
			}
			now.Add(int64(100 * time.Microsecond))
			l.Expire(clock.Nanos(now.Load()), DefaultSweepShards)
		}
	})
	var checkers sync.WaitGroup
	for g := range 4 {
		checkers.Go(func() {
			for i := range 2000 {
				q := Query{Tenant: "tenant-" + strconv.Itoa((g*37+i)%150), Path: "/api/x", Operation: "GET"}
				for {
					v, err := l.Check(clock.Nanos(now.Load()), q)
					if err != nil {
						t.Error(err)
						return
					}
					if v.Outcome == Wait {
						<-v.Ticket.Ready()
						v = v.Ticket.Verdict()
					}
					if v.Outcome == Allow {
						allowed.Add(1)
					}
					if v.Outcome != Wait {
						break
					}
				}
			}
		})
	}
	checkers.Wait()
	// Every lease expires; only the sweep visits the idle keys that still hold one.
	now.Add(int64(time.Second))
	for deadline := time.Now().Add(5 * time.Second); l.Outstanding() != 0; {
		if time.Now().After(deadline) {
			t.Fatalf("%d µ still held a second after every lease expired: the sweep missed a key", l.Outstanding())
		}
		time.Sleep(time.Millisecond)
	}
	close(stop)
	bg.Wait()
	l.Close()
	_, back := handedBack(t, l, clock.Nanos(now.Load()))
	s := l.Stats()
	spent := allowed.Load() * int64(bucket.PerToken)
	if got := spent + returned.Load() + back + int64(s.SkippedMicro.Load()) + int64(s.LostMicro.Load()); got != int64(s.GrantedMicro.Load()) || got == 0 {
		t.Fatalf("granted %d µ; spent %d + handed back %d + given up %d + lost %d = %d µ",
			s.GrantedMicro.Load(), spent, returned.Load()+back, s.SkippedMicro.Load(), s.LostMicro.Load(), got)
	}
}
