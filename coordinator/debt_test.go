package coordinator_test

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/leasebucket/leasebucket/coordinator"
	"github.com/leasebucket/leasebucket/coordinator/memstore"
	"github.com/leasebucket/leasebucket/coordinator/redisstore"
	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/testkit/redistest"
	"github.com/leasebucket/leasebucket/policy"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// debtPolicy: metered refills a token every 100 ms up to 10 and lets costs settled after the
// response take it 4 tokens below zero; its checks are direct takes (lease: off), so every grant
// is exactly what was asked. The default rule has no max_debt.
const debtPolicy = `version: d1
rules:
  - name: metered
    routes: [/metered]
    operations: [read]
    limit: 10/second
    burst: 10
    max_debt: 4
    lease: off
default:
  limit: 60/minute
  burst: 10
`

// TestDebtOverGRPC: an item's debt_micro is charged before its take, even below zero down to the
// rule's max_debt, the rest forgiven; a debt-only item grants nothing and is OK; takes are denied
// until refills repay the debt, with a retry_after that counts it; a retried call charges nothing
// again. On memory and on Redis, through the gRPC server.
func TestDebtOverGRPC(t *testing.T) {
	set, err := policy.Parse("debt.yaml", []byte(debtPolicy))
	if err != nil {
		t.Fatal(err)
	}
	now := bucket.Millis(1_700_000_000_000)
	clock := func() bucket.Millis { return now }
	for _, b := range []struct {
		name  string
		store func(t *testing.T) coordinator.Store
	}{
		{"memory", func(*testing.T) coordinator.Store { return memstore.New(memstore.WithClock(clock)) }},
		{"redis", func(t *testing.T) coordinator.Store {
			return redisstore.New(redistest.Start(t).Client(t), redisstore.WithClock(clock))
		}},
	} {
		t.Run(b.name, func(t *testing.T) {
			reg := prometheus.NewRegistry()
			m, err := coordinator.NewMetrics(reg)
			if err != nil {
				t.Fatal(err)
			}
			r := startReplica(t, coordinator.NewService(b.store(t), set, coordinator.WithMetrics(m)), coordinator.ServerOptions{})
			metered := ref("metered", "acme-"+b.name)
			seq := uint64(0)
			call := func(items ...*coordinatorv1.AcquireItem) *coordinatorv1.AcquireResult {
				t.Helper()
				seq++
				resp, err := r.client.Acquire(ctxFor(t, 10*time.Second), acquire("agent-1", seq, "d1", items...))
				if err != nil {
					t.Fatal(err)
				}
				return resp.Results[0]
			}
			debt := func(needed, d bucket.Micro) *coordinatorv1.AcquireItem {
				it := item(metered, needed, needed)
				it.DebtMicro = int64(d)
				return it
			}
			check := func(what string, got *coordinatorv1.AcquireResult, status coordinatorv1.Status, granted, remaining, charged bucket.Micro, retry int64) {
				t.Helper()
				if got.Status != status || got.GrantedMicro != int64(granted) || got.RemainingMicro != int64(remaining) ||
					got.DebtChargedMicro != int64(charged) || got.RetryAfterMs != retry {
					t.Fatalf("%s: %v, want %v granted %d remaining %d debt charged %d retry %d ms",
						what, got, status, granted, remaining, charged, retry)
				}
			}
			OK, DENIED := coordinatorv1.Status_STATUS_OK, coordinatorv1.Status_STATUS_DENIED

			check("take 8", call(item(metered, 8*tok, 8*tok)), OK, 8*tok, 2*tok, 0, 0)
			// A cost settled after the response, alone: 2 tokens are there, 3 go into debt.
			first := debt(0, 5*tok)
			check("debt 5", call(first), OK, 0, -3*tok, 5*tok, 0)
			// The same call again (same agent and seq): answered from the record, charged once.
			resp, err := r.client.Acquire(ctxFor(t, 10*time.Second), acquire("agent-1", seq, "d1", first))
			if err != nil {
				t.Fatal(err)
			}
			if got := resp.Results[0]; !got.Replayed || got.DebtChargedMicro != int64(5*tok) || got.RemainingMicro != int64(-3*tok) {
				t.Fatalf("retried debt: %v, want the first answer replayed", got)
			}
			// Denied until the debt and the cost are there: 4 tokens, 400 ms.
			check("take 1 in debt", call(item(metered, tok, tok)), DENIED, 0, -3*tok, 0, 400)
			// Beyond max_debt the rest is forgiven: 1 of 3 tokens charged, before the take.
			check("debt 3 with a take", call(debt(tok, 3*tok)), DENIED, 0, -4*tok, tok, 500)
			check("debt at max_debt", call(debt(0, tok)), OK, 0, -4*tok, 0, 0)
			now += 500
			check("take 1 repaid", call(item(metered, tok, tok)), OK, tok, 0, 0, 0)
			// A rule without max_debt charges a settled cost only while tokens are there.
			def, err := set.Match("/other", "read")
			if err != nil {
				t.Fatal(err)
			}
			other := &coordinatorv1.AcquireItem{Bucket: &coordinatorv1.BucketRef{Rule: def.Rule.Name, Route: def.Template(),
				Operation: def.Operation(), Tenant: "acme-" + b.name}, DebtMicro: int64(12 * tok)}
			check("debt on the default rule", call(other), OK, 0, 0, 10*tok, 0)
			// A negative debt, or one beyond 2^52, is malformed and charges nothing.
			for _, d := range []int64{-1, bucket.MaxExact/2 + 1} {
				it := debt(0, 0)
				it.DebtMicro = d
				if got := call(it); got.Status != coordinatorv1.Status_STATUS_INVALID {
					t.Fatalf("debt_micro %d: %v, want STATUS_INVALID", d, got)
				}
			}
			check("after the invalid ones", call(item(metered, 0+tok, tok)), DENIED, 0, 0, 0, 100)
			// Charged and forgiven tokens are counted (the replay is not).
			if got := gather(t, reg, "leasebucket_coordinator_debt_tokens_total"); got != 5+1+10 {
				t.Errorf("debt_tokens_total = %v, want 16", got)
			}
			if got := gather(t, reg, "leasebucket_coordinator_debt_forgiven_tokens_total"); got != 2+1+2 {
				t.Errorf("debt_forgiven_tokens_total = %v, want 5", got)
			}
		})
	}
}
