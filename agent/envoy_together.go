package agent

import (
	"context"
	"errors"
	"time"

	"github.com/leasebucket/leasebucket/internal/bucket"
	"github.com/leasebucket/leasebucket/policy"
)

// decideTogether decides the descriptors of one Envoy request all or nothing (the policy's
// envoy.charge: all_or_nothing, the default): the buckets of every descriptor — its route's and
// the route's charges, each at the descriptor's cost — are spent together, as one check of
// several buckets (charges.go), or none is. A refusing bucket decides its descriptor's status;
// the other descriptors are answered with their limits and are not charged (their slots are
// marked uncharged: not counted as decisions, not audited). Waits share one bound as in settle.
// It reports false, having decided nothing, when a descriptor's rule is in direct mode: such a
// request is charged per descriptor.
func (s *Server) decideTogether(ctx context.Context, slots []slot) bool {
	now := s.now()
	wait := s.maxWait
	if d, ok := ctx.Deadline(); ok {
		wait = min(wait, time.Until(d)-deadlineMargin)
	}
	timer := time.NewTimer(max(wait, 0))
	defer timer.Stop()
	for decided := false; !decided; {
		cs, owners, err := s.together(slots)
		if errors.Is(err, errDirectTogether) {
			return false
		}
		if err != nil {
			for i := range slots {
				s.resolve(&slots[i], Verdict{}, err)
			}
			return true
		}
		v, j := s.lim.spendAll(now, cs)
		switch {
		case j < 0:
			for i := range slots {
				s.resolve(&slots[i], allowCharges(chargesOf(cs, owners, i)), nil)
			}
			decided = true
		case v.Outcome != Wait:
			s.refuseTogether(slots, owners[j], v)
			decided = true
		case v.Ticket == retryTicket:
			// Concurrent checks took the tokens found, or a key was retired: look again.
		default:
			select {
			case <-v.Ticket.Ready():
				if tv := v.Ticket.Verdict(); tv.Outcome != Wait {
					s.refuseTogether(slots, owners[j], tv)
					decided = true
				}
			case <-timer.C:
				s.metrics.fallback()
				s.refuseTogether(slots, owners[j], s.lim.Fallback(s.now(), v.Ticket))
				decided = true
			case <-ctx.Done():
				s.lim.Fallback(s.now(), v.Ticket) // leaves its key's queue
				for i := range slots {
					s.resolve(&slots[i], Verdict{}, ctx.Err())
				}
				return true
			}
		}
		now = s.now()
	}
	s.recordAll(apiEnvoy, now, slots)
	return true
}

// refuseTogether answers a request whose descriptor refused decided it with v: the others are
// answered uncharged.
func (s *Server) refuseTogether(slots []slot, refused int, v Verdict) {
	for i := range slots {
		if i == refused {
			s.resolve(&slots[i], v, nil)
			continue
		}
		u := Verdict{Outcome: Allow}
		if res, err := s.lim.resolve(s.lim.view.Load(), slots[i].q); err == nil {
			u.Rule, u.Limits = res.route.Rule, res.lim
			if res.e != nil {
				u.Remaining = res.e.tokensLeft()
			}
		}
		s.resolve(&slots[i], u, nil)
		slots[i].uncharged = true
	}
}

// together resolves the descriptors against the current view and lists their buckets, each with
// its descriptor's index.
func (s *Server) together(slots []slot) ([]charge, []int, error) {
	v := s.lim.view.Load()
	if v.closed.Load() {
		return nil, nil, ErrClosed
	}
	var cs []charge
	var owners []int
	for i := range slots {
		res, err := s.lim.resolve(v, slots[i].q)
		if err != nil {
			return nil, nil, err
		}
		var one [policy.MaxCharges + 1]charge
		n := 1
		if res.route.Rule.Direct {
			return nil, nil, errDirectTogether
		}
		if res.charges {
			n = s.lim.chargeEntries(&res, slots[i].q.Tenant, &one)
		} else {
			e := res.e
			if e == nil {
				e = s.lim.insert(&res, slots[i].q.Tenant)
			} else if !e.touched.Load() {
				e.touched.Store(true)
			}
			one[0] = charge{e: e, cost: res.cost}
		}
		for _, c := range one[:n] {
			if c.e.rule.Direct {
				return nil, nil, errDirectTogether
			}
			cs = append(cs, c)
			owners = append(owners, i)
		}
	}
	return cs, owners, nil
}

// chargesOf are the charges of descriptor i.
func chargesOf(cs []charge, owners []int, i int) []charge {
	first := -1
	for k, o := range owners {
		if o == i && first < 0 {
			first = k
		}
		if o > i {
			return cs[first:k]
		}
	}
	return cs[first:]
}

// errDirectTogether: a descriptor's rule is lease: off; its check is one take in the global
// bucket, which cannot be made together with other buckets' leases. Such requests are charged
// per descriptor.
var errDirectTogether = errors.New("agent: a descriptor's rule is in direct mode")

// tokensLeft is what a response reports as left of the entry's bucket.
func (e *entry) tokensLeft() bucket.Micro { return bucket.Micro(e.tokens.Load() + e.remaining.Load()) }
