package agent

import (
	"fmt"
	"runtime"
	"testing"
	"time"
	"unsafe"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
)

// TestEntrySize: an entry fits Go's 208-byte size class, which with its tenant string and table
// slot keeps a key of the lease table within 256 bytes (BenchmarkMemoryPerKey measures the whole).
// A field that must be added goes into slowState unless every key needs it all the time.
func TestEntrySize(t *testing.T) {
	if n := unsafe.Sizeof(entry{}); n > 208 {
		t.Fatalf("an entry is %d bytes, more than the 208-byte size class the 256-byte budget a key allows", n)
	}
}

// TestSlowStateReleased: keys whose first check waited for its refill, once granted, hold no slow
// state — a table of cold keys costs the entries alone — while a key with a prefetched lease, a
// hand-back or a waiting check holds it.
func TestSlowStateReleased(t *testing.T) {
	l := New(Config{AgentID: "a", MaxKeys: 4096}, testSet(t))
	for i := range 2000 {
		if _, err := l.Check(0, Query{Tenant: fmt.Sprintf("t-%d", i), Path: "/api/x", Operation: "GET"}); err != nil {
			t.Fatal(err)
		}
		if i%MaxBatch == MaxBatch-1 {
			grantAll(t, l, 0, 100*bucket.PerToken)
		}
	}
	waiting := 0
	l.view.Load().table.each(func(e *entry) {
		e.mu.Lock()
		if e.slow != nil && len(e.slow.waiting) > 0 {
			waiting++
		}
		e.mu.Unlock()
	})
	if waiting == 0 {
		t.Fatal("no key holds a waiting check before the last grant: the test does not test")
	}
	grantAll(t, l, 0, 100*bucket.PerToken)
	held := 0
	l.view.Load().table.each(func(e *entry) {
		e.mu.Lock()
		if e.slow != nil {
			held++
		}
		e.mu.Unlock()
	})
	if held > 0 {
		t.Fatalf("%d of 2000 granted keys still hold slow state with nothing in it", held)
	}
}

// TestColdExpiryAllocatesNothing: the expiry of a cold key's lease, spent or with a remainder the
// refill since its grant covers (given up, not handed back), allocates no slow state.
func TestColdExpiryAllocatesNothing(t *testing.T) {
	const keys = 2000
	for _, tc := range []struct {
		name    string
		granted bucket.Micro // per key; each key's one check spends a token
	}{{"spent", bucket.PerToken}, {"remainder", 2 * bucket.PerToken}} {
		t.Run(tc.name, func(t *testing.T) {
			l := New(Config{AgentID: "a", MaxKeys: 4096}, testSet(t))
			for i := range keys {
				if _, err := l.Check(0, Query{Tenant: fmt.Sprintf("t-%d", i), Path: "/api/x", Operation: "GET"}); err != nil {
					t.Fatal(err)
				}
				if i%MaxBatch == MaxBatch-1 {
					grantAll(t, l, 0, tc.granted)
				}
			}
			grantAll(t, l, 0, tc.granted)
			st := l.Stats()
			expired, skipped := st.Expired.Load(), st.ReturnsSkipped.Load()
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			mallocs := ms.Mallocs
			l.ExpireAll(clock.Nanos(10 * time.Minute)) // the leases lived a minute; the refill covers a token
			runtime.ReadMemStats(&ms)
			if n := ms.Mallocs - mallocs; n > keys/20 {
				t.Errorf("expiring %d cold keys' leases allocated %d times, want none per key", keys, n)
			}
			if got := st.Expired.Load() - expired; tc.name == "spent" && got != 0 {
				t.Errorf("%d spent leases counted expired with tokens, want 0", got)
			}
			if tc.name == "remainder" {
				if got := st.ReturnsSkipped.Load() - skipped; got != keys {
					t.Errorf("%d remainders given up, want %d", got, keys)
				}
				if c := l.NextCall(clock.Nanos(10 * time.Minute)); c != nil {
					t.Errorf("a call after the expiry: %v, want none (every remainder given up)", c)
				}
			}
		})
	}
}
