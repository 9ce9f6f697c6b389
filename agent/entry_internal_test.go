package agent

import (
	"fmt"
	"testing"
	"unsafe"

	"github.com/leasebucket/leasebucket/internal/bucket"
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
