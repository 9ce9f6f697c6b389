package agent

import (
	"testing"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
	"github.com/leasebucket/leasebucket/internal/lease"
	"github.com/leasebucket/leasebucket/policy"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// grantAll answers every call the core has due at now: each refill with a grant of size (a long
// lease), each lease handed back with a full credit.
func grantAll(t testing.TB, l *Limiter, now clock.Nanos, size bucket.Micro) {
	t.Helper()
	for c := l.NextCall(now); c != nil; c = l.NextCall(now) {
		if err := l.Apply(now, c, answerAll(c, size)); err != nil {
			t.Fatal(err)
		}
	}
}

// answerAll is a coordinator's answer to c granting size to each refill and crediting every lease
// handed back in full.
func answerAll(c *Call, size bucket.Micro) Reply {
	if c.Acquire == nil {
		resp := &coordinatorv1.ReturnResponse{}
		for _, it := range c.Return.Items {
			resp.Results = append(resp.Results, &coordinatorv1.ReturnResult{Status: coordinatorv1.Status_STATUS_OK, CreditedMicro: it.UnspentMicro})
		}
		return Reply{Return: resp}
	}
	resp := &coordinatorv1.AcquireResponse{}
	for _, it := range c.Acquire.Items {
		resp.Results = append(resp.Results, &coordinatorv1.AcquireResult{
			Status: coordinatorv1.Status_STATUS_OK, GrantedMicro: int64(size), TtlMs: 60_000, GrantedAtMs: 1, CreditedMicro: it.ReturnMicro,
		})
	}
	for _, it := range c.Acquire.Returns {
		resp.Returns = append(resp.Returns, &coordinatorv1.ReturnResult{Status: coordinatorv1.Status_STATUS_OK, CreditedMicro: it.UnspentMicro})
	}
	return Reply{Acquire: resp}
}

// handedBack sends every call due at now and sums the leases they hand back (count and µ), all
// credited in full; refills are granted nothing.
func handedBack(t testing.TB, l *Limiter, now clock.Nanos) (leases int, micro int64) {
	t.Helper()
	for c := l.NextCall(now); c != nil; c = l.NextCall(now) {
		micro += c.HandedBack()
		if c.Acquire != nil {
			for _, it := range c.Acquire.Items {
				if it.ReturnMicro > 0 {
					leases++
				}
			}
		}
		leases += c.Keys() - len(c.Refs())
		if err := l.Apply(now, c, answerAll(c, 0)); err != nil {
			t.Fatal(err)
		}
	}
	return leases, micro
}

// parseSet parses a policy file's text.
func parseSet(tb testing.TB, text string) *policy.Set {
	tb.Helper()
	set, err := policy.Parse("test.yaml", []byte(text))
	if err != nil {
		tb.Fatal(err)
	}
	return set
}

// itemAsk is what a refill item asks of the grant rule, as the coordinator reads it.
func itemAsk(it *coordinatorv1.AcquireItem) lease.Ask {
	return lease.Ask{Needed: bucket.Micro(it.NeededMicro), Least: bucket.Micro(it.MinMicro),
		Demand: bucket.Micro(it.DemandMicroPerSecond), Regular: it.Regular}
}

// routeBucket is the bucket limit of tenant's key on the route set matches path and op to, and one
// request's cost on it in µ.
func routeBucket(tb testing.TB, set *policy.Set, path, op, tenant string) (bucket.Limit, bucket.Micro) {
	tb.Helper()
	route, err := set.Match(path, op)
	if err != nil {
		tb.Fatal(err)
	}
	limits, err := set.Limits(route, tenant, "")
	if err != nil {
		tb.Fatal(err)
	}
	return limits.Bucket, bucket.Micro(set.Cost(route)) * bucket.PerToken
}

// answerSized answers call c as a coordinator with a bucket of lim that never runs low would: each
// refill granted what the grant rule sizes (requests of cost; its ample want with ample) for the
// lease's lifetime, each hand-back credited in full.
func answerSized(tb testing.TB, l *Limiter, now clock.Nanos, lim bucket.Limit, cost bucket.Micro, c *Call, ample bool) {
	tb.Helper()
	r := answerAll(c, 0)
	if c.Acquire != nil {
		for i, it := range c.Acquire.Items {
			p, err := lease.Size(lim, cost, false, itemAsk(it))
			if err != nil {
				tb.Fatal(err)
			}
			size := p.Want
			if ample {
				size = p.AmpleWant
			}
			res := r.Acquire.Results[i]
			res.GrantedMicro, res.TtlMs, res.GrantedAtMs = int64(size), p.TTL.Milliseconds(), int64(now/clock.Nanos(time.Millisecond))
		}
	}
	if err := l.Apply(now, c, r); err != nil {
		tb.Fatal(err)
	}
}
