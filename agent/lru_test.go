package agent

import (
	"runtime"
	"strconv"
	"testing"

	"github.com/leasebucket/leasebucket/internal/bucket"
)

// TestEvictionHoldsHeapFlat: unbounded key churn through a bounded table keeps the heap flat.
// Once the table is full, every new key evicts one (its lease is returned, as the Refresher would
// send it), so churning eight times as many keys again leaves the heap where it was.
func TestEvictionHoldsHeapFlat(t *testing.T) {
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
	heap := func() uint64 {
		runtime.GC()
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	churn(4 * maxKeys)
	full := heap()
	churn(32 * maxKeys)
	after := heap()
	if bound := (maxKeys + 63) / 64 * 64; l.Keys() > bound {
		t.Fatalf("%d keys after churning %d, want at most %d", l.Keys(), next, bound)
	}
	if after > full+full/4 {
		t.Fatalf("heap grew from %d to %d bytes while churning %d more keys through a table of %d", full, after, 32*maxKeys, maxKeys)
	}
	t.Logf("heap %d bytes with the table full, %d after %d more keys", full, after, 32*maxKeys)
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
