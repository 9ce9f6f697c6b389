package agent

import (
	"github.com/leasebucket/leasebucket/policy"
	coordinatorv1 "github.com/leasebucket/leasebucket/proto/leasebucket/coordinator/v1"
)

// A direct check of a route with charges (lease: off on a rule with several limits, or on a rule a
// tenant budget covers) is one atomic take of its cost from every bucket the route charges, in one
// store operation: all or nothing, exact per request. On the agent it is a direct check of the
// route's own entry, as for a route of one bucket: it waits for that entry's refill, whose Acquire
// item names the other buckets (AcquireItem.also, alsoRefs); the grant serves only the checks that
// were waiting when the Acquire was first sent (grantLocked), and a denial names the bucket that
// refused (refusedBy). The entries of the other buckets are not used: they belong to the routes
// that charge them from leases, and the coordinator takes the direct check's cost from the
// buckets themselves. What a grant leaves unserved (a check that stopped waiting, or whose
// Acquire's answer was lost and came with the key's resend) goes back to every bucket it was taken
// from, in a Return of its own that names the same others (ReturnItem.also): each bucket credits
// its own decayed share (bucket.State.Return), so a refused check leaves nothing in any of them.
// It never rides with an Acquire (a take of several buckets credits nothing), and it goes alone
// whenever any bucket would credit some of it (handsBackAlone): no refill of the key carries it.

// directCharges reports whether a check of res is a direct check of several buckets.
func directCharges(res *resolved) bool { return res.charges && res.route.Rule.Direct }

// handsBackAlone reports whether e is the entry of a direct route with charges: what it hands
// back goes to every bucket its route charges, in a Return of its own.
func handsBackAlone(e *entry) bool {
	return e.rule.Direct && len(e.view.set.RouteByID(e.route).Charges()) > 0
}

// chargeLimits appends to out the limits of the other buckets e's direct route charges (those of
// handsBackAlone), skipping any its policy no longer resolves.
func (l *Limiter) chargeLimits(e *entry, out []*policy.Limits) []*policy.Limits {
	set := e.view.set
	for _, id := range set.RouteByID(e.route).Charges() {
		if lim, err := set.Limits(set.RouteByID(id), e.tenant, e.lim.Region); err == nil {
			out = append(out, lim)
		}
	}
	return out
}

// alsoRefs are the other buckets of e's direct Acquire item: its route's charges, in the policy's
// order, of e's tenant and region; nil for any other entry.
func (l *Limiter) alsoRefs(v *view, e *entry) []*coordinatorv1.BucketRef {
	if !e.rule.Direct {
		return nil
	}
	charges := v.set.RouteByID(e.route).Charges()
	if len(charges) == 0 {
		return nil
	}
	refs := make([]*coordinatorv1.BucketRef, len(charges))
	for i, id := range charges {
		refs[i] = routeRef(v.set.RouteByID(id), e.tenant, e.lim.Region)
	}
	return refs
}

// refusedBy is the rule and limits of the bucket that refused e's direct take of several buckets
// (AcquireResult.refused_bucket: 0 e's own, i the route's i-th charge), or e's own when the index
// names no charge.
func (l *Limiter) refusedBy(e *entry, refused uint32) (*policy.Rule, *policy.Limits) {
	if refused == 0 || !e.rule.Direct {
		return e.rule, e.lim
	}
	set := e.view.set
	charges := set.RouteByID(e.route).Charges()
	if int(refused) > len(charges) {
		return e.rule, e.lim
	}
	r := set.RouteByID(charges[refused-1])
	lim, err := set.Limits(r, e.tenant, e.lim.Region) // the region alsoRefs named it with
	if err != nil {
		return e.rule, e.lim
	}
	return r.Rule, lim
}
