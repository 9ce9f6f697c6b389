package agent

import (
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/policy"
)

// fastPathPolicy charges three buckets per check of /api: api, its second limit api#2, and the
// tenant budget trial, a shadow rule.
const fastPathPolicy = `
version: "v1"
rules:
  - name: api
    routes: ["/api/*"]
    operations: [read]
    limits:
      - {limit: 600000/minute, burst: 100000}
      - {limit: 6000000/hour, burst: 100000}
  - name: trial
    scope: tenant
    limit: 6000000/hour
    burst: 100000
    shadow: true
default:
  limit: 60/minute
  burst: 10
`

// chargedKey is a limiter whose key of /api holds a live lease in each of its three buckets, its
// links found: a check of it takes checkCharges' common case unless a test spoils a bucket.
func chargedKey(t *testing.T) (l *Limiter, q Query, own, second, budget *entry) {
	t.Helper()
	set, err := policy.Parse("test.yaml", []byte(fastPathPolicy))
	if err != nil {
		t.Fatal(err)
	}
	l = New(Config{AgentID: "a"}, set)
	q = Query{Tenant: "acme", Path: "/api/orders", Operation: "GET"}
	for range 4 { // the first check of each bucket waits for its first lease
		v, err := l.Check(0, q)
		if err != nil {
			t.Fatal(err)
		}
		if v.Outcome == Allow {
			break
		}
		grantAll(t, l, 0, 100_000*bucket.PerToken)
	}
	res, err := l.resolve(l.view.Load(), q)
	if err != nil {
		t.Fatal(err)
	}
	own = res.e
	ln := own.links.Load()
	if ln == nil || ln.n != 2 {
		t.Fatalf("links %+v, want api#2 and trial", ln)
	}
	for _, e := range ln.e[:ln.n] {
		switch e.rule.Name {
		case "api#2":
			second = e
		case "trial":
			budget = e
		}
	}
	if own.rule.Name != "api" || second == nil || budget == nil {
		t.Fatalf("/api charges %s and %v", own.rule.Name, ln.e[:ln.n])
	}
	for _, e := range []*entry{own, second, budget} {
		if e.tokens.Load() < 100*int64(bucket.PerToken) || e.expires.Load() <= int64(time.Second) || !e.touched.Load() {
			t.Fatalf("%s: %d µ until %d, touched %t: want a live lease of a used key", e.rule.Name, e.tokens.Load(), e.expires.Load(), e.touched.Load())
		}
		// The setup measured no demand, so the leases would refill only at need (lease.LowMark);
		// the cases are about keys busy enough to refill ahead of it.
		e.lowWater.Store(e.tokens.Load() * lease.LowWater / 1000)
	}
	if c := l.NextCall(0); c != nil {
		t.Fatalf("a call is queued after the setup: %+v", c)
	}
	return l, q, own, second, budget
}

// TestChargesFastPath: checkCharges' lock-free common case serves a check only when every bucket's
// lease serves it; anything else — a cached denial with a lease run dry, an expired or exhausted
// lease on the second bucket, a shadow rule's bucket run dry, an evicted bucket — is decided as
// spendAll decides it, and charges no bucket in part; a bucket that refuses for now (a cached
// denial, its lease run dry) refuses before anything is spent. A cached denial with a lease that
// still serves does not refuse (the coordinator paced the key: the lease is spent first).
func TestChargesFastPath(t *testing.T) {
	const now = clock.Nanos(time.Second)
	cost := int64(bucket.PerToken)
	for _, tc := range []struct {
		name    string
		spoil   func(l *Limiter, own, second, budget *entry)
		outcome Outcome
		rule    string // of the verdict
		shadow  bool
		charged []string // the buckets the check spent from
		retired []string // the buckets whose lease was retired, its tokens handed back
		refill  []string // the buckets with a refill queued afterwards
		refunds uint64   // spent and given back (spendAll spends up to a lease that cannot serve)
	}{{
		name:    "every lease serves",
		outcome: Allow, rule: "api", charged: []string{"api", "api#2", "trial"},
	}, {
		name: "the fewest left are reported",
		spoil: func(_ *Limiter, _, second, _ *entry) {
			second.tokens.Store(int64(2 * bucket.PerToken))
		},
		outcome: Allow, rule: "api#2", charged: []string{"api", "api#2", "trial"}, refill: []string{"api#2"},
	}, {
		name: "paced: a cached denial, the lease still serves",
		spoil: func(_ *Limiter, _, second, _ *entry) {
			second.deniedUntil.Store(int64(now + clock.Nanos(time.Minute)))
		},
		outcome: Allow, rule: "api", charged: []string{"api", "api#2", "trial"},
	}, {
		name: "a cached denial on the second limit, its lease run dry",
		spoil: func(_ *Limiter, _, second, _ *entry) {
			second.tokens.Store(cost - 1)
			second.deniedUntil.Store(int64(now + clock.Nanos(time.Minute)))
		},
		outcome: Deny, rule: "api#2",
	}, {
		name: "the second limit's lease expired",
		spoil: func(_ *Limiter, _, second, _ *entry) {
			second.expires.Store(int64(now))
		},
		refunds: 1, outcome: Wait, retired: []string{"api#2"}, refill: []string{"api#2"},
	}, {
		name: "the second limit's lease exhausted",
		spoil: func(_ *Limiter, _, second, _ *entry) {
			second.tokens.Store(cost - 1)
		},
		refunds: 1, outcome: Wait, refill: []string{"api#2"},
	}, {
		name: "the shadow budget denied, its lease run dry",
		spoil: func(_ *Limiter, _, _, budget *entry) {
			budget.tokens.Store(0)
			budget.deniedUntil.Store(int64(now + clock.Nanos(time.Minute)))
		},
		outcome: Allow, rule: "trial", shadow: true, charged: []string{"api", "api#2"}, refill: []string{"trial"},
	}, {
		name: "the second limit's entry evicted",
		spoil: func(l *Limiter, _, second, _ *entry) {
			l.retireEntry(second)
		},
		refunds: 1, outcome: Wait,
	}, {
		name: "the key's first limit denied, its lease run dry",
		spoil: func(_ *Limiter, own, _, _ *entry) {
			own.tokens.Store(0)
			own.deniedUntil.Store(int64(now + clock.Nanos(time.Minute)))
		},
		outcome: Deny, rule: "api",
	}} {
		t.Run(tc.name, func(t *testing.T) {
			l, q, own, second, budget := chargedKey(t)
			if tc.spoil != nil {
				tc.spoil(l, own, second, budget)
			}
			before := map[*entry]int64{own: own.tokens.Load(), second: second.tokens.Load(), budget: budget.tokens.Load()}
			refunds := func() uint64 { return l.Stats().Refunds.Load() + l.Stats().RefundsLost.Load() }
			refundsBefore := refunds()
			v, err := l.Check(now, q)
			if err != nil {
				t.Fatal(err)
			}
			if v.Outcome != tc.outcome || v.ShadowDeny != tc.shadow || (tc.rule != "" && v.Rule.Name != tc.rule) {
				t.Fatalf("Check = %v (shadow %t) by %v, want %v (shadow %t) by %s", v.Outcome, v.ShadowDeny, v.Rule.Name, tc.outcome, tc.shadow, tc.rule)
			}
			if got := refunds() - refundsBefore; got != tc.refunds {
				t.Errorf("%d refunds, want %d", got, tc.refunds)
			}
			for e, was := range before {
				want := was
				switch {
				case slices.Contains(tc.charged, e.rule.Name):
					want -= cost
				case slices.Contains(tc.retired, e.rule.Name) || e.dead.Load():
					want = 0
				}
				if got := e.tokens.Load(); got != want {
					t.Errorf("%s's lease holds %d µ, want %d µ", e.rule.Name, got, want)
				}
				if got, want := e.refilling.Load(), slices.Contains(tc.refill, e.rule.Name); got != want {
					t.Errorf("%s: refill queued %t, want %t", e.rule.Name, got, want)
				}
			}
			if v.Outcome == Allow && !v.ShadowDeny {
				least := min(own.tokens.Load()+own.remaining.Load(), second.tokens.Load()+second.remaining.Load(),
					budget.tokens.Load()+budget.remaining.Load())
				if v.Remaining != bucket.Micro(least) {
					t.Errorf("Remaining = %d µ, want %d µ: the bucket with the fewest left", v.Remaining, least)
				}
			}
		})
	}
}

// TestChargesFastPathRefund: a link that cannot serve once the check has spent from the buckets
// before it (a concurrent check took its tokens between the look and the spend) has every cost
// spent given back to the lease it came from. Here the second limit is linked twice and holds one
// check's cost: both looks find it, the second spend does not.
func TestChargesFastPathRefund(t *testing.T) {
	const now = clock.Nanos(time.Second)
	cost := int64(bucket.PerToken)
	l, q, own, second, budget := chargedKey(t)
	own.links.Store(&chargeLinks{n: 3, e: [policy.MaxCharges]*entry{budget, second, second}})
	second.tokens.Store(cost)
	before := map[*entry]int64{own: own.tokens.Load(), second: cost, budget: budget.tokens.Load()}
	refunds := l.Stats().Refunds.Load()
	v, err := l.Check(now, q)
	if err != nil {
		t.Fatal(err)
	}
	if v.Outcome != Wait {
		t.Fatalf("Check = %v, want wait for the second limit's refill", v.Outcome)
	}
	for e, was := range before {
		if got := e.tokens.Load(); got != was {
			t.Errorf("%s's lease holds %d µ, want the %d µ it held", e.rule.Name, got, was)
		}
	}
	// Three given back by checkCharges (api, trial, api#2), then three by each attempt of
	// spendAll, whose probe finds the lease usable again.
	if got, want := l.Stats().Refunds.Load()-refunds, uint64(3+3*maxAttempts); got != want || l.Stats().RefundsLost.Load() != 0 {
		t.Errorf("%d refunds (%d lost), want %d (none)", got, l.Stats().RefundsLost.Load(), want)
	}
}

// TestChargesFastPathRace: checks run while another spender keeps taking all of the tenant
// budget's tokens for a moment and giving them back (as concurrent checks of several buckets
// take and refund): whichever way each check goes, lock-free or through spendAll, every bucket
// is charged exactly for the checks allowed.
func TestChargesFastPathRace(t *testing.T) {
	const now = clock.Nanos(time.Second)
	cost := int64(bucket.PerToken)
	interfered := uint64(0) // checks the spender got in the way of: refunded or not allowed
	for round := range 5 {
		l, q, own, second, budget := chargedKey(t)
		before := map[*entry]int64{own: own.tokens.Load(), second: second.tokens.Load(), budget: budget.tokens.Load()}
		var done atomic.Bool
		var wg, checks sync.WaitGroup
		wg.Go(func() {
			for !done.Load() {
				if took := budget.tokens.Swap(0); took > 0 {
					runtime.Gosched()
					budget.tokens.Add(took)
				}
				runtime.Gosched()
			}
		})
		allowed := make([]int64, 3)
		for g := range allowed {
			checks.Go(func() {
				for range 2000 {
					v, err := l.Check(now, q)
					if err != nil {
						t.Error(err)
						return
					}
					if v.Outcome == Allow {
						allowed[g]++
					}
				}
			})
		}
		checks.Wait()
		done.Store(true)
		wg.Wait()
		var n int64
		for _, a := range allowed {
			n += a
		}
		for e, was := range before {
			if spent := was - e.tokens.Load(); spent != n*cost {
				t.Fatalf("round %d: %s's lease gave %d µ to %d checks allowed, want %d µ", round, e.rule.Name, spent, n, n*cost)
			}
		}
		t.Logf("round %d: %d of %d checks allowed, %d refunds", round, n, 3*2000, l.Stats().Refunds.Load())
		interfered += l.Stats().Refunds.Load() + uint64(3*2000-n)
	}
	if interfered == 0 {
		t.Fatal("the spender never got in the way of a check: the test does not reach the slow path")
	}
}

// TestChargesMarkLinksUsed: a check marks every bucket it charges used, not only its key's own,
// so that the eviction hand (which clears the marks as it passes) keeps the leases of a hot key's
// links as it keeps the key's.
func TestChargesMarkLinksUsed(t *testing.T) {
	l, q, own, second, budget := chargedKey(t)
	for _, e := range []*entry{second, budget} {
		e.touched.Store(false) // the hand passed
	}
	if v, err := l.Check(clock.Nanos(time.Second), q); err != nil || v.Outcome != Allow {
		t.Fatalf("Check = %v, %v", v.Outcome, err)
	}
	for _, e := range []*entry{own, second, budget} {
		if !e.touched.Load() {
			t.Errorf("%s not marked used by the check", e.rule.Name)
		}
	}
}

// TestFallbackRetryTicket: a retired key's "check again" ticket, met when the wait ran out, is
// answered fail-closed, never as the Wait it holds (which Envoy's API would read as OK).
func TestFallbackRetryTicket(t *testing.T) {
	l := New(Config{AgentID: "a"}, testSet(t))
	if v := l.Fallback(0, retryTicket); v.Outcome != Unavailable {
		t.Fatalf("Fallback of the retry ticket = %v, want unavailable", v.Outcome)
	}
}
