package coordinator_test

import (
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/coordinator/redisstore"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
	"github.com/leasebucket/leasebucket/policy"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

const calendarPolicy = `version: v1
rules:
  - name: daily
    routes: [/daily]
    operations: [read]
    quota: 3/day
    timezone: America/New_York
    lease: off
  - name: monthly
    routes: [/monthly]
    operations: [read]
    quota: 100/month
default:
  limit: 10/minute
`

// TestCalendarQuota runs calendar quotas through the service on memstore and on Redis, with the
// coordinator's clock and the store's clock apart: the quota is exact within a day, all of it is
// there again at midnight in the rule's zone, a lease ends with its period, a lease of the
// period comes back whole and an old period's lease not at all, and a store clock outside the
// window fails the item rather than miscount.
func TestCalendarQuota(t *testing.T) {
	stores := map[string]func(t *testing.T, clock func() bucket.Millis) coordinator.Store{
		"memstore": func(_ *testing.T, clock func() bucket.Millis) coordinator.Store {
			return memstore.New(memstore.WithClock(clock))
		},
		"redis": func(t *testing.T, clock func() bucket.Millis) coordinator.Store {
			return redisstore.New(redistest.Start(t).Client(t), redisstore.WithClock(clock))
		},
	}
	for name, newStore := range stores {
		t.Run(name, func(t *testing.T) {
			set, err := policy.Parse("calendar.yaml", []byte(calendarPolicy))
			if err != nil {
				t.Fatal(err)
			}
			ny, _ := time.LoadLocation("America/New_York")
			now := time.Date(2026, 3, 7, 23, 59, 0, 0, ny) // the coordinator's clock
			lag := time.Duration(0)                        // how far the store's clock is behind it
			store := newStore(t, func() bucket.Millis { return bucket.Millis(now.Add(-lag).UnixMilli()) })
			svc := coordinator.NewService(store, set, coordinator.WithClock(func() time.Time { return now }))
			seq := uint64(0)
			tenant := "acme"
			take := func(rule string, want, least bucket.Micro) *coordinatorv1.AcquireResult {
				t.Helper()
				seq++
				resp, err := svc.Acquire(ctxFor(t, 10*time.Second), acquire("agent-1", seq, "v1", item(ref(rule, tenant), want, least)))
				if err != nil {
					t.Fatal(err)
				}
				return resp.Results[0]
			}
			for i := range 3 {
				if r := take("daily", tok, tok); r.Status != coordinatorv1.Status_STATUS_OK || r.GrantedMicro != int64(tok) {
					t.Fatalf("check %d of 3 = %v, want granted", i+1, r)
				}
			}
			// The fourth waits until midnight in New York: a minute.
			if r := take("daily", tok, tok); r.Status != coordinatorv1.Status_STATUS_DENIED || r.RetryAfterMs != 60_000 {
				t.Fatalf("fourth check = %v, want denied for 60000 ms", r)
			}
			now = now.Add(time.Minute)
			for i := range 3 {
				if r := take("daily", tok, tok); r.Status != coordinatorv1.Status_STATUS_OK {
					t.Fatalf("check %d after midnight = %v, want granted", i+1, r)
				}
			}
			// A lease of the monthly quota: granted from the 100 tokens, living at most until the
			// month ends (here far more than the lease lifetime).
			g := take("monthly", 10*tok, tok)
			if g.Status != coordinatorv1.Status_STATUS_OK || g.GrantedMicro < int64(tok) || g.TtlMs <= 0 {
				t.Fatalf("monthly lease = %v", g)
			}
			seq++
			back, err := svc.Return(ctxFor(t, 10*time.Second), &coordinatorv1.ReturnRequest{AgentId: "agent-1", Seq: seq, PolicyVersion: "v1",
				Items: []*coordinatorv1.ReturnItem{{Bucket: ref("monthly", "acme"), UnspentMicro: g.GrantedMicro, GrantedAtMs: g.GrantedAtMs}}})
			if err != nil || back.Results[0].CreditedMicro != g.GrantedMicro {
				t.Fatalf("hand-back of the whole lease = %v, %v; want all %d µ credited (no decay in a period)", back, err, g.GrantedMicro)
			}
			// Ten seconds before the month ends, a lease lives ten seconds at most.
			now = time.Date(2026, 3, 31, 23, 59, 50, 0, time.UTC)
			if r := take("monthly", 10*tok, tok); r.Status != coordinatorv1.Status_STATUS_OK || r.TtlMs > 10_000 {
				t.Fatalf("lease at the end of the month = %v, want one ending with it (ttl <= 10000 ms)", r)
			}
			// The store's clock more than CalendarSlack behind the coordinator's, on a key it has
			// not seen later: not counted. (A key keeps its latest reading, so acme's would not.)
			lag, tenant = coordinator.CalendarSlack+5*time.Minute, "beta"
			now = time.Date(2026, 4, 1, 0, 5, 0, 0, time.UTC) // April for the coordinator, March for the store
			if r := take("monthly", tok, tok); r.Status != coordinatorv1.Status_STATUS_STORE_UNAVAILABLE {
				t.Fatalf("store clock %v behind = %v, want STORE_UNAVAILABLE", lag, r)
			}
			lag, tenant = 0, "acme"
			if r := take("monthly", 100*tok, 100*tok); r.Status != coordinatorv1.Status_STATUS_OK {
				t.Fatalf("the whole quota in April = %v, want granted", r)
			}
		})
	}
}
