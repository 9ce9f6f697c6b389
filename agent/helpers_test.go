package agent

import (
	"testing"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/internal/clock"
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
