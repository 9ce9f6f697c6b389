package agent

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/leasebucket/leasebucket/internal/clock"
)

// TestDebugChangesNothing: listing and explaining read an entry without touching it: the
// eviction flag, the lease, the refill state and the table are as they were.
func TestDebugChangesNothing(t *testing.T) {
	set := testSet(t)
	clk := clock.NewManual(clock.Of(1e9))
	l := New(Config{AgentID: "a"}, set)
	q := Query{Tenant: "acme", Path: "/api/orders", Operation: "GET"}
	if _, err := l.Check(clk.Now(), q); err != nil {
		t.Fatal(err)
	}
	v := l.view.Load()
	var e *entry
	v.table.each(func(x *entry) { e = x })
	snapshot := func() [5]int64 {
		b2i := func(b bool) int64 {
			if b {
				return 1
			}
			return 0
		}
		return [5]int64{e.tokens.Load(), e.expires.Load(), b2i(e.touched.Load()), b2i(e.refilling.Load()), int64(l.Keys())}
	}
	before := snapshot()
	queued, _ := l.Pending()
	h := DebugHandler(l, clk)
	for _, url := range []string{"/debug/leases?all=1", "/debug/explain?tenant=acme&route=/api/orders&op=GET",
		"/debug/explain?tenant=other&route=/api/orders&op=GET"} {
		rr := httptest.NewRecorder()
		h.ServeHTTP(rr, httptest.NewRequest(http.MethodGet, url, nil))
		if rr.Code != http.StatusOK {
			t.Fatalf("%s: %d %s", url, rr.Code, rr.Body)
		}
	}
	if after := snapshot(); after != before {
		t.Fatalf("entry state %v after the debug calls, was %v", after, before)
	}
	if n, _ := l.Pending(); n != queued {
		t.Fatalf("refills queued %d, was %d", n, queued)
	}
}
